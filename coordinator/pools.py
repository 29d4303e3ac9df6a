"""What the coordinator knows of its two pools: their ModelInfo, refreshed in the background, and
whether the draft may speculate for the target."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from specdec.core.draft_health import DraftHealth
from specdec.core.errors import FailedPrecondition, ServiceError
from specdec.core.protocols import NO_DEADLINE, Deadline
from specdec.rpc.clients import DraftClient, TargetClient
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolInfo:
    target: common_pb2.ModelInfo
    draft: common_pb2.ModelInfo | None  # None: not asked for yet (K = 0 requests only), or not answering
    compatible_error: str | None  # why speculative rounds are refused, if they are


def check_compatible(draft: common_pb2.ModelInfo, target: common_pb2.ModelInfo) -> None:
    """FailedPrecondition unless the draft's token ids mean what the target's do."""
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab size {draft.vocab_size} vs {target.vocab_size}")
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        problems.append("tokenizer fingerprints differ")
    if draft.needs_target_hidden_states and draft.hidden_size != target.hidden_size:
        problems.append(
            f"the draft reads hidden states of width {draft.hidden_size}, the target's are {target.hidden_size}"
        )
    if problems:
        raise FailedPrecondition(
            f"draft model {draft.model_id!r} and target model {target.model_id!r} are incompatible "
            f"({'; '.join(problems)}): speculative rounds are refused; use num_speculative_tokens=0 "
            "or pair models that share a tokenizer"
        )


def compatibility_error(draft: common_pb2.ModelInfo, target: common_pb2.ModelInfo) -> str | None:
    """Why speculative rounds with this pair are refused, or None when they are not."""
    try:
        check_compatible(draft, target)
    except FailedPrecondition as exc:
        return str(exc)
    return None


class Pools:
    """ModelInfo of both pools, checked against the coordinator's tokenizer and each other.

    Only a request that comes before the target's info is known waits for it (and one that needs
    the draft, before the draft's first Info has answered or failed); later, stale info is
    refreshed on a background thread and requests go on with what is known. A draft whose Info
    fails is treated as down (DraftHealth, shared with the engine): requests run at K = 0 and one
    of them asks again after the back-off.
    """

    def __init__(
        self,
        draft: DraftClient,
        target: TargetClient,
        tokenizer_name: str,
        fingerprint: str,
        refresh_s: float = 60.0,
        health: DraftHealth | None = None,
    ):
        self.draft = draft
        self.target = target
        self.tokenizer_name = tokenizer_name
        self.fingerprint = fingerprint
        self.refresh_s = refresh_s
        self.health = health if health is not None else getattr(draft, "health", None) or DraftHealth()
        self._info: PoolInfo | None = None
        self._info_at = 0.0
        self._draft_asked = False  # whether a draft Info has answered or failed yet
        # Held only while a call is made that requests must wait for: the first Info of each pool.
        self._target_lock = threading.Lock()
        self._draft_lock = threading.Lock()
        self._state_lock = threading.Lock()  # guards the fields below; never held across a call
        self.refresher: threading.Thread | None = None

    def info(self, deadline: Deadline, need_draft: bool) -> PoolInfo:
        """Target (and, when `need_draft` and the draft answers, draft) ModelInfo."""
        info = self._info
        if info is None:
            info = self._first_target_info(deadline)
        elif time.monotonic() - self._info_at >= self.refresh_s:
            self._refresh_in_background()
        if need_draft and info.draft is None and not info.target.lookup:  # (such a target drafts itself)
            info = self._draft_info(deadline)
        return info

    def _first_target_info(self, deadline: Deadline) -> PoolInfo:
        with self._target_lock:
            if self._info is None:
                self._store(self._checked_target(self.target.info(deadline)), None)
            return self._info

    def _draft_info(self, deadline: Deadline) -> PoolInfo:
        """Asks the draft for its info unless another call is asking (then: what is known); only
        calls before the first answer wait for it."""
        if not self._draft_lock.acquire(blocking=not self._draft_asked):
            return self._info
        try:
            if self._info.draft is None and self.health.may_propose():
                draft = self._ask_draft(deadline)
                if draft is not None:
                    self._store(self._info.target, draft)
            return self._info
        finally:
            self._draft_asked = True
            self._draft_lock.release()

    def _ask_draft(self, deadline: Deadline) -> common_pb2.ModelInfo | None:
        """The draft's ModelInfo; None (and the draft marked down) when it does not answer."""
        try:
            draft = self.draft.info(deadline)
        except ServiceError as exc:
            deadline.check()
            log.warning("draft Info failed; requests run at K=0 for %.0f s: %s", self.health.backoff_s, exc)
            self.health.failed()
            return None
        self.health.succeeded()
        return draft

    def _checked_target(self, target: common_pb2.ModelInfo) -> common_pb2.ModelInfo:
        if target.tokenizer_fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"the coordinator's tokenizer ({self.tokenizer_name!r}) does not match the target model "
                f"{target.model_id!r}: set the coordinator's tokenizer to the target's model"
            )
        return target

    def _store(self, target: common_pb2.ModelInfo | None, draft: common_pb2.ModelInfo | None) -> None:
        with self._state_lock:
            if target is None:
                self._info = None
                return
            error = compatibility_error(draft, target) if draft is not None else None
            self._info = PoolInfo(target, draft, error)
            self._info_at = time.monotonic()

    def _refresh_in_background(self) -> None:
        with self._state_lock:
            if self.refresher is not None and self.refresher.is_alive():
                return
            self.refresher = threading.Thread(target=self.refresh, name="pool-info-refresh", daemon=True)
            self.refresher.start()

    def refresh(self) -> None:
        """Asks both pools again (the draft only if it was known and is not backing off); keeps
        what is known when a pool does not answer, forgets it all when the target's tokenizer changed."""
        known = self._info
        if known is None:
            return
        try:
            target = self._checked_target(self.target.info(NO_DEADLINE))
        except FailedPrecondition as exc:
            log.error("%s", exc)
            target = None  # the next request asks again, and fails with this
        except ServiceError as exc:
            log.warning("target Info failed; keeping what is known: %s", exc)
            target = known.target
        draft = known.draft
        if draft is not None and self.health.healthy:
            draft = self._ask_draft(NO_DEADLINE) or draft
        self._store(target, draft)
