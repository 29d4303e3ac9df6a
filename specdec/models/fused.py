"""A whole cached forward of short segments in one compiled call (`kernels/layers.cpp`).

A one-row decode of SmolLM2-135M spent ~7 of its 17.5 ms dispatching the ~45 small tensor ops of
each decoder layer from Python. For a ragged batch whose segments are all short (decodes, Verify
rows: what `ragged._compile_segments` marks for the compiled attention), the library runs every
decoder layer at once: the panels products, its own norms, rotary embedding and SiLU, and the
compiled attention, each row computed alone. Python keeps the embedding, the rotary tables (a
table of every position, `_rotary`), the final norm and the head.

The rows of such segments take this path whenever the model has them (`fused_layers`), alone or
batched, after a shared prefix or not (the attention reads a prefix's buffer, then the session's
own): a step that also carries a prompt runs the prompt apart from the short segments, so a row's
bits never depend on its company. Prompts run here too where every linear is a 4- or 8-bit copy
and the CPU has AMX tiles (`tiles`: their products on the tiles, kernels/amx.cpp), else in
transformers' forward: a 300-token prompt of the packaged target spent ~130 of its 380 ms in that
forward's ~40 tensor ops a layer and SDPA, beside its products.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from specdec.models import panels
from specdec.models.cpu_layout import PlannedLinear

# Architectures whose decoder layer is exactly what layers.cpp computes: pre-norm RMSNorm, q / k / v
# (optionally biased) with rotate-half rotary embedding, full attention, a SiLU-gated MLP.
_FUSED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"))
_LINEARS += (("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
_CACHED = "_specdec_fused_layers"  # the model's FusedLayers, once built


@dataclass(frozen=True)
class FusedLayers:
    """The addresses layers.cpp reads, and the tensors behind them (kept alive here)."""

    table: torch.Tensor  # [layers, 2 + 7 * 6] int64: per layer the two norms, then each linear's Linear
    keep: tuple  # every tensor the table points into
    hidden: int
    intermediate: int
    eps: float
    compact: bool  # every linear a 4- or 8-bit copy: what the AMX tiles take (prompts, `tiles`)
    int8: bool = False  # every linear multiplies int8 rows (kernels/int8.cpp): prompts run here too


def _linear_row(linear: PlannedLinear) -> tuple[list[int], list[torch.Tensor]]:
    """(layers.cpp's Linear for this layer: form, three addresses, outputs, bias; the tensors used)."""
    form, parts = panels.kernel_form(linear.weight_panels)
    addresses = [p.data_ptr() for p in parts] + [0] * (3 - len(parts))
    if linear.bias is not None:
        parts.append(linear.bias.detach().to(torch.float32).contiguous())
    bias = parts[-1].data_ptr() if linear.bias is not None else 0
    return [form, *addresses, linear.out_features, bias], parts


def _fusable(model) -> bool:
    config = model.config
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if config.model_type not in _FUSED_MODEL_TYPES or getattr(config, "hidden_act", None) != "silu" or not layers:
        return False
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None or getattr(attention, "q_norm", None) is not None:
            return False
        for parent, name in _LINEARS:
            linear = getattr(getattr(layer, parent, None), name, None)
            if not isinstance(linear, PlannedLinear) or linear.weight_panels is None:
                return False
    return hasattr(inner, "rotary_emb") and hasattr(inner, "norm") and hasattr(inner, "embed_tokens")


def fused_layers(model) -> FusedLayers | None:
    """The model's FusedLayers (built once, then cached on the model), or None when layers.cpp
    cannot compute its decoder layers: not a Llama-shaped architecture, or a linear without panels
    (looked at again each time: its linears may be planned later)."""
    cached = getattr(model, _CACHED, None)
    if cached is None and _fusable(model):
        cached = _build(model)
        setattr(model, _CACHED, cached)
    return cached


def _build(model) -> FusedLayers:
    rows, keep, forms = [], [], set()
    for layer in model.model.layers:
        norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        row = [n.data_ptr() for n in norms]
        keep += norms
        for parent, name in _LINEARS:
            linear_row, parts = _linear_row(getattr(getattr(layer, parent), name))
            forms.add(linear_row[0])
            row += linear_row
            keep += parts
        rows.append(row)
    config = model.config
    eps = float(model.model.layers[0].input_layernorm.variance_epsilon)
    table = torch.tensor(rows, dtype=torch.int64)
    sizes = (config.hidden_size, config.intermediate_size)
    compact, int8 = forms <= panels.COMPACT_FORMS, forms <= panels.INT8_FORM_NUMBERS
    return FusedLayers(table, tuple(keep), *sizes, eps, compact=compact, int8=int8)


_ROTARY = "_specdec_rotary_table"  # on the rotary module: (cos, sin) [positions, D] float32, once built
_MAX_POS = "max_position_embeddings"


def _rotary(inner, embeds: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] float32 at the rows' positions ([1, T]). The model's rotary embedding computed
    them every step in a few small tensor ops (py-spy put 2-5% of a served target's model thread on
    those lines at 1-8 streams, waits for the GIL included; timed alone, 28 us a step, 12 us so);
    with the default rope each entry is an elementwise function of its position alone, so a table of
    every position, computed once by the same module, holds the same values (and a row's values no
    longer depend on where it sits in a step's tensor). Other rope types (dynamic ones) compute per call."""
    rotary, positions = inner.rotary_emb, position_ids[0]
    table = _rotary_table(rotary) if positions.device.type == "cpu" else None
    if table is None or int(positions.max()) >= table[0].shape[0]:
        return _cos_sin(rotary, embeds, position_ids)
    return table[0][positions], table[1][positions]


def _rotary_table(rotary) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) [positions, D] of every position the model has, built on first use; None for other
    rope types or a module without a position limit."""
    table = getattr(rotary, _ROTARY, None)
    limit = getattr(getattr(rotary, "config", None), _MAX_POS, 0)
    if table is None and limit and getattr(rotary, "rope_type", "default") == "default":
        x = torch.zeros((1, 1, 1), dtype=torch.float32)  # only its dtype and device are read
        table = _cos_sin(rotary, x, torch.arange(limit)[None])
        setattr(rotary, _ROTARY, table)
    return table


def _cos_sin(rotary, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t[0].to(torch.float32).contiguous() for t in rotary(x, position_ids))


def fused_forward(
    model, batch, fused: FusedLayers, logits_to_keep: torch.Tensor, want_hidden: bool, tiles: bool = False, **inputs
):
    """transformers' output for a batch whose segments are all compiled (`ragged._compile_segments`
    reserved their caches): logits [1, K, V] at `logits_to_keep`, and with `want_hidden` the final
    (normed) hidden states as `hidden_states[-1]` ([1, T, H]). tiles: the products on AMX tiles,
    for a batch of prompts only (layers.cpp)."""
    inner = model.model
    embeds = inputs.get("inputs_embeds")
    if embeds is None:
        embeds = inner.embed_tokens(inputs["input_ids"])
    h = embeds[0].to(torch.float32).contiguous().clone()  # [T, H], updated in place
    cos, sin = _rotary(inner, embeds, batch.position_ids)  # [T, D] float32
    compiled = batch.compiled
    attention = inner.layers[0].self_attn
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = cos.shape[-1]
    failed = compiled.lib.decoder_layers(
        h.data_ptr(), h.shape[0], fused.hidden, fused.intermediate, fused.table.data_ptr(), fused.table.shape[0],
        fused.eps, cos.data_ptr(), sin.data_ptr(), compiled.tables.data_ptr(), compiled.tables.shape[1], heads,
        kv_heads, dim, ctypes.c_float(attention.scaling), int(tiles), int(compiled.half),
    )
    if failed:
        raise MemoryError("the fused decoder layers could not allocate their scratch rows")
    normed = inner.norm(h)  # [T, H]: every row, with or without want_hidden, for the same bits
    logits = model.lm_head(normed[logits_to_keep]).unsqueeze(0)
    return SimpleNamespace(logits=logits, hidden_states=(normed.unsqueeze(0),) if want_hidden else None)
