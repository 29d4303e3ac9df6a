"""Model forward passes behind a small interface, with a per-session KV cache.

`ModelRunner.last_logits` (one sequence, cached) and `batch_forward` (independent sequences,
uncached) are what the services need from a model: the logits at the last `num_last`
positions of token sequences, and optionally final hidden states. Whether the
KV cache helped is invisible to the result: a miss recomputes from the tokens
the request carries, so correctness never depends on the cache.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from specdec.core.errors import Unavailable
from specdec.core.tokens import common_prefix_length
from specdec.models.draft_artifact import fused_inputs, needs_target_hidden
from specdec.models.fused import fused_layers
from specdec.models.kv_cache import (
    SharedRoot,
    cache_dtype,
    copy_cache,
    fork_cache,
    new_cache,
    set_cache_dtype,
    shareable,
    shared_prefix,
)
from specdec.models.ragged import build_batch, compiled_attention_ok, ragged_forward, supports_ragged

# Set on every model thread (the executors' initializer): close() must not wait for its own thread.
_MODEL_THREAD = threading.local()


def _mark_model_thread() -> None:
    _MODEL_THREAD.active = True


# A session without a cache entry starts from a copy of another's that shares at least this many
# leading tokens (a system prompt); fresh items of one step sharing as many compute them once.
MIN_SHARED_PREFIX = 16
# A shared prefix at least this long is stored once and read by all its sessions (on a CPU, with
# ragged attention: `kv_cache.fork_cache`); a shorter one is copied into each. Decode and Verify
# rows read a prefix in the compiled attention kernel at no extra cost (the same arithmetic over
# two buffers); segments too long for it (a prompt's rest) and hosts without the kernel pay one
# more attention call a layer and a merge (cascade attention; SmolLM2-135M before the kernel read
# prefixes, 400 cached tokens of which 350 shared: a decode alone 34.4 vs 32.7 ms private), so a
# short prefix, whose copy is small, stays copied.
MIN_STORED_ONCE = 256


@dataclass
class _CacheEntry:
    token_ids: list[int]  # the tokens whose keys/values `kv` holds
    kv: object  # transformers Cache
    # Final hidden states of the first rows of token_ids ([n, H]): kept when asked for, and by a
    # target that has been asked once (`ModelRunner.keeps_hidden`) on every forward.
    hidden: torch.Tensor | None = None
    # The buffer `hidden` is the first rows of ([capacity, H]): a call's new rows go in place, not
    # into a copy of all of them (rows cost ~10% of a position's float16 keys/values; the room at
    # most doubles that).
    hidden_room: torch.Tensor | None = None
    # Positions whose keys/values are a function of the tokens alone. A draft fed its own
    # hidden state for speculative positions stores those too, but they are not reusable.
    exact_len: int | None = None


class SessionKVCache:
    """LRU of per-session KV caches, bounded by entry count and total stored tokens: an entry's own
    positions, plus each shared prefix its entries read once (`kv_cache.fork_cache`).

    Mutated under the runner's lock; the metrics thread reads only counters (a running
    token total, so a scrape never iterates a dict another thread is changing).
    """

    def __init__(self, max_entries: int, max_tokens: int):
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._charges: dict[str, tuple[SharedRoot | None, int]] = {}  # session -> (its prefix, own tokens)
        self._readers: dict[int, int] = {}  # id(prefix root) -> entries here reading it
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_tokens(self) -> int:
        return self._tokens

    def take(self, session_id: str) -> _CacheEntry | None:
        """Remove and return the entry (the caller owns it until `put`)."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._uncharge(session_id)
        return entry

    def put(self, session_id: str, entry: _CacheEntry) -> None:
        if self.max_entries <= 0 or len(entry.token_ids) > self.max_tokens:
            return
        self.take(session_id)
        self._entries[session_id] = entry
        self._charge(session_id, entry)
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            evicted, _ = self._entries.popitem(last=False)
            self._uncharge(evicted)

    def _charge(self, session_id: str, entry: _CacheEntry) -> None:
        root, shared = shared_prefix(entry.kv)
        own = len(entry.token_ids) - shared
        self._charges[session_id] = (root, own)
        self._tokens += own
        if root is not None:
            readers = self._readers.get(id(root), 0)
            self._tokens += 0 if readers else root.length
            self._readers[id(root)] = readers + 1

    def _uncharge(self, session_id: str) -> None:
        root, own = self._charges.pop(session_id)
        self._tokens -= own
        if root is not None:
            self._readers[id(root)] -= 1
            if not self._readers[id(root)]:
                del self._readers[id(root)]
                self._tokens -= root.length

    def recharge(self, session_id: str) -> None:
        """The entry's keys/values changed layout in place (`kv_cache.fork_cache` moved its first
        positions into a shared prefix): its charge is taken anew, its LRU place kept."""
        self._uncharge(session_id)
        self._charge(session_id, self._entries[session_id])

    def drop(self, session_id: str) -> None:
        self.take(session_id)

    def clear(self) -> None:
        self._entries.clear()
        self._charges.clear()
        self._readers.clear()
        self._tokens = 0

    def peek(self, session_id: str) -> _CacheEntry | None:
        """The entry, left in place and in its LRU position (None without one)."""
        return self._entries.get(session_id)

    def items(self) -> list[tuple[str, _CacheEntry]]:
        """Every (session, entry), most recently used first (left in place)."""
        return list(reversed(self._entries.items()))

    def token_ids(self, session_id: str) -> list[int] | None:
        """The tokens the session's entry holds keys/values for, None without one (tests, debugging)."""
        entry = self._entries.get(session_id)
        return None if entry is None else list(entry.token_ids)


