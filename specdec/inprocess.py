"""The whole pipeline in one process: both models loaded here, no servers and no Redis.

It runs the coordinator's own request path (`coordinator.generation.Generator`: validation,
tokenisation, the engine, text streaming, stats) with in-process drafter and verifier, so the
only thing it leaves out is the distributed part (gRPC, serialisation, sessions). The ratio of
the two modes on the same prompts is that part's cost (`make bench --in-process`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from coordinator.generation import Generator
from coordinator.pools import PoolInfo, compatibility_error
from coordinator.settings import CoordinatorSettings
from specdec.client import build_request
from specdec.core.engine import SpeculativeEngine
from specdec.core.protocols import NO_DEADLINE
from specdec.models.sources import DEFAULT_DRAFT, DEFAULT_MODEL, TokenizerText
from specdec.v1 import coordinator_pb2


def _pool_info(target, draft) -> PoolInfo:
    if draft is None:
        return PoolInfo(target.info, None, "no draft model is loaded: use num_speculative_tokens=0")
    return PoolInfo(target.info, draft.info, compatibility_error(draft.info, target.info))


def _load(target: str, draft: str | None, lookup: str | None, target_lookup: str | None = None):
    """(target LoadedModel, its own lookup draft or None, the draft a draft service would serve
    (`ServedDraft`) or None, the target's tokenizer). Each model's settings are its service's:
    flags none, SPECDEC_TARGET_* / SPECDEC_DRAFT_* env vars, then `target`, `target_lookup`,
    `draft` (model, ngram or suffix) and `lookup` (hybrid) when given."""
    import os

    from draft_service.loading import load_draft
    from draft_service.settings import DraftSettings
    from specdec.core.lookup import lookup_drafter
    from specdec.models.sources import load_tokenizer
    from specdec.models.threads import set_torch_threads
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    set_torch_threads(1)  # before this thread's first torch op: no team of its own (`load_model`)

    target_overrides = {"model": target} | ({} if target_lookup is None else {"lookup": target_lookup})
    target_settings = load_settings(TargetSettings, [], os.environ, prog="target settings", **target_overrides)
    loaded_target = load_model(target_settings, "target")
    own_lookup = None
    if target_settings.lookup:  # (named in its Info, as the target service's)
        loaded_target.info.lookup = target_settings.lookup
        own_lookup = lookup_drafter(target_settings.lookup, target_settings)
    tokenizer = load_tokenizer(target)
    if not draft:
        return loaded_target, own_lookup, None, tokenizer
    overrides = {"model": draft, "tokenizer": target} | ({} if lookup is None else {"lookup": lookup})
    settings = load_settings(DraftSettings, [], os.environ, prog="draft settings", **overrides)
    return loaded_target, own_lookup, load_draft(settings, tokenizer), tokenizer


class InProcessPipeline:
    """`generate` / `stream` as `SpecdecClient` offers them, served by models in this process."""

    def __init__(
        self,
        target: str = DEFAULT_MODEL,
        draft: str | None = DEFAULT_DRAFT,
        lookup: str | None = None,
        target_lookup: str | None = None,
        **coordinator_settings,
    ):
        """`draft`: a model, 'ngram', 'suffix' or None; `lookup` ('ngram' / 'suffix') with a model:
        hybrid (None: SPECDEC_DRAFT_LOOKUP, as the draft service reads it); `target_lookup` ('' /
        'ngram' / 'suffix'): the target's own lookup, which then drafts every round (None:
        SPECDEC_TARGET_LOOKUP, as the target service reads it)."""
        from target_service.verifier import LocalVerifier

        # Load on a thread that then ends, as the model services do: torch ops on a long-lived
        # thread (the caller's) leave an OpenMP team behind that slows every multi-row forward
        # the model thread runs later (a 2-token Verify here: ~150 ms against ~113 ms).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-loader") as loader:
            loading = loader.submit(_load, target, draft, lookup, target_lookup)
            self.target, self.target_lookup, self.draft, self.tokenizer = loading.result()
        pools = _pool_info(self.target, self.draft)
        drafter = None if self.draft is None else self.draft.drafter
        if self.draft is not None and self.draft.runner is not None:
            # One OpenMP team for both models, as one service process has for its one model.
            self.draft.runner.share_model_thread(self.target.runner)
        self.decode = TokenizerText(self.tokenizer)
        engine = SpeculativeEngine(drafter, LocalVerifier(self.target.runner, self.target_lookup), self.decode)
        if self.draft is None and self.target_lookup is None:
            coordinator_settings.setdefault("default_num_speculative_tokens", "0")
        settings = CoordinatorSettings(tokenizer=target, **coordinator_settings)
        self.generator = Generator(settings, engine, lambda deadline, need_draft: pools, self.tokenizer, store=None)

    def close(self) -> None:
        """Fail what is still running (UNAVAILABLE), then free both models' caches and end their
        thread. Idempotent; also `with InProcessPipeline(...) as pipeline:`."""
        from specdec.models.scheduler import scheduler_for

        runners = [p.runner for p in (self.draft, self.target) if p is not None and p.runner is not None]
        for runner in runners:  # the draft first: it borrows the target's thread
            if not runner.closed:
                scheduler_for(runner).close("the in-process pipeline is closed")
                runner.close()

    def clear_caches(self) -> None:
        """Empty both models' KV caches: the next request computes its whole prompt (benchmarks)."""
        for part in (self.target, self.draft):
            if part is not None and part.runner is not None:
                part.runner.on_model_thread(part.runner.cache.clear)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | Sequence[int], **kwargs) -> coordinator_pb2.GenerateResponse:
        return self.generator.generate(build_request(prompt, **kwargs), NO_DEADLINE, lambda: True)

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[coordinator_pb2.GenerateChunk]:
        return self.generator.stream(build_request(prompt, **kwargs), NO_DEADLINE, lambda: True)
