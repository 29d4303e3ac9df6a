"""What the coordinator knows of its two pools: their ModelInfo, refreshed now and then, and
whether the draft may speculate for the target."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from specdec.core.errors import FailedPrecondition
from specdec.core.protocols import Deadline
from specdec.rpc.clients import DraftClient, TargetClient
from specdec.v1 import common_pb2

_INFO_REFRESH_S = 60.0


@dataclass(frozen=True)
class PoolInfo:
    target: common_pb2.ModelInfo
    draft: common_pb2.ModelInfo | None  # None: not asked for yet (K = 0 requests only)
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
    """ModelInfo of both pools, checked against the coordinator's tokenizer and each other."""

    def __init__(self, draft: DraftClient, target: TargetClient, tokenizer_name: str, fingerprint: str):
        self.draft = draft
        self.target = target
        self.tokenizer_name = tokenizer_name
        self.fingerprint = fingerprint
        self._info: PoolInfo | None = None
        self._info_at = 0.0
        self._lock = threading.Lock()

    def info(self, deadline: Deadline, need_draft: bool) -> PoolInfo:
        """Target (and draft) ModelInfo; refreshed every minute."""
        with self._lock:
            info = self._info
            fresh = info is not None and time.monotonic() - self._info_at < _INFO_REFRESH_S
            if fresh and (info.draft is not None or not need_draft):
                return info
            target = self.target.info(deadline)
            if target.tokenizer_fingerprint != self.fingerprint:
                raise FailedPrecondition(
                    f"the coordinator's tokenizer ({self.tokenizer_name!r}) does not match the target model "
                    f"{target.model_id!r}: set the coordinator's tokenizer to the target's model"
                )
            draft, error = None, None
            if need_draft:
                draft = self.draft.info(deadline)
                error = compatibility_error(draft, target)
            self._info = PoolInfo(target, draft, error)
            self._info_at = time.monotonic()
            return self._info