@dataclass(frozen=True)
class StepItem:
    """One sequence's part of a batched step (`ModelRunner.step`): what `last_logits` takes."""

    session_id: str  # KV-cache key; "" = uncached
    token_ids: Sequence[int]
    num_last: int
    hidden_from: int | None = None
    input_hidden: torch.Tensor | None = None
    exact_len: int | None = None
    # Drafted rows a shared step may leave out (`specdec.models.draft_rows`): the tokens each of
    # the last len(gains) rows' drafts adds in expectation, non-increasing; the runner ignores it.
    gains: tuple[float, ...] = ()


@dataclass(frozen=True)
class LogitsResult:
    logits: torch.Tensor  # [num_last, V] float32 on CPU
    cached_tokens: int  # prefix tokens whose keys/values came from the cache
    hidden: torch.Tensor | None = None  # [len(token_ids) - hidden_from, H] float32 on CPU, when asked
    step_sequences: int = 1  # items of the one batched forward this ran in (1: a forward of its own)
    step_rows: int = 0  # new rows of all those items (0: not counted); set by `scheduler.step_items`


# ---------------------------------------------------------------- last_logits, step by step
#
# Three prefix lengths meet in one cached call:
#   common prefix - the entry's tokens agree with the request's up to here (past it: a rollback);
#   exact_len     - the entry's keys/values up to here are a function of the tokens alone;
#   stored rows   - the entry's final hidden states cover positions 0..rows-1.
# The reused positions are the shortest of what each allows; everything after them runs.


def _check_request(num_tokens: int, num_last: int, hidden_from: int | None) -> None:
    if not 1 <= num_last <= num_tokens:
        raise ValueError(f"num_last={num_last} for {num_tokens} tokens")
    if hidden_from is not None and not 0 <= hidden_from <= num_tokens - num_last:
        raise ValueError(f"hidden_from={hidden_from} for {num_tokens} tokens, {num_last} to score")


def _stored_rows(entry: _CacheEntry) -> int:
    return 0 if entry.hidden is None else entry.hidden.shape[0]


