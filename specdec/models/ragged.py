"""One forward over many sessions' new tokens: a flattened ragged batch (as vLLM runs a step).

Every session's new tokens are concatenated into one [1, T] row, so each linear layer runs one
matmul over T rows, which on a CPU costs little more than one row (the weights stream from memory
once). Attention cannot be shared: each segment attends to its own session's cached keys/values
plus its own new ones. `ragged_attention`, registered with transformers' AttentionInterface, does
that per segment: it appends the segment's new keys/values to the session's DynamicCache and
calls the very SDPA function and mask a solo cached forward would call, so a segment's attention
equals its solo attention exactly and only the linear layers' row count differs (float noise).

Segments of a few rows (decodes, Verify rows) go to a compiled kernel instead where it is built
(`kernels/attention.cpp`, `CompiledSegments`): one call a layer appends all their keys/values and
attends every (segment, head), where SDPA cost a call a segment plus the Python around it. Each row
there is computed alone, in one order, so a batched item still gets its solo bits, provided its
solo forward takes the same kernel: the runner sends every cached forward of such a model through
`ragged_forward`, a batch of one included.

The model is switched to this attention only inside `ragged_forward` (under the runner's lock,
on its thread); outside it, it is the plain SDPA model it was.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

from specdec.models import panels
from specdec.models.fused import fused_forward, fused_layers
from specdec.models.kv_cache import cache_dtype, shareable, shared_prefix

RAGGED_ATTENTION = "specdec_ragged"
# Segments of at most this many new rows attend in the compiled kernel; longer ones (prompts) in
# SDPA's flash kernel, whose blocked products win there. A function of the segment alone, so a
# session's rows take the same kernel batched or alone. 17: a Verify at the coordinator's largest
# default K (16) and its bonus row (on SmolLM2 here a 17-row Verify took 66 ms through
# transformers' forward against 38 ms for 16 rows fused).
COMPILED_MAX_ROWS = 17

# Model types whose attention is `cache.update` + the shared attention interface on full-attention
# layers (no sliding windows, position biases or soft caps): what ragged_attention reproduces.
_RAGGED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass(frozen=True)
class Segment:
    """One session's rows [start, end) of the flattened batch."""

    start: int
    end: int
    kv: object  # the session's transformers DynamicCache, holding its first `past` positions
    mask: torch.Tensor | None  # [1, 1, n, past + n] bool, or None where the solo forward passes none


@dataclass(frozen=True)
class CompiledSegments:
    """The segments the compiled kernel attends, their caches' buffers reserved for their new rows."""

    indices: frozenset[int]  # into RaggedBatch.segments
    # [layers, len(indices), 10] int64, per segment: first row, rows, past, its own key and value
    # buffers' addresses and capacity, a shared prefix's key and value addresses, capacity and
    # length (zeros without one): the kernel's Segment.
    tables: torch.Tensor
    lib: ctypes.CDLL
    half: bool = False  # the caches hold float16 (`kv_cache.cache_dtype`)


@dataclass(frozen=True)
class RaggedBatch:
    segments: tuple[Segment, ...]
    position_ids: torch.Tensor  # [1, T]: segment i's rows are past_i, past_i + 1, ...
    compiled: CompiledSegments | None = None

    @property
    def rows(self) -> int:
        return self.segments[-1].end if self.segments else 0


