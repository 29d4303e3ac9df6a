"""A static-shape path for cached forwards: preallocated KV slots and a compiled model.

On a GPU the eager Hugging Face forward is launch-bound (an H200 with random weights: 19.3 ms a
token at 0.5B and 21.9 ms at 7B, so a draft costs 0.88 of its target and speculation cannot pay);
a static cache with torch.compile's CUDA graphs brings that to 2.68 and 7.59 ms. CUDA graphs
replay fixed shapes at fixed addresses, whence the layout here:

- One working cache of `slots` rows x `max_len` positions per layer, allocated once at fixed
  addresses. A step of B sessions (B padded up to a batch bucket: 1, 2, 4, 8, 16) runs on rows
  [0, B), one session per row; each row's new tokens padded up to a token bucket (1, 2, 4, 8, 16).
  A few compiled graphs serve every (batch, token) bucket pair (dynamo makes a size symbolic once
  it has seen it change; CUDA graphs record one replay per shape).
- A session whose keys/values sit in a row it keeps (the *resident*) runs with no copy at all:
  the common case, a stream's next round or a draft's next step in the same company. A session
  that needs a row another holds first saves that one's valid prefix ([0, length) per layer) and
  copies its own saved prefix in; one that moves to a lower row is copied across.
- `slot_attention` (registered with transformers' AttentionInterface) writes each row's new
  keys/values at that row's own positions and attends over the row's whole cache under a mask
  built from the row's length: causal over its valid prefix and new tokens, blind to the stale
  positions past them. Pad tokens and pad rows write only past their row's valid length, where
  the next call overwrites before any query can read.
- Longer runs (a prompt) and tokens that would not fit a bucket run the model eagerly on the same
  rows, one session at a time; sequences longer than the cache and drafts fed hidden states take
  `ModelRunner`'s eager path (a DynamicCache).

Cache semantics are `ModelRunner`'s: the same `_CacheEntry`s in the same LRU (prefix reuse,
rollback after rejections, bounds on entries and tokens), their `kv` a `_StaticKV`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.models.ragged import attention_implementation
from specdec.models.runner import (
    LogitsResult,
    ModelRunner,
    SessionKVCache,
    StepItem,
    _CacheEntry,
    _check_request,
    _check_step,
    _reusable_positions,
)

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)  # new-token counts a compiled graph exists for (padded up)
BATCH_BUCKETS = (1, 2, 4, 8, 16)  # sessions per compiled step (padded up); the largest = the cache's rows
AUTO, ON, OFF = "auto", "on", "off"
COMPILE_CHOICES = (AUTO, ON, OFF)
SLOT_ATTENTION = "specdec_slots"
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


# ---------------------------------------------------------------- attention over the slots


@dataclass(frozen=True)
class SlotInputs:
    """What `slot_attention` needs besides the layer's query/keys/values (model kwargs)."""

    keys: list[torch.Tensor]  # per layer [slots, H_kv, max_len, D]: the working cache
    values: list[torch.Tensor]
    write: torch.Tensor  # [B, T] long: the cache position each row's t-th new token goes to
    mask: torch.Tensor  # [B, 1, T, max_len] bool: which positions each row's t-th query sees


def slot_mask(write: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, 1, T, max_len] bool: query t of row b sees positions [0, write[b, t]] (its valid
    prefix, its earlier new tokens and itself)."""
    positions = torch.arange(max_len, device=write.device)
    return (positions[None, None, :] <= write[:, :, None]).unsqueeze(1)


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    slot_inputs: SlotInputs | None = None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, T, D]; key, value: [B, H_kv, T, D] of the new tokens (rotary applied).
    Returns ([B, T, Hq, D], None) as transformers' SDPA function does."""
    if slot_inputs is None:
        raise RuntimeError("slot attention called outside StaticModelRunner")
    batch, heads, tokens, dim = key.shape
    cache_k = slot_inputs.keys[module.layer_idx][:batch]  # [B, H_kv, max_len, D], rows of this step
    cache_v = slot_inputs.values[module.layer_idx][:batch]
    index = slot_inputs.write[:, None, :, None].expand(batch, heads, tokens, dim)
    cache_k.scatter_(2, index, key)
    cache_v.scatter_(2, index, value)
    groups = query.shape[1] // heads
    # Every key head repeated for its query heads, as transformers does for SDPA under a mask.
    keys = cache_k.repeat_interleave(groups, dim=1) if groups > 1 else cache_k
    values = cache_v.repeat_interleave(groups, dim=1) if groups > 1 else cache_v
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=slot_inputs.mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SLOT_ATTENTION, slot_attention)