def _reusable_positions(entry: _CacheEntry, token_ids: list[int], num_last: int, hidden_from: int | None) -> int:
    """How many of the entry's leading positions this call may keep (0: run everything)."""
    # Past the first token that differs, the keys/values belong to another continuation; and
    # the last num_last positions must run to produce their logits.
    reuse = min(common_prefix_length(entry.token_ids, token_ids), len(token_ids) - num_last)
    if entry.exact_len is not None:
        # A hidden-state draft fed its own guesses past exact_len: those positions are not reusable.
        reuse = min(reuse, entry.exact_len)
    if hidden_from is not None and hidden_from < reuse:
        # Rows [hidden_from, reuse) would have to come from the stored ones: reuse no further than
        # they reach, or than hidden_from (from there on, the forward runs every row asked for).
        reuse = min(reuse, max(_stored_rows(entry), hidden_from))
    return reuse


def _crop(entry: _CacheEntry, reuse: int) -> _CacheEntry | None:
    """The entry holding keys/values of its first `reuse` positions only; None when reuse is 0."""
    if reuse <= 0:
        return None
    cached_len = len(entry.token_ids)
    if cached_len > reuse:
        entry.kv.crop(reuse - cached_len)  # negative: drop that many trailing tokens
    return entry


_MIN_HIDDEN_ROOM = 256  # rows