def build_batch(caches: list, lengths: list[int], device: torch.device) -> RaggedBatch:
    """Segments for sessions whose caches hold `cache.get_seq_length()` positions and which run
    `lengths[i]` new tokens each, in that order."""
    from transformers.masking_utils import sdpa_mask

    segments, positions, start = [], [], 0
    for kv, n in zip(caches, lengths, strict=True):
        past = kv.get_seq_length()
        # The mask create_causal_mask builds for this cache and query alone (None: is_causal or none).
        mask = sdpa_mask(batch_size=1, q_length=n, kv_length=past + n, q_offset=past, device=device)
        segments.append(Segment(start, start + n, kv, mask))
        positions.append(torch.arange(past, past + n, device=device))
        start += n
    return RaggedBatch(tuple(segments), torch.cat(positions).unsqueeze(0))


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ragged: RaggedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of every segment against its own session's keys/values.

    query: [1, Hq, T, D]; key, value: [1, Hkv, T, D] (this step's rows, rotary applied; the model
    ran without a cache). Returns ([1, T, Hq, D], None) as transformers' SDPA function does.
    Segments whose cache reads a shared prefix (`kv_cache.fork_cache`) go by `_after_prefix`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdec.models.bf16_matmul import exact_form, exact_rows_many, rowwise, uses_gqa

    attend = rowwise(sdpa_attention_forward)
    if ragged is None:
        raise RuntimeError("ragged attention called outside ragged_forward")
    compiled = ragged.compiled
    done = _compiled_attention(module, query, key, value, compiled, kwargs.get("scaling")) if compiled else None
    if compiled is not None and len(compiled.indices) == len(ragged.segments):
        return done, None
    outputs: list[torch.Tensor | None] = [None] * len(ragged.segments)
    prefixed: dict[tuple[int, int], list[int]] = {}  # (id of the prefix's root, length) -> segment indices
    exact: list[tuple[int, tuple]] = []  # (segment index, (query rows, keys, values)) in the exact form
    for index, seg in enumerate(ragged.segments):
        rows = slice(seg.start, seg.end)
        if compiled is not None and index in compiled.indices:
            outputs[index] = done[:, rows]
            continue
        layer = seg.kv.layers[module.layer_idx]
        if getattr(layer, "prefix_keys", None) is None:
            # The session's keys/values through this segment: [1, Hkv, past + n, D].
            keys, values = seg.kv.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
            keys, values = keys.to(query.dtype), values.to(query.dtype)  # a float16 cache's, widened
            n = seg.end - seg.start
            if exact_form(module, seg.mask, keys.shape[2] - n, n):
                exact.append((index, (query[:, :, rows], keys, values)))  # bfloat16 products: all at once, below
            else:
                outputs[index], _ = attend(module, query[:, :, rows], keys, values, seg.mask, **kwargs)
        else:
            layer.append(key[:, :, rows], value[:, :, rows])
            prefixed.setdefault((id(layer.prefix_root), layer.prefix_len), []).append(index)
    if exact:
        results = exact_rows_many([job for _, job in exact], kwargs.get("scaling"), uses_gqa(module))
        for (index, _), out in zip(exact, results, strict=True):
            outputs[index] = out  # [1, n, Hq, D]
    for group in prefixed.values():
        segments = [ragged.segments[i] for i in group]
        for index, out in zip(group, _after_prefix(module, query, segments, kwargs.get("scaling")), strict=True):
            outputs[index] = out  # [1, n, Hq, D]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _compiled_attention(module, query, key, value, compiled: CompiledSegments, scale: float | None) -> torch.Tensor:
    """[1, T, Hq, D], its compiled segments' rows filled in (others: garbage), their keys/values
    appended to their caches' buffers; query: [1, Hq, T, D], key, value: [1, Hkv, T, D]."""
    _, heads, rows, dim = query.shape
    out = torch.empty((1, rows, heads, dim), dtype=torch.float32)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    table = compiled.tables[module.layer_idx]
    compiled.lib.ragged_attention(
        query.data_ptr(), query.stride(2), query.stride(1), key.data_ptr(), key.stride(2), key.stride(1),
        value.data_ptr(), value.stride(2), value.stride(1), table.data_ptr(), table.shape[0], heads, key.shape[1],
        dim, dim**-0.5 if scale is None else scale, out.data_ptr(), int(compiled.half),
    )
    return out


def compiled_attention_ok(model) -> bool:
    """Whether `ragged_forward(..., compiled=True)` may attend this model's short segments in the
    compiled kernel: float32 on the CPU, every layer a full-attention one (`supports_ragged`), its
    head size one the kernel takes, and no attention computed in bfloat16's exact form."""
    from specdec.models.bf16_matmul import ROWWISE

    lib = panels.kernel_library()
    if lib is None or not supports_ragged(model):
        return False
    param = next(model.parameters())
    if param.dtype != torch.float32 or param.device.type != "cpu":
        return False
    if any(getattr(module, ROWWISE, False) for module in model.modules()):
        return False
    return bool(lib.ragged_attention_supports(_head_dim(model.config)))


