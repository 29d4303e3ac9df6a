"""Model forward passes behind a small interface, with a per-session KV cache.

`ModelRunner.last_logits` is the only thing the services need from a model:
the logits at the last `num_last` positions of a token sequence. Whether the
KV cache helped is invisible to the result: a miss recomputes from the tokens
the request carries, so correctness never depends on the cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _CacheEntry:
    token_ids: list[int]  # the tokens whose keys/values `kv` holds
    kv: object  # transformers Cache


class SessionKVCache:
    """LRU of per-session KV caches, bounded by entry count and total cached tokens.

    Mutated under the runner's lock; the metrics thread reads only counters (a running
    token total, so a scrape never iterates a dict another thread is changing).
    """

    def __init__(self, max_entries: int, max_tokens: int):
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
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
            self._tokens -= len(entry.token_ids)
        return entry

    def put(self, session_id: str, entry: _CacheEntry) -> None:
        if self.max_entries <= 0 or len(entry.token_ids) > self.max_tokens:
            return
        self.take(session_id)
        self._entries[session_id] = entry
        self._tokens += len(entry.token_ids)
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted.token_ids)

    def drop(self, session_id: str) -> None:
        self.take(session_id)


@dataclass(frozen=True)
class LogitsResult:
    logits: torch.Tensor  # [num_last, V] float32 on CPU
    cached_tokens: int  # prefix tokens whose keys/values came from the cache


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
        self._lock = threading.Lock()
        # One long-lived thread runs every torch op the services ask of this model. OpenMP keeps a
        # worker team per calling thread: forwards from a pool of gRPC threads build many teams,
        # which throttle each other's spin-waits, so every parallel region becomes a futex wake-up
        # (a SmolLM2 decode on 2 cores: 55 ms from one thread, ~110 ms once several threads have run ops).
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def on_model_thread(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) run on the model's own thread; returns its result (or raises)."""
        return self._model_thread.submit(fn, *args, **kwargs).result()

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def last_logits(self, session_id: str, token_ids: Sequence[int], num_last: int) -> LogitsResult:
        """Logits at the last `num_last` positions of `token_ids`, reusing the session's cache.

        The cache entry is cropped to the longest common prefix with `token_ids`
        (this is the rollback after a rejection), then only the new tokens run.
        """
        token_ids = list(token_ids)
        if not 1 <= num_last <= len(token_ids):
            raise ValueError(f"num_last={num_last} for {len(token_ids)} tokens")
        with self._lock:
            entry = self.cache.take(session_id) if session_id else None
            # At least the last num_last positions must run to produce their logits.
            reuse = 0
            if entry is not None:
                reuse = min(common_prefix_length(entry.token_ids, token_ids), len(token_ids) - num_last)
                cached_len = len(entry.token_ids)
                if reuse <= 0:
                    entry = None
                    reuse = 0
                elif cached_len > reuse:
                    entry.kv.crop(reuse - cached_len)  # negative: drop that many trailing tokens
            if entry is None:
                entry = _CacheEntry([], self._new_cache())
                self.cache.misses += 1
            else:
                self.cache.hits += 1
            new_tokens = torch.tensor([token_ids[reuse:]], dtype=torch.long, device=self.device)
            # On an exception the entry (possibly half-updated) is simply not put back.
            out = self.model(input_ids=new_tokens, cache=entry.kv, use_cache=True, logits_to_keep=num_last)
            logits = out.logits[0, -num_last:].float().cpu()
            if session_id:
                entry.token_ids = token_ids
                self.cache.put(session_id, entry)
            return LogitsResult(logits, reuse)

    @torch.inference_mode()
    def batch_last_logits(self, sequences: Sequence[Sequence[int]], num_last: Sequence[int]) -> list[torch.Tensor]:
        """Independent sequences in one left-padded forward, no cache. Returns [num_last_i, V] each."""
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        pad = 0
        input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
        # Left padding: positions must count real tokens only.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with self._lock:
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                use_cache=False,
                logits_to_keep=max(num_last),
            )
        logits = out.logits.float().cpu()
        return [logits[row, logits.shape[1] - n :] for row, n in enumerate(num_last)]
