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
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if ragged is None:
        raise RuntimeError("ragged attention called outside ragged_forward")
    outputs = []
    for seg in ragged.segments:
        rows = slice(seg.start, seg.end)
        # The session's keys/values through this segment: [1, Hkv, past + n, D].
        keys, values = seg.kv.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
        out, _ = sdpa_attention_forward(module, query[:, :, rows], keys, values, seg.mask, **kwargs)
        outputs.append(out)  # [1, n, Hq, D]
    return torch.cat(outputs, dim=1), None


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
