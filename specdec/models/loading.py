"""Loading causal LMs (weights, dtype, device) from any source the services accept, draft
artifacts included."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.models.draft_artifact import CONDITIONING_TOKENS, build_draft, load_draft_weights
from specdec.models.sources import artifact_target, is_draft_artifact, read_manifest, resolve_model_source

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def load_causal_lm(spec: str, dtype: str = "float32", device: str = "cpu"):
    """Returns (model in eval mode on `device`, ModelSource)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(spec)
    if resolve_device(device).type == "cpu":
        _cpu_attention_defaults()
    if is_draft_artifact(source):
        model = load_draft_artifact(source.location, dtype=dtype, device=device)
        model.eval()
        return model, source
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=resolve_dtype(dtype), **source.kwargs())
    model.to(resolve_device(device))
    model.eval()
    return model, source


def _cpu_attention_defaults() -> None:
    """Grouped-query attention over several query rows with a mask (a Verify, a prefill), on CPU.

    transformers' SDPA path copies every key/value head group-fold (`repeat_kv`) whenever a mask is
    passed, because CUDA kernels would fall back to the slow path otherwise. torch's CPU flash
    kernel takes the mask with `enable_gqa` directly, bit for bit the same output: without the copy,
    a 3-5 row forward of SmolLM2 after 600 tokens is ~8 ms faster. An environment value wins.
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


def eos_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def load_draft_artifact(directory: str | Path, dtype: str = "float32", device: str = "cpu", target_model=None):
    """The draft as a Hugging Face causal LM (eval mode) on `device` in `dtype`.

    Loads the target (unless given) for its embedding, final norm and head.
    """
    manifest = read_manifest(directory)
    if target_model is None:
        target_model, _ = load_causal_lm(artifact_target(directory), dtype="float32", device="cpu")
    num_layers = int(manifest["num_layers"])
    init_layers = [int(i) for i in manifest.get("init_layers") or range(num_layers)]
    conditioning = str(manifest.get("conditioning", CONDITIONING_TOKENS))
    draft = build_draft(target_model, num_layers, init_layers, conditioning)
    del target_model
    load_draft_weights(draft, directory, manifest)
    draft.requires_grad_(False)
    draft.to(device=resolve_device(device), dtype=resolve_dtype(dtype))
    draft.eval()
    return draft
