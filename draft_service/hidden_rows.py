"""The target's hidden-state rows a draft keeps between Proposes, so each carries only new ones.

A caller names its copy of a sequence's rows with a key (`DraftSequence.hidden_states_key`) and,
once the draft has served it, sends only the rows past `hidden_states_offset`. The draft joins
them with the rows it kept under that key. Row t is the target's state at prefix position t, a
function of tokens 0..t alone: kept rows fit a new prefix as far as the tokens agree. Anything
else (no entry, too few rows, a prefix that diverged earlier) is a HiddenStatesMiss, and the
caller resends from row 0.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from specdec.core.errors import HiddenStatesMiss
from specdec.core.tokens import common_prefix_length

RESEND = "resend target_hidden_states from row 0 (hidden_states_offset=0)"


class HiddenRowStore:
    """LRU of (prefix tokens, [len(prefix) - 1, H] rows) per key, bounded by entries and by rows
    over all entries; safe to share between gRPC worker threads."""

    def __init__(self, max_entries: int, max_rows: int):
        self.max_entries = max_entries
        self.max_rows = max_rows
        self._entries: OrderedDict[str, tuple[list[int], np.ndarray]] = OrderedDict()
        self._rows = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_rows(self) -> int:
        return self._rows

    def join(self, key: str, prefix: list[int], offset: int, rows: np.ndarray) -> np.ndarray:
        """[len(prefix) - 1, H]: the kept rows 0..offset-1, then `rows` ([len(prefix) - 1 - offset, H]).

        Reads only: HiddenStatesMiss when the rows before `offset` are not held for this prefix.
        """
        if offset == 0:
            return rows
        with self._lock:
            entry = self._entries.get(key) if key else None
        if entry is None:
            raise HiddenStatesMiss(
                f"hidden_states_offset={offset}, but this draft replica keeps no hidden states under "
                f"hidden_states_key {key!r} (never sent here, or evicted): {RESEND}"
            )
        tokens, kept = entry
        agree = common_prefix_length(tokens, prefix)
        if kept.shape[0] < offset or agree < offset:
            raise HiddenStatesMiss(
                f"hidden_states_offset={offset} does not line up with the rows this draft keeps under "
                f"{key!r} ({kept.shape[0]} rows, of a prefix that agrees with this one on {agree} tokens): {RESEND}"
            )
        return np.concatenate([kept[:offset], rows])

    def keep(self, key: str, prefix: list[int], rows: np.ndarray) -> None:
        """Keep `rows` ([len(prefix) - 1, H]) under `key`, replacing its entry; "" keeps nothing."""
        if not key or self.max_entries <= 0 or rows.shape[0] > self.max_rows:
            return
        with self._lock:
            self._drop(key)
            self._entries[key] = (list(prefix), rows)
            self._rows += rows.shape[0]
            while len(self._entries) > self.max_entries or self._rows > self.max_rows:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._rows -= entry[1].shape[0]