def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _compile_segments(batch: RaggedBatch, config, dtype: torch.dtype, indices: list[int] | None = None) -> RaggedBatch:
    """The batch with its short segments (`_compilable`; `indices` when the caller has them)
    marked for the compiled kernel, each of their cache layers' own buffers reserved for the new
    rows, in `dtype` (float32 or float16: the model's `cache_dtype`)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    like = torch.empty((1, kv_heads, 0, _head_dim(config)), dtype=dtype)
    if indices is None:
        indices = [i for i, seg in enumerate(batch.segments) if _compilable(seg, dtype)]
    if not indices:
        return batch
    columns = []  # per segment, per layer: its 10 columns
    for index in indices:
        seg = batch.segments[index]
        rows = seg.end - seg.start
        head = (seg.start, rows, seg.kv.get_seq_length())
        columns.append([(*head, *layer.reserve(rows, like), *_prefix_columns(layer, dtype)) for layer in seg.kv.layers])
    # numpy reads nested tuples ~2x faster than torch.tensor does (0.06 against 0.14 ms at 8 x 30 x 10).
    tables = torch.from_numpy(np.array(columns, dtype=np.int64).transpose(1, 0, 2).copy())  # [layers, segments, 10]
    half = dtype == torch.float16
    return replace(batch, compiled=CompiledSegments(frozenset(indices), tables, panels.kernel_library(), half))


def _prefix_columns(layer, dtype: torch.dtype) -> tuple[int, int, int, int] | None:
    """(key address, value address, capacity, length) of the shared prefix a cache layer reads, as
    the kernel reads it ([kv heads][capacity][dim] of `dtype`, positions contiguous); zeros without
    one; None when its keys/values are not laid out so."""
    keys, values = layer.prefix_keys, layer.prefix_values
    if keys is None:
        return 0, 0, 0, 0
    if keys.dtype != dtype or values.dtype != dtype:
        return None
    dim = keys.shape[-1]
    laid_out = all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == dim for t in (keys, values))
    if not laid_out or keys.stride(1) != values.stride(1) or keys.stride(1) % dim:
        return None
    return keys.data_ptr(), values.data_ptr(), keys.stride(1) // dim, keys.shape[-2]


def _compilable(seg: Segment, dtype: torch.dtype) -> bool:
    """Whether the compiled kernels take this segment: a few rows, its cache laid out for them."""
    return seg.end - seg.start <= COMPILED_MAX_ROWS and _cache_laid_out(seg, dtype)


def _cache_laid_out(seg: Segment, dtype: torch.dtype) -> bool:
    """Its cache's layers all reserve buffers, and a shared prefix (if any) is laid out as the
    kernel reads it, in `dtype`."""
    if not shareable(seg.kv):
        return False
    if shared_prefix(seg.kv)[0] is None:
        return True
    return all(_prefix_columns(layer, dtype) is not None for layer in seg.kv.layers)


def _prompts_fused(batch: RaggedBatch, fused, dtype: torch.dtype) -> bool:
    """Whether the fused layers take this batch of prompts (every segment longer than
    COMPILED_MAX_ROWS): where every linear multiplies int8 rows (as every other row of the model
    does), or has a compact copy and the CPU AMX tiles for its products (`_prompts_on_tiles`)."""
    if not (fused.int8 or _prompts_on_tiles(fused)):
        return False
    return all(seg.end - seg.start > COMPILED_MAX_ROWS and _cache_laid_out(seg, dtype) for seg in batch.segments)


def _prompts_on_tiles(fused) -> bool:
    return fused.compact and panels.amx_available()


def _settle_compiled(batch: RaggedBatch) -> None:
    """After the forward: each compiled segment's cache holds its new rows (the kernel wrote them)."""
    for index in batch.compiled.indices:
        seg = batch.segments[index]
        for layer in seg.kv.layers:
            layer.extend(seg.end - seg.start)


