"""One forward over many sessions' new tokens: a flattened ragged batch (as vLLM runs a step).

Every session's new tokens are concatenated into one [1, T] row, so each linear layer runs one
matmul over T rows, which on a CPU costs little more than one row (the weights stream from memory
once). Attention cannot be shared: each segment attends to its own session's cached keys/values
plus its own new ones. `ragged_attention`, registered with transformers' AttentionInterface, does
that per segment: it appends the segment's new keys/values to the session's DynamicCache and
calls the very SDPA function and mask a solo cached forward would call, so a segment's attention
equals its solo attention exactly and only the linear layers' row count differs (float noise).

The model is switched to this attention only inside `ragged_forward` (under the runner's lock,
on its thread); outside it, it is the plain SDPA model it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

RAGGED_ATTENTION = "specdec_ragged"

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
class RaggedBatch:
    segments: tuple[Segment, ...]
    position_ids: torch.Tensor  # [1, T]: segment i's rows are past_i, past_i + 1, ...

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
    outputs: list[torch.Tensor | None] = [None] * len(ragged.segments)
    prefixed: dict[tuple[int, int], list[int]] = {}  # (id of the prefix's root, length) -> segment indices
    exact: list[tuple[int, tuple]] = []  # (segment index, (query rows, keys, values)) in the exact form
    for index, seg in enumerate(ragged.segments):
        rows = slice(seg.start, seg.end)
        layer = seg.kv.layers[module.layer_idx]
        if getattr(layer, "prefix_keys", None) is None:
            # The session's keys/values through this segment: [1, Hkv, past + n, D].
            keys, values = seg.kv.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
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


def ragged_forward(model, batch: RaggedBatch, logits_to_keep: torch.Tensor, want_hidden: bool, **inputs):
    """The model over the flattened batch (`inputs`: input_ids or inputs_embeds, [1, T, ...]),
    extending each segment's cache; logits only at the rows in `logits_to_keep` ([K] indices)."""
    with attention_implementation(model, RAGGED_ATTENTION):
        return model(
            **inputs,
            position_ids=batch.position_ids,
            use_cache=False,  # the sessions' caches are updated inside ragged_attention
            logits_to_keep=logits_to_keep,
            output_hidden_states=want_hidden,
            ragged=batch,
        )


_register()
