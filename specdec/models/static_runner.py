"""A static-shape path for cached forwards: one preallocated KV cache and a compiled model.

On a GPU the eager Hugging Face forward is launch-bound (an H200 with random weights: 19.3 ms a
token at 0.5B and 21.9 ms at 7B, so a draft costs 0.88 of its target and speculation cannot pay);
a static cache with torch.compile's CUDA graphs brings that to 2.68 and 7.59 ms. CUDA graphs
replay fixed shapes at fixed addresses, whence the layout here:

- One working `StaticCache` of `max_len` positions, at fixed addresses. The session whose keys and
  values it holds (the *resident*) runs with no copy at all, which is the common case (a draft's K
  steps, a stream's next round). A call from another session first saves the resident's valid
  prefix (per layer, [0, length)) and copies its own saved prefix in. One cache rather than one
  per session because CUDA graphs re-record whenever a static input's address changes.
- New-token counts padded up to a bucket (1, 2, 4, 8, 16): one compiled graph per bucket. Pad
  tokens sit after the real ones, so causal attention keeps them out of every real position; their
  keys/values land past the session's length, which is set before every call, so a later call
  overwrites them before any query can read them.
- Longer runs (a prompt) and buckets that would not fit in the cache run the model eagerly on the
  same cache; sequences longer than the cache take `ModelRunner`'s eager path (a DynamicCache).

Cache semantics are `ModelRunner`'s: the same `_CacheEntry`s in the same LRU (prefix reuse,
rollback after rejections, bounds on entries and tokens), their `kv` a `_StaticKV`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

from specdec.models.runner import (
    LogitsResult,
    ModelRunner,
    SessionKVCache,
    StepItem,
    _CacheEntry,
    _check_request,
    _reusable_positions,
)

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)  # new-token counts a compiled graph exists for (padded up)
AUTO, ON, OFF = "auto", "on", "off"
COMPILE_CHOICES = (AUTO, ON, OFF)
_PAD_ID = 0  # any id: pad positions are never read


def use_static_path(setting: str, device: torch.device, needs_target_hidden: bool = False) -> bool:
    """Whether a service runs `StaticModelRunner`: `auto` on CUDA only (on a CPU the compiled
    forward gains little and compiling costs seconds per bucket), `on` / `off` as said."""
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {setting!r}")
    if needs_target_hidden:
        # Its forwards take fed hidden states (inputs_embeds) of every length: not this path.
        if setting == ON:
            log.warning("compile=on ignored: a draft fed the target's hidden states runs eagerly")
        return False
    return setting == ON or (setting == AUTO and device.type == "cuda")


def make_runner(model, cache: SessionKVCache, compile_setting: str = AUTO, max_len: int = 4096) -> ModelRunner:
    """The runner a service uses for `model`: static and compiled where `use_static_path` says so."""
    from specdec.models.draft_artifact import needs_target_hidden

    device = next(model.parameters()).device
    if use_static_path(compile_setting, device, needs_target_hidden(model)):
        return StaticModelRunner(model, cache, max_len=max_len)
    return ModelRunner(model, cache)


def bucket_for(new_tokens: int, start: int, capacity: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket holding `new_tokens` that fits after `start` positions in a cache of
    `capacity`; None: run the exact shape eagerly."""
    for bucket in buckets:
        if bucket >= new_tokens and start + bucket <= capacity:
            return bucket
    return None


class _StaticKV:
    """A session's keys/values: in the working cache while resident, else saved per layer."""

    __slots__ = ("__weakref__", "length", "saved")

    def __init__(self) -> None:
        self.length = 0  # positions [0, length) hold this session's keys/values
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: [1, H_kv, length, D] x 2


def _set_length(work, length: int) -> None:
    """Make the working cache hold `length` positions: the next forward writes from there on."""
    for layer in work.layers:
        layer.cumulative_length.fill_(length)