def _after_prefix(module, query: torch.Tensor, segments: list[Segment], scale: float | None) -> list[torch.Tensor]:
    """Outputs ([1, n, Hq, D] each) of segments whose caches read one shared prefix (cascade
    attention): all their query rows attend to the prefix in ONE call (its keys/values read once
    for them all), each segment's rows to its own positions under its causal mask, and the two
    halves merge by their log-sum-exps, which is softmax attention over the whole, exactly but for
    float rounding. Grouped-query heads go as rows of their key/value head (no repeated keys)."""
    layers = [seg.kv.layers[module.layer_idx] for seg in segments]
    heads = layers[0].prefix_keys.shape[1]
    packed = [_group_rows(query[:, :, seg.start : seg.end], heads) for seg in segments]  # [1, Hkv, g*n, D]
    stacked = packed[0] if len(packed) == 1 else torch.cat(packed, dim=2)
    on_prefix, lse_prefix = _flash(stacked, layers[0].prefix_keys, layers[0].prefix_values, None, scale)
    own = [  # (output, log-sum-exp) of each segment's rows over its own positions
        _flash(rows, layer.keys, layer.values, _own_mask(seg.end - seg.start, layer.own_length(), rows), scale)
        for rows, layer, seg in zip(packed, layers, segments, strict=True)
    ]
    if len(own) == 1:
        on_own, lse_own = own[0]
    else:
        on_own, lse_own = torch.cat([o for o, _ in own], dim=2), torch.cat([lse for _, lse in own], dim=2)
    # softmax over prefix + own = a convex mix of the two halves' softmaxes, weighted by their mass.
    weight = torch.sigmoid(lse_prefix - lse_own).unsqueeze(-1).to(on_own.dtype)  # [1, Hkv, R, 1]
    merged = torch.lerp(on_own, on_prefix, weight)
    parts = merged.split([p.shape[2] for p in packed], dim=2)
    return [
        part.reshape(1, query.shape[1], seg.end - seg.start, -1).transpose(1, 2)
        for part, seg in zip(parts, segments, strict=True)
    ]


def _group_rows(query: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, Hq, n, D] -> [1, Hkv, g*n, D]: query head kv*g + h's rows go to key/value head kv."""
    _, hq, n, d = query.shape
    return query.reshape(1, heads, (hq // heads) * n, d)


def _own_mask(n: int, own: int, rows: torch.Tensor) -> torch.Tensor | None:
    """[1, 1, g*n, own] additive (0 / -inf, the kernel takes no bool mask): row i of n new rows
    (the last n of `own` positions) sees own positions up to its own; `rows`: the grouped query
    rows ([1, Hkv, g*n, D]). None for one row (it sees them all)."""
    if n == 1:
        return None
    hidden = torch.arange(own)[None, :] > (own - n + torch.arange(n))[:, None]  # [n, own]
    mask = torch.zeros(hidden.shape, dtype=rows.dtype).masked_fill_(hidden, float("-inf"))
    return mask.repeat(rows.shape[2] // n, 1).view(1, 1, rows.shape[2], own)


def _flash(query, keys, values, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, H, R, D], log-sum-exp [1, H, R] float32): the CPU flash kernel F.sdpa runs.

    Called directly, the kernel skips F.sdpa's checks and reads a strided last dimension wrongly:
    a (W @ x^T)^T projection's one-row query is such a view (`cpu_layout`, WEIGHT_MAJOR)."""
    keys, values = keys.to(query.dtype), values.to(query.dtype)  # a float16 cache's, widened
    query, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, keys, values))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, 0.0, False, attn_mask=mask, scale=scale
    )


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)


def supports_ragged(model) -> bool:
    """Whether `ragged_forward` reproduces this model's solo cached forward (else: run items alone)."""
    from transformers import DynamicCache

    config = model.config
    if getattr(config, "model_type", None) not in _RAGGED_MODEL_TYPES or config._attn_implementation != "sdpa":
        return False
    if any(DynamicCache(config=config).is_sliding):
        return False
    # The switch below flips one config: every attention layer must read that one.
    return all(
        module.config is config
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "config")
    )


@contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """The model's attention is the registered `name` inside the block (a path's own kernel)."""
    config = model.config
    original = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = original


def ragged_forward(
    model, batch: RaggedBatch, logits_to_keep: torch.Tensor, want_hidden: bool, compiled: bool = False, **inputs
):
    """The model over the flattened batch (`inputs`: input_ids or inputs_embeds, [1, T, ...]),
    extending each segment's cache; logits only at the rows in `logits_to_keep` ([K] indices).
    compiled: short segments attend in the compiled kernel (only where `compiled_attention_ok`),
    and run whole in the fused decoder layers where the model has them (`fused.fused_layers`)."""
    fused = fused_layers(model) if compiled else None
    dtype = cache_dtype(model) or torch.float32  # the compiled kernels': a float32 model's
    if fused is not None:
        short = [i for i, seg in enumerate(batch.segments) if _compilable(seg, dtype)]
        if short and len(short) < len(batch.segments):
            return _split_forward(model, batch, short, logits_to_keep, want_hidden, **inputs)
        prompts = not short and _prompts_fused(batch, fused, dtype)  # all short, or all prompts here
        if short or prompts:
            batch = _compile_segments(batch, model.config, dtype, short or list(range(len(batch.segments))))
            tiles = prompts and _prompts_on_tiles(fused)
            out = fused_forward(model, batch, fused, logits_to_keep, want_hidden, tiles=tiles, **inputs)
            _settle_compiled(batch)
            return out
    if compiled:
        batch = _compile_segments(batch, model.config, dtype)
    with attention_implementation(model, RAGGED_ATTENTION):
        out = model(
            **inputs,
            position_ids=batch.position_ids,
            use_cache=False,  # the sessions' caches are updated inside ragged_attention
            logits_to_keep=logits_to_keep,
            output_hidden_states=want_hidden,
            ragged=batch,
        )
    if batch.compiled is not None:
        _settle_compiled(batch)
    return out


def _split_forward(model, batch: RaggedBatch, short: list[int], logits_to_keep, want_hidden: bool, **inputs):
    """A batch of short segments and others (prompts, a prompt's rest after a shared prefix): the
    short ones in the fused layers, the others as they would run alone (in transformers' forward,
    or the fused layers: `_prompts_fused`), never in one call with short rows."""
    parts = [short, [i for i in range(len(batch.segments)) if i not in set(short)]]
    owner = torch.empty(batch.rows, dtype=torch.long)  # row -> its part
    local = torch.empty(batch.rows, dtype=torch.long)  # row -> its row within the part
    subs = []
    for number, indices in enumerate(parts):
        segments, rows, start = [], [], 0
        for i in indices:
            seg = batch.segments[i]
            segments.append(replace(seg, start=start, end=start + seg.end - seg.start))
            rows.append(torch.arange(seg.start, seg.end))
            start = segments[-1].end
        rows = torch.cat(rows)
        owner[rows], local[rows] = number, torch.arange(len(rows))
        subs.append((rows, RaggedBatch(tuple(segments), batch.position_ids[:, rows])))
    outs = []
    for number, (rows, sub) in enumerate(subs):
        keep = local[logits_to_keep[owner[logits_to_keep] == number]]
        sub_inputs = {name: value[:, rows] for name, value in inputs.items()}
        outs.append((rows, ragged_forward(model, sub, keep, want_hidden, compiled=True, **sub_inputs)))
    first = outs[0][1].logits
    logits = first.new_empty((1, len(logits_to_keep), first.shape[-1]))
    for number, (_, out) in enumerate(outs):
        logits[0, owner[logits_to_keep] == number] = out.logits[0].to(logits.dtype)
    hidden = None
    if want_hidden:
        last = outs[0][1].hidden_states[-1]
        hidden = last.new_empty((1, batch.rows, last.shape[-1]))
        for rows, out in outs:
            hidden[0, rows] = out.hidden_states[-1][0].to(hidden.dtype)
        hidden = (hidden,)
    return SimpleNamespace(logits=logits, hidden_states=hidden)


_register()