def _assemble_hidden(
    stored: torch.Tensor | None,
    room: torch.Tensor | None,
    ran: torch.Tensor,
    reuse: int,
    hidden_from: int | None,
    keep: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(hidden states to return, rows to keep in the entry, the buffer those are the first rows
    of) from the stored rows (the first rows of `room`, or a copy) and the rows of positions
    [reuse, len) that the forward ran; `keep`: store rows though none were asked for (nothing is
    returned then). What is returned is a copy: the room's rows past a later call's reuse change."""
    if hidden_from is None and not keep:
        # A draft fed hidden states reads only the rows it ran; nothing is kept.
        return ran, None, None
    if reuse and (stored is None or stored.shape[0] < reuse):
        # The stored rows stop short: later calls must run their positions again.
        # (_reusable_positions keeps hidden_from >= reuse here.)
        return (None if hidden_from is None else ran[hidden_from - reuse :]), None, None
    in_room = room is not None and stored is not None and stored.data_ptr() == room.data_ptr()
    full, room = _rows_after(stored, room if in_room else None, ran, reuse)
    return (None if hidden_from is None else full[hidden_from:].clone()), full, room


def _rows_after(
    stored: torch.Tensor | None, room: torch.Tensor | None, ran: torch.Tensor, reuse: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored[:reuse] then ran, as the first rows of a buffer; that buffer): `room` where it
    holds them (stored is its first rows), else a new one with room to grow (doubling)."""
    n = reuse + ran.shape[0]
    if room is None or room.shape[0] < n or room.dtype != ran.dtype:
        grown = ran.new_empty((max(n, 2 * (0 if room is None else room.shape[0]), _MIN_HIDDEN_ROOM), ran.shape[-1]))
        if reuse:
            grown[:reuse] = stored[:reuse]
        room = grown
    room[reuse:n] = ran
    return room[:n], room


def _left_padded(sequences: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, width] input ids, attention mask and position ids of sequences padded on the left."""
    pad = 0
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, width - len(seq) :] = 1
    # Left padding: positions must count real tokens only.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _check_step(items: list[StepItem]) -> None:
    sessions = [i.session_id for i in items if i.session_id]
    if len(set(sessions)) != len(sessions):
        raise ValueError("a step's items must have distinct session ids")
    for i in items:
        _check_request(len(i.token_ids), i.num_last, i.hidden_from)


@dataclass(frozen=True)
class _Planned:
    """An item of a ragged step, its entry taken from the cache and cropped to `reuse` positions."""

    item: StepItem
    entry: _CacheEntry
    reuse: int

    @property
    def token_ids(self) -> list[int]:
        return list(self.item.token_ids)

    @property
    def new_tokens(self) -> list[int]:
        return list(self.item.token_ids[self.reuse :])

    @property
    def new_rows(self) -> int:
        return len(self.item.token_ids) - self.reuse

    @property
    def want_hidden(self) -> bool:
        return self.item.hidden_from is not None or self.item.input_hidden is not None


class ModelRunner:
    """Runs one causal LM; thread-safe (one forward at a time, which is what a CPU wants)."""

    def __init__(self, model, cache: SessionKVCache, max_positions: int | None = None):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()
        # out_features, not weight rows: a vocabulary-subset head has fewer rows than it has outputs.
        self.vocab_size = int(getattr(head, "out_features", head.weight.shape[0]))
        self.max_positions = max_positions or int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0)
        # A draft fed the target's hidden states (draft_artifact.fused_inputs) rather than tokens alone.
        self.needs_target_hidden = needs_target_hidden(model)
        # A target serving a hidden-state draft, once asked for hidden states, keeps every session's
        # rows: a later call that asks for them (a session's next turn after a K = 0 one, a new
        # session forked from another's prompt) then reuses the cached positions instead of running
        # its whole context again. Rows cost 4 x hidden_size bytes a position (SmolLM2: 2.3 KB against
        # 46 KB of keys/values), so a target never asked keeps none.
        self.keeps_hidden = False
        self._lock = threading.Lock()
        # One long-lived thread runs every torch op the services ask of this model. OpenMP keeps a
        # worker team per calling thread: forwards from a pool of gRPC threads build many teams,
        # which throttle each other's spin-waits, so every parallel region becomes a futex wake-up
        # (a SmolLM2 decode on 2 cores: 55 ms from one thread, ~110 ms once several threads have run ops).
        self._model_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="model", initializer=_mark_model_thread
        )
        self._owns_thread = True  # False once share_model_thread borrows another runner's
        self.closed = False
        # Picks torch's thread count per forward from measured speed (specdec.models.threads);
        # None: whatever torch is set to.
        self.governor = None
        self._supports_ragged: bool | None = None  # decided at the first step
        self._compiled_attention: bool | None = None  # likewise (`_compiled_ok`)
        self.stores_prefixes_once = True  # False: every fork copies (`_stores_once`)
        self.pads_uncached = True  # False: a step's uncached sequences run ragged, not left-padded together

    def _threads(self, rows: int) -> AbstractContextManager:
        return self.governor.forward(rows) if self.governor is not None else nullcontext()

    def share_model_thread(self, other: ModelRunner) -> None:
        """Run this model's ops on `other`'s thread: two models in one process (draft and target
        in-process) then share one OpenMP team instead of throttling each other's."""
        if self._owns_thread:
            self._model_thread.shutdown(wait=False)  # its thread ends once what is queued there has run
        self._model_thread, self._owns_thread = other._model_thread, False

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """fn(*args, **kwargs) queued on the model's own thread, without waiting for it (the
        scheduler's iterations; share_model_thread may replace the thread, so it is read here).
        Raises Unavailable once this runner, or the one whose thread it shares, is closed."""
        if self.closed:
            raise Unavailable("the model runner is closed")
        try:
            return self._model_thread.submit(fn, *args, **kwargs)
        except RuntimeError as exc:  # the executor is shut down: the thread's owner was closed
            raise Unavailable("the model thread has ended (its runner was closed)") from exc

    def close(self) -> None:
        """Drop every cached session and end the model thread once the work queued on it has run
        (a thread borrowed by share_model_thread ends with the runner that made it); later calls
        raise Unavailable. Close the model's scheduler first (StepScheduler.close): its callers
        are waiting on iterations queued here. Idempotent."""
        self.closed = True
        if self._owns_thread:
            # From the model thread itself (an op closing its runner) waiting would never end.
            self._model_thread.shutdown(wait=not getattr(_MODEL_THREAD, "active", False))
        with self._lock:
            self.cache.clear()

    def on_model_thread(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) run on the model's own thread; returns its result (or raises)."""
        return self.submit(fn, *args, **kwargs).result()

    def _new_cache(self):
        return new_cache(self.model.config, cache_dtype(self.model))

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
        """Logits at the last `num_last` positions of `token_ids`, reusing the session's cache.

        The cache entry is cropped to the longest common prefix with `token_ids`
        (this is the rollback after a rejection), then only the new tokens run.

        hidden_from: also return the final hidden states at positions hidden_from.. (and keep
        them in the cache, so a later call can ask for positions it did not run).
        input_hidden: [len(token_ids), H] for a draft conditioned on hidden states
        (`draft_artifact.fused_inputs`): row t is what position t is fed with. Only the first
        `exact_len` positions (default: all) are cached for reuse by later calls.
        """
        token_ids = list(token_ids)
        _check_request(len(token_ids), num_last, hidden_from)
        self._note_hidden([hidden_from])
        want_hidden = hidden_from is not None or input_hidden is not None or self._keeping(session_id)
        with self._lock:
            entry, reuse = self._take_entry(session_id, token_ids, num_last, hidden_from)
            fed = input_hidden[reuse:] if input_hidden is not None else None
            # On an exception the entry (possibly half-updated) is simply not put back.
            with self._threads(len(token_ids) - reuse):
                out = self._forward(entry, token_ids[reuse:], fed, num_last, want_hidden)
            logits = out.logits[0, -num_last:].float().cpu()
            # Positions [reuse, len), after the final norm.
            ran = out.hidden_states[-1][0].float().cpu() if want_hidden else None
            hidden = self._settle(session_id, entry, token_ids, reuse, hidden_from, exact_len, ran)
            return LogitsResult(logits, reuse, hidden)

    def _settle(
        self,
        session_id: str,
        entry: _CacheEntry,
        token_ids: list[int],
        reuse: int,
        hidden_from: int | None,
        exact_len: int | None,
        ran: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Put the extended entry back (a session's) and return the hidden states asked for;
        `ran`: [len - reuse, H] final hidden states of the positions the forward ran, when wanted."""
        hidden = None
        if ran is not None:
            keep = self._keeping(session_id)
            hidden, entry.hidden, entry.hidden_room = _assemble_hidden(
                entry.hidden, entry.hidden_room, ran, reuse, hidden_from, keep
            )
        else:
            entry.hidden = entry.hidden_room = None
        if session_id:
            entry.token_ids = token_ids
            entry.exact_len = len(token_ids) if exact_len is None else exact_len
            self.cache.put(session_id, entry)
        return hidden

    def step(self, items: Sequence[StepItem]) -> list[LogitsResult]:
        """`last_logits` for each item (distinct session ids), as one batched step of the model.

        The contract the scheduler relies on: each result is what `last_logits` would return for
        that item alone, up to floating-point noise of batched kernels, and each session's cache
        ends as `last_logits` would leave it.

        Two or more items run as one flattened forward (`specdec.models.ragged`): every linear
        layer over all their new tokens at once, attention per session against its own cache.
        Items run one by one instead where that forward does not reproduce the model's own
        (`ragged.supports_ragged`: other architectures, sliding windows, a non-SDPA attention).
        Every item is checked before any runs: a malformed one raises ValueError, nothing ran.
        """
        items = list(items)
        _check_step(items)
        self._note_hidden([i.hidden_from for i in items])
        self._share_prefixes(items)
        if len(items) > 1 and self._ragged_ok():
            return self._ragged_step(items)
        return [
            self.last_logits(i.session_id, i.token_ids, i.num_last, i.hidden_from, i.input_hidden, i.exact_len)
            for i in items
        ]

    def _note_hidden(self, hidden_from: list[int | None]) -> None:
        if not self.needs_target_hidden and any(h is not None for h in hidden_from):
            self.keeps_hidden = True

    def _keeping(self, session_id: str) -> bool:
        """Whether this call stores its rows though it did not ask for them (a cached session)."""
        return self.keeps_hidden and bool(session_id)

    def _share_prefixes(self, items: list[StepItem]) -> None:
        """Items that hold no cache entry yet and open with the same tokens (the samples of one
        request, chats under one system prompt) get that prefix computed once: the first runs it
        into its entry (unless a cached entry holds all of it), and every item's own entry starts
        as a copy of it (`_fork`), or of more where a cached entry holds more of its tokens (a chat
        re-sent whole: its previous turn's entry holds all of its history, the others its system
        prompt only; forked at the shared length, 8 such chats recomputed their histories, 2.2 s)."""
        fresh = [i for i in items if i.session_id and i.input_hidden is None and self.cache.peek(i.session_id) is None]
        groups: dict[tuple[int, ...], list[StepItem]] = {}
        for item in fresh:
            if len(item.token_ids) - item.num_last >= MIN_SHARED_PREFIX:
                groups.setdefault(tuple(item.token_ids[:MIN_SHARED_PREFIX]), []).append(item)
        for leader, *others in (g for g in groups.values() if len(g) > 1):
            shared = min(len(i.token_ids) - i.num_last for i in (leader, *others))
            shared = min([shared, *(common_prefix_length(leader.token_ids, i.token_ids) for i in others)])
            if self._fork_source(list(leader.token_ids), shared)[2] < shared:  # not all cached yet
                self.last_logits(leader.session_id, leader.token_ids[:shared], 1)
            with self._lock:  # now, as a step takes every entry out before its forward
                for item in (leader, *others):
                    own = len(item.token_ids) - item.num_last  # as `_take_entry` forks a lone item
                    fork = None if self.cache.peek(item.session_id) else self._fork(list(item.token_ids), own)
                    if fork is not None:
                        self.cache.put(item.session_id, fork)

    def _fork(self, token_ids: list[int], limit: int) -> _CacheEntry | None:
        """An entry for `token_ids` holding the keys/values of the cached entry that shares the
        longest prefix with it (`_fork_source`): a new session under a system prompt another
        session already ran starts from them. A long prefix is stored once (`_stores_once`), a
        short one copied."""
        session, source, shared = self._fork_source(token_ids, limit)
        if source is None:
            return None
        if not shareable(source.kv):  # another cache layout: copy, then drop the rest
            kv = copy.deepcopy(source.kv)
            if shared < len(source.token_ids):
                kv.crop(shared - len(source.token_ids))
        elif not self._stores_once(shared):
            kv = copy_cache(source.kv, shared, self.model.config)
        else:
            kv = fork_cache(source.kv, shared, self.model.config)
            self.cache.recharge(session)  # a source without a prefix moved its first positions into one
        # The source's hidden rows of the shared positions come along: without them a call that
        # asks for hidden states from row 0 could reuse none of the keys/values.
        hidden = None if source.hidden is None else source.hidden[:shared].clone()
        return _CacheEntry(list(source.token_ids[:shared]), kv, hidden)

    def fork_length(self, token_ids: Sequence[int], limit: int) -> int:
        """How many leading positions a new session for `token_ids` would start with from another
        session's entry (`_fork`), at most `limit`; 0 for none. On the model thread (the cache's)."""
        return self._fork_source(list(token_ids), limit)[2]

    def _stores_once(self, shared: int) -> bool:
        """Whether a fork of `shared` positions reads them from a prefix stored once: long enough
        to pay for the extra attention call, and read by ragged attention (CPU flash kernel)."""
        return (
            self.stores_prefixes_once and shared >= MIN_STORED_ONCE and self.device.type == "cpu" and self._ragged_ok()
        )

    def _fork_source(self, token_ids: list[int], limit: int) -> tuple[str, _CacheEntry | None, int]:
        """(session, its cached entry sharing the most leading positions with `token_ids`, at least
        MIN_SHARED_PREFIX and at most `limit`; how many), or ("", None, 0). Keys/values are a function
        of the tokens and positions alone, except for a draft fed hidden states: none for it."""
        if self.needs_target_hidden or limit < MIN_SHARED_PREFIX:
            return "", None, 0
        best, best_len = ("", None), MIN_SHARED_PREFIX - 1
        for session, entry in self.cache.items():
            exact = len(entry.token_ids) if entry.exact_len is None else entry.exact_len
            shared = min(common_prefix_length(entry.token_ids, token_ids), limit, exact)
            if shared > best_len:
                best, best_len = (session, entry), shared
        return (*best, best_len) if best[1] is not None else ("", None, 0)

    def _ragged_ok(self) -> bool:
        if self._supports_ragged is None:
            self._supports_ragged = supports_ragged(self.model)
        # Re-read: a later switch of attention implementation (a GPU path) must not be missed.
        return self._supports_ragged and self.model.config._attn_implementation == "sdpa"

    def _compiled_ok(self) -> bool:
        """Whether short segments attend in the compiled kernel (`ragged.compiled_attention_ok`).
        Then every cached forward runs through `ragged_forward`, alone or batched: each row takes
        the same kernel either way, so a batched item gets exactly its solo logits."""
        if self._compiled_attention is None:
            self._compiled_attention = compiled_attention_ok(self.model)
        return self._compiled_attention and self._ragged_ok()

    def store_caches_as(self, dtype: torch.dtype | None) -> None:
        """Session caches hold keys/values of `dtype` from now on (`kv_cache.cache_dtype`): None
        (what the model computes), float32, or float16 where every cached forward attends in the
        compiled kernel, which reads float16 buffers as they are (`_compiled_ok`). Empties the cache."""
        if dtype not in (None, torch.float32, torch.float16):
            raise ValueError(f"KV caches are float32 or float16, not {dtype}")
        if dtype == torch.float16 and not self._compiled_ok():
            raise ValueError(
                "float16 KV caches need the compiled attention kernel: a float32 model of a Llama-shaped "
                "architecture on an x86-64 CPU with AVX2 (see the log for the kernels' build)"
            )
        set_cache_dtype(self.model, dtype)
        with self._lock:  # (not on_model_thread: this may run there)
            self.cache.clear()

    def fuses_layers(self) -> bool:
        """Whether cached forwards of short segments run whole in the fused decoder layers
        (`specdec.models.fused`): the compiled kernels, and a model they compute."""
        return self._compiled_ok() and fused_layers(self.model) is not None

    @torch.inference_mode()
    def _ragged_step(self, items: list[StepItem]) -> list[LogitsResult]:
        with self._lock:
            # All entries are taken before the forward: one item's put cannot evict another's entry.
            planned = [
                _Planned(
                    item, *self._take_entry(item.session_id, list(item.token_ids), item.num_last, item.hidden_from)
                )
                for item in items
            ]
            batch = build_batch([p.entry.kv for p in planned], [p.new_rows for p in planned], self.device)
            keep = torch.cat([torch.arange(s.end - p.item.num_last, s.end) for p, s in zip(planned, batch.segments)])
            wanted = [p.want_hidden or self._keeping(p.item.session_id) for p in planned]
            want_hidden = any(wanted)
            # On an exception the entries (possibly half-updated) are simply not put back.
            with self._threads(batch.rows):
                out = ragged_forward(
                    self.model, batch, keep.to(self.device), want_hidden, self._compiled_ok(),
                    **self._ragged_inputs(planned),
                )
            logits = out.logits[0].float().cpu()  # [sum of num_last, V], item by item
            final = out.hidden_states[-1][0].float().cpu() if want_hidden else None  # [T, H]
            results, first = [], 0
            for p, seg, want in zip(planned, batch.segments, wanted, strict=True):
                ran = final[seg.start : seg.end] if want else None
                item = p.item
                hidden = self._settle(
                    item.session_id, p.entry, p.token_ids, p.reuse, item.hidden_from, item.exact_len, ran
                )
                results.append(LogitsResult(logits[first : first + item.num_last], p.reuse, hidden, len(planned)))
                first += item.num_last
            return results

    def _ragged_inputs(self, planned: list[_Planned]) -> dict[str, torch.Tensor]:
        """input_ids ([1, T]) of the flattened batch, or inputs_embeds ([1, T, H]) when an item
        feeds hidden states (a hidden-state draft: `draft_artifact.fused_inputs`)."""
        ids = torch.tensor([[t for p in planned for t in p.new_tokens]], dtype=torch.long, device=self.device)
        fed = [None if p.item.input_hidden is None else p.item.input_hidden[p.reuse :] for p in planned]
        if all(f is None for f in fed):
            return {"input_ids": ids}
        if all(f is not None for f in fed):
            rows = torch.cat([f.to(self.device) for f in fed]).unsqueeze(0)  # [1, T, H]
            return {"inputs_embeds": fused_inputs(self.model, ids, rows)}
        # Some items feed hidden states, others tokens alone: each segment embedded its own way.
        parts, start = [], 0
        for p, f in zip(planned, fed, strict=True):
            seg_ids = ids[:, start : start + p.new_rows]  # [1, n]
            embeds = self.model.get_input_embeddings()(seg_ids)
            parts.append(embeds if f is None else fused_inputs(self.model, seg_ids, f.to(self.device).unsqueeze(0)))
            start += p.new_rows
        return {"inputs_embeds": torch.cat(parts, dim=1)}

    def _take_entry(
        self, session_id: str, token_ids: list[int], num_last: int, hidden_from: int | None
    ) -> tuple[_CacheEntry, int]:
        """(the session's entry cropped for reuse, or a fresh one; how many positions it keeps)."""
        entry = self.cache.take(session_id) if session_id else None
        if entry is None and session_id:
            entry = self._fork(token_ids, len(token_ids) - num_last)
        reuse = 0
        if entry is not None:
            reuse = _reusable_positions(entry, token_ids, num_last, hidden_from)
            entry = _crop(entry, reuse)
        if entry is None:
            self.cache.misses += 1
            return _CacheEntry([], self._new_cache()), 0
        self.cache.hits += 1
        return entry, reuse

    def _forward(
        self, entry: _CacheEntry, new_tokens: list[int], fed: torch.Tensor | None, num_last: int, want_hidden: bool
    ):
        """The model over `new_tokens` after the entry's cached positions, extending its cache."""
        new = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        if fed is not None:
            inputs = {"inputs_embeds": fused_inputs(self.model, new, fed.to(self.device).unsqueeze(0))}
        else:
            inputs = {"input_ids": new}
        compiled = self._compiled_ok()
        # A shared prefix is read by ragged attention only; with the compiled kernel, a solo forward
        # takes it as a batched one would.
        if compiled or shared_prefix(entry.kv)[0] is not None:
            batch = build_batch([entry.kv], [len(new_tokens)], self.device)
            keep = torch.arange(len(new_tokens) - num_last, len(new_tokens), device=self.device)
            return ragged_forward(self.model, batch, keep, want_hidden, compiled, **inputs)
        return self.model(
            **inputs, cache=entry.kv, use_cache=True, logits_to_keep=num_last, output_hidden_states=want_hidden
        )

    @torch.inference_mode()
    def batch_forward(
        self,
        sequences: Sequence[Sequence[int]],
        num_last: Sequence[int],
        hidden_from: Sequence[int] | None = None,
        input_hidden: Sequence[torch.Tensor] | None = None,
    ) -> list[LogitsResult]:
        """Independent sequences in one left-padded forward, no cache: `last_logits` per row, with
        logits [num_last_i, V] (hidden_from / input_hidden as there, one entry per sequence)."""
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        input_ids, attention_mask, position_ids = _left_padded(sequences, width)
        want_hidden = hidden_from is not None or input_hidden is not None
        if input_hidden is not None:
            rows = torch.zeros((len(sequences), width, input_hidden[0].shape[-1]), dtype=torch.float32)
            for row, (seq, fed) in enumerate(zip(sequences, input_hidden, strict=True)):
                rows[row, width - len(seq) :] = fed.float()
            inputs = {"inputs_embeds": fused_inputs(self.model, input_ids.to(self.device), rows.to(self.device))}
        else:
            inputs = {"input_ids": input_ids.to(self.device)}
        with self._lock, self._threads(len(sequences) * width):
            out = self.model(
                **inputs,
                attention_mask=attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                use_cache=False,
                logits_to_keep=max(num_last),
                output_hidden_states=want_hidden,
            )
        logits = out.logits.float().cpu()
        final = out.hidden_states[-1].float().cpu() if want_hidden else None
        results = []
        for row, n in enumerate(num_last):
            hidden = None
            if final is not None:
                first = hidden_from[row] if hidden_from is not None else 0
                hidden = final[row, width - lengths[row] + first :]
            results.append(LogitsResult(logits[row, logits.shape[1] - n :], 0, hidden))
        return results