class StaticModelRunner(ModelRunner):
    """`ModelRunner` whose cached forwards (`last_logits`, `step`) run on a static cache with a
    compiled model; `batch_forward` (uncached) stays eager."""

    def __init__(
        self,
        model,
        cache: SessionKVCache,
        max_len: int = 4096,
        buckets: Sequence[int] = BUCKETS,
        backend: str = "inductor",
        mode: str | None = None,
        max_positions: int | None = None,
        dynamic: bool | None = None,
    ):
        super().__init__(model, cache, max_positions)
        self.max_len = min(max_len, self.max_positions) if self.max_positions else max_len
        self.buckets = tuple(sorted(buckets))
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"  # CUDA graphs (on a CPU inductor would skip them anyway)
        # Graphs per model: decode and one for the other buckets, each with hidden states asked or
        # not; and the limit counts every compiled model of one class together (the draft's and
        # the target's forward are one code object). Past it dynamo would run eagerly, unannounced.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # dynamic=None: the decode graph (1 row) is specialised; the first other bucket recompiles
        # with the row count symbolic, and the later buckets reuse that graph (CUDA graphs still
        # record one replay per bucket shape). Two compiles per model rather than one per bucket:
        # a 7B-shaped model compiles in about a minute each.
        self._compiled = torch.compile(model, backend=backend, mode=mode, dynamic=dynamic)
        self._work = None  # the StaticCache, built on first use (on the model thread)
        self._resident: weakref.ref[_StaticKV] | None = None
        self.compiled_forwards = 0  # forwards that ran a compiled graph (tests, logs)
        self.eager_forwards = 0  # forwards that ran the model eagerly on the static cache
        self.restores = 0  # saved prefixes copied back into the working cache

    # ------------------------------------------------------------ the ModelRunner interface

    @torch.inference_mode()
    def last_logits(
        self,
        session_id: str,
        token_ids: Sequence[int],
        num_last: int,
        hidden_from: int | None = None,
        input_hidden: torch.Tensor | None = None,
        exact_len: int | None = None,
    ) -> LogitsResult:
        """`ModelRunner.last_logits`, on the static cache (see the module's docstring)."""
        token_ids = list(token_ids)
        if input_hidden is not None or len(token_ids) > self.max_len:
            return self._eager_last_logits(session_id, token_ids, num_last, hidden_from, input_hidden, exact_len)
        _check_request(len(token_ids), num_last, hidden_from)
        want_hidden = hidden_from is not None
        with self._lock:
            entry, reuse = self._take_static(session_id, token_ids, num_last, hidden_from)
            # On an exception the entry is not put back (its kv may be half-written).
            with self._threads(len(token_ids) - reuse):
                logits, ran = self._run(entry.kv, reuse, token_ids[reuse:], num_last, want_hidden)
            hidden = self._settle(
                session_id, entry, token_ids, reuse, hidden_from, exact_len, ran if want_hidden else None
            )
            return LogitsResult(logits, reuse, hidden)

    def step(self, items: Sequence[StepItem]) -> list[LogitsResult]:
        """`last_logits` per item on the static path (not batched across sequences yet)."""
        return [
            self.last_logits(i.session_id, i.token_ids, i.num_last, i.hidden_from, i.input_hidden, i.exact_len)
            for i in items
        ]

    # ------------------------------------------------------------ cache entries

    def _take_static(
        self, session_id: str, token_ids: list[int], num_last: int, hidden_from: int | None
    ) -> tuple[_CacheEntry, int]:
        """(the session's entry, or a fresh one; how many leading positions it keeps)."""
        entry = self.cache.take(session_id) if session_id else None
        reuse = 0
        if entry is not None and isinstance(entry.kv, _StaticKV):
            reuse = _reusable_positions(entry, token_ids, num_last, hidden_from)
        if reuse <= 0:
            self.cache.misses += 1
            return _CacheEntry([], _StaticKV()), 0
        self.cache.hits += 1
        entry.kv.length = min(entry.kv.length, reuse)  # the rollback: later positions are stale
        return entry, reuse

    def _eager_last_logits(self, session_id, token_ids, num_last, hidden_from, input_hidden, exact_len):
        """ModelRunner's own path (DynamicCache), after dropping a static entry it cannot read."""
        if session_id:
            with self._lock:
                entry = self.cache.take(session_id)
                if entry is not None and not isinstance(entry.kv, _StaticKV):
                    self.cache.put(session_id, entry)  # its own kind: back, as the most recent
        return super().last_logits(session_id, token_ids, num_last, hidden_from, input_hidden, exact_len)

    # ------------------------------------------------------------ the working cache

    def _working_cache(self):
        if self._work is None:
            from transformers import StaticCache

            config = self.model.config.get_text_config(decoder=True)
            heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
            head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
            dtype = next(self.model.parameters()).dtype
            self._work = StaticCache(config=self.model.config, max_cache_len=self.max_len)
            # Allocated (and marked static for CUDA graphs) now, outside any compiled region.
            self._work.early_initialization(1, heads, head_dim, dtype, self.device)
        return self._work

    def _make_resident(self, kv: _StaticKV, reuse: int) -> None:
        """Put `kv`'s first `reuse` positions in the working cache, saving the resident's first."""
        work = self._working_cache()
        current = self._resident() if self._resident is not None else None
        if current is kv:
            return
        if current is not None and current.length > 0:
            # [1, H_kv, length, D] per layer; an evicted resident is gone (its weakref is dead).
            current.saved = [
                (layer.keys[:, :, : current.length].clone(), layer.values[:, :, : current.length].clone())
                for layer in work.layers
            ]
        if kv.saved is not None:
            for layer, (keys, values) in zip(work.layers, kv.saved, strict=True):
                layer.keys[:, :, :reuse].copy_(keys[:, :, :reuse])
                layer.values[:, :, :reuse].copy_(values[:, :, :reuse])
            kv.saved = None
            self.restores += 1
        self._resident = weakref.ref(kv)

    def _run(
        self, kv: _StaticKV, reuse: int, new_tokens: list[int], num_last: int, want_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([num_last, V] float32 logits, [n, H] final hidden states or None) of the n new tokens
        after `reuse` cached positions; `kv` is resident afterwards, holding reuse + n positions."""
        self._make_resident(kv, reuse)
        work = self._work
        n = len(new_tokens)
        bucket = bucket_for(n, reuse, self.max_len, self.buckets)
        width = bucket or n
        ids = torch.tensor([new_tokens + [_PAD_ID] * (width - n)], dtype=torch.long, device=self.device)  # [1, w]
        positions = torch.arange(reuse, reuse + width, device=self.device).unsqueeze(0)  # [1, w]
        _set_length(work, reuse)
        kv.length = reuse  # until the forward has written the new positions
        if bucket is not None:
            torch.compiler.cudagraph_mark_step_begin()  # earlier outputs are copied out already
            out = self._compiled(
                input_ids=ids, position_ids=positions, cache=work, use_cache=True, output_hidden_states=want_hidden
            )
            self.compiled_forwards += 1
            logits = out.logits[0, n - num_last : n]  # [num_last, V]: every row ran (one graph per bucket)
        else:
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                cache=work,
                use_cache=True,
                logits_to_keep=num_last,
                output_hidden_states=want_hidden,
            )
            self.eager_forwards += 1
            logits = out.logits[0]  # [num_last, V]
        ran = out.hidden_states[-1][0, :n].float().cpu() if want_hidden else None  # [n, H]
        kv.length = reuse + n
        return logits.float().cpu(), ran