# ---------------------------------------------------------------- sessions and rows


class _StaticKV:
    """A session's keys/values: in a row of the working cache while resident, else saved per layer."""

    __slots__ = ("__weakref__", "length", "row", "saved")

    def __init__(self) -> None:
        self.length = 0  # positions [0, length) hold this session's keys/values
        self.row: int | None = None  # the working cache's row holding them, while resident
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: [1, H_kv, length, D] x 2


@dataclass
class _Run:
    """One sequence of a static step: its entry, taken from the cache, and its new tokens."""

    item: StepItem
    entry: _CacheEntry
    reuse: int

    @property
    def kv(self) -> _StaticKV:
        return self.entry.kv

    @property
    def new_tokens(self) -> list[int]:
        return list(self.item.token_ids[self.reuse :])


class StaticModelRunner(ModelRunner):
    """`ModelRunner` whose cached forwards (`last_logits`, `step`) run on the working cache with a
    compiled model, the sequences of a step batched; `batch_forward` (uncached) stays eager."""

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
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
    ):
        super().__init__(model, cache, max_positions)
        # Its eager fallback's forks copy: the working cache's rows, not shared prefixes, are its layout.
        self.stores_prefixes_once = False
        self.max_len = min(max_len, self.max_positions) if self.max_positions else max_len
        self.buckets = tuple(sorted(buckets))
        self.batch_buckets = tuple(sorted(batch_buckets))
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"  # CUDA graphs (on a CPU inductor would skip them anyway)
        # Graphs per model: decode and one for the other buckets, each with hidden states asked or
        # not; and the limit counts every compiled model of one class together (the draft's and
        # the target's forward are one code object). Past it dynamo would run eagerly, unannounced.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # dynamic=None: the first shape (one session decoding) is specialised; the first other
        # shape recompiles with the sizes symbolic, and later buckets reuse that graph (CUDA graphs
        # still record one replay per shape). Two compiles per model rather than one per bucket
        # pair: a 7B-shaped model compiles in about a minute each.
        self._compiled = torch.compile(model, backend=backend, mode=mode, dynamic=dynamic)
        self._keys: list[torch.Tensor] | None = None  # the working cache, built on first use
        self._values: list[torch.Tensor] | None = None
        self._rows: list[weakref.ref[_StaticKV] | None] = [None] * self.batch_buckets[-1]  # each row's resident
        self.compiled_forwards = 0  # forwards that ran a compiled graph (tests, logs)
        self.eager_forwards = 0  # forwards that ran the model eagerly on the working cache
        self.restores = 0  # saved prefixes copied back into the working cache

    # ------------------------------------------------------------ the ModelRunner interface

    def last_logits(
        self,
        session_id: str,
        token_ids: Sequence[int],
        num_last: int,
        hidden_from: int | None = None,
        input_hidden: torch.Tensor | None = None,
        exact_len: int | None = None,
    ) -> LogitsResult:
        """`ModelRunner.last_logits`, on the working cache (see the module's docstring)."""
        return self.step([StepItem(session_id, list(token_ids), num_last, hidden_from, input_hidden, exact_len)])[0]

    @torch.inference_mode()
    def step(self, items: Sequence[StepItem]) -> list[LogitsResult]:
        """`ModelRunner.step`: the items that fit the buckets as one compiled forward (several when
        there are more than the cache has rows), the others one by one (see the module's docstring)."""
        items = list(items)
        _check_step(items)
        results: dict[int, LogitsResult] = {}
        for index, item in enumerate(items):
            if item.input_hidden is not None or len(item.token_ids) > self.max_len:
                results[index] = self._eager_last_logits(item)
        with self._lock:
            runs = {i: self._take_static(item) for i, item in enumerate(items) if i not in results}
            # On an exception the entries taken are not put back (their rows may be half-written).
            batched, alone = self._partition(runs)
            ran: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
            for group in batched:
                ran.update(zip(group, self._run([runs[i] for i in group], compiled=True), strict=True))
            for i in alone:
                ran.update(zip([i], self._run([runs[i]], compiled=False), strict=True))
            for i in sorted(ran):  # entries go back in item order, as ModelRunner.step puts them
                results[i] = self._result(runs[i], *ran[i])
        return [results[i] for i in range(len(items))]

    def _result(self, run: _Run, logits: torch.Tensor, hidden: torch.Tensor | None, shared: int) -> LogitsResult:
        item = run.item
        hidden = self._settle(
            item.session_id, run.entry, list(item.token_ids), run.reuse, item.hidden_from, item.exact_len, hidden
        )
        return LogitsResult(logits, run.reuse, hidden, shared)

    def _partition(self, runs: dict[int, _Run]) -> tuple[list[list[int]], list[int]]:
        """(groups of item indices to run as one compiled step each, indices to run alone eagerly):
        a sequence batches when the step's token bucket (its longest run's) fits after its cached
        positions."""
        fits = [i for i, run in runs.items() if bucket_for(len(run.new_tokens), run.reuse, self.max_len, self.buckets)]
        if fits:
            width = self._width(max(len(runs[i].new_tokens) for i in fits))
            fits = [i for i in fits if runs[i].reuse + width <= self.max_len]
        alone = [i for i in runs if i not in fits]
        rows = self.batch_buckets[-1]
        return [fits[start : start + rows] for start in range(0, len(fits), rows)], alone

    def _width(self, longest: int) -> int:
        """The token bucket of a compiled step whose longest run has `longest` new tokens."""
        return next(b for b in self.buckets if b >= longest)

    def close(self) -> None:
        """`ModelRunner.close`, and the working cache freed."""
        super().close()
        with self._lock:
            self._keys = self._values = None
            self._rows = [None] * len(self._rows)

    # ------------------------------------------------------------ cache entries

    def _take_static(self, item: StepItem) -> _Run:
        """The item's entry, or a fresh one, and how many leading positions it keeps."""
        token_ids = list(item.token_ids)
        _check_request(len(token_ids), item.num_last, item.hidden_from)
        entry = self.cache.take(item.session_id) if item.session_id else None
        reuse = 0
        if entry is not None and isinstance(entry.kv, _StaticKV):
            reuse = _reusable_positions(entry, token_ids, item.num_last, item.hidden_from)
        if reuse <= 0:
            self.cache.misses += 1
            return _Run(item, _CacheEntry([], _StaticKV()), 0)
        self.cache.hits += 1
        entry.kv.length = min(entry.kv.length, reuse)  # the rollback: later positions are stale
        return _Run(item, entry, reuse)

    def _eager_last_logits(self, item: StepItem) -> LogitsResult:
        """ModelRunner's own path (DynamicCache), after dropping a static entry it cannot read."""
        if item.session_id:
            with self._lock:
                entry = self.cache.take(item.session_id)
                if entry is not None and not isinstance(entry.kv, _StaticKV):
                    self.cache.put(item.session_id, entry)  # its own kind: back, as the most recent
        return super().last_logits(
            item.session_id, item.token_ids, item.num_last, item.hidden_from, item.input_hidden, item.exact_len
        )

    # ------------------------------------------------------------ the working cache

    def _working_cache(self) -> None:
        if self._keys is not None:
            return
        config = self.model.config.get_text_config(decoder=True)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        dtype = next(self.model.parameters()).dtype
        shape = (len(self._rows), heads, self.max_len, head_dim)
        self._keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self._values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        for tensor in (*self._keys, *self._values):
            torch._dynamo.mark_static_address(tensor)  # CUDA graphs replay at these addresses

    def _resident(self, row: int) -> _StaticKV | None:
        ref = self._rows[row]
        return ref() if ref is not None else None

    def _vacate(self, row: int) -> None:
        """Save the valid prefix of the row's resident (an evicted one is gone: its weakref is dead)."""
        current = self._resident(row)
        if current is not None and current.length > 0:
            current.saved = [
                (keys[row : row + 1, :, : current.length].clone(), values[row : row + 1, :, : current.length].clone())
                for keys, values in zip(self._keys, self._values, strict=True)
            ]
        if current is not None:
            current.row = None
        self._rows[row] = None

    def _place(self, runs: list[_Run]) -> None:
        """Make run i's session resident in row i, holding its first `reuse` positions."""
        self._working_cache()
        for row, run in enumerate(runs):
            kv = run.kv
            if kv.row == row:
                continue
            if self._resident(row) is not None:
                self._vacate(row)
            if kv.row is not None:  # resident in another row: copy across, then free that row
                old = kv.row
                for keys, values in zip(self._keys, self._values, strict=True):
                    keys[row, :, : run.reuse].copy_(keys[old, :, : run.reuse])
                    values[row, :, : run.reuse].copy_(values[old, :, : run.reuse])
                self._rows[old] = None
            elif kv.saved is not None:
                for (keys, values), (saved_k, saved_v) in zip(zip(self._keys, self._values), kv.saved, strict=True):
                    keys[row : row + 1, :, : run.reuse].copy_(saved_k[:, :, : run.reuse])
                    values[row : row + 1, :, : run.reuse].copy_(saved_v[:, :, : run.reuse])
                self.restores += 1
            kv.saved, kv.row = None, row
            self._rows[row] = weakref.ref(kv)

    def _run(self, runs: list[_Run], compiled: bool) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
        """The runs' new tokens as one forward on rows [0, len(runs)) (padded up to the buckets
        when compiled); each session resident in its row afterwards, holding reuse + n positions.
        Per run: ([num_last, V] float32 logits, [n, H] final hidden states of its new tokens when
        asked, how many sequences shared the forward)."""
        self._place(runs)
        longest = max(len(run.new_tokens) for run in runs)
        rows = next(b for b in self.batch_buckets if b >= len(runs)) if compiled else len(runs)
        width = self._width(longest) if compiled else longest
        ids = torch.full((rows, width), _PAD_ID, dtype=torch.long)
        write = torch.empty((rows, width), dtype=torch.long)
        for row in range(rows):
            start = runs[row].reuse if row < len(runs) else self._pad_row_start(row, width)
            if row < len(runs):
                ids[row, : len(runs[row].new_tokens)] = torch.tensor(runs[row].new_tokens, dtype=torch.long)
            write[row] = torch.arange(start, start + width)
        for run in runs:
            run.kv.length = run.reuse  # until the forward has written the new positions
        want_hidden = any(run.item.hidden_from is not None for run in runs)
        out = self._forward_rows(ids, write, want_hidden, compiled)
        outputs = []
        for row, run in enumerate(runs):
            n = len(run.new_tokens)
            logits = out.logits[row, n - run.item.num_last : n].float().cpu()  # [num_last, V]
            hidden = out.hidden_states[-1][row, :n].float().cpu() if run.item.hidden_from is not None else None
            run.kv.length = run.reuse + n
            outputs.append((logits, hidden, len(runs)))
        return outputs

    def _pad_row_start(self, row: int, width: int) -> int:
        """Where a pad row writes: past its resident's valid positions (vacating it if they reach
        too far for `width` more)."""
        current = self._resident(row)
        if current is not None and current.length + width > self.max_len:
            self._vacate(row)
            current = None
        return current.length if current is not None else 0

    def _forward_rows(self, ids: torch.Tensor, write: torch.Tensor, want_hidden: bool, compiled: bool):
        """The model over [rows, width] ids whose keys/values go to `write`'s positions."""
        ids, write = ids.to(self.device), write.to(self.device)
        # The mask spans the rows as allocated (max_len may have been lowered since, as tests do).
        inputs = SlotInputs(self._keys, self._values, write, slot_mask(write, self._keys[0].shape[-2]))
        with attention_implementation(self.model, SLOT_ATTENTION), self._threads(ids.numel()):
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()  # earlier outputs are copied out already
                self.compiled_forwards += 1
                return self._compiled(
                    input_ids=ids,
                    position_ids=write,
                    use_cache=False,
                    output_hidden_states=want_hidden,
                    slot_inputs=inputs,
                )
            self.eager_forwards += 1
            return self.model(
                input_ids=ids, position_ids=write, use_cache=False, output_hidden_states=want_hidden, slot_inputs=inputs
            )


_register()
