"""The draft artifact: a few trained decoder layers plus a reference to the target they serve.

A directory is a draft artifact when it holds `specdec_draft.json` (sources.DRAFT_ARTIFACT_MARKER):

    specdec_draft.json        manifest: format, target spec, layer count, init layers, tokenizer
                              fingerprint, training facts
    draft_layers.safetensors  the trained decoder layers only (`model.layers.{i}.*`)

The embedding, final norm and LM head are the target's (shared and frozen during
distillation), so loading a draft loads its target once, copies those three in and drops
the rest. The result is an ordinary Hugging Face causal LM with `num_hidden_layers = N`,
so the model services and `specdec.models.runner` use it like any other model.

Optionally the head keeps only a subset of the vocabulary (`VocabSubsetHead`; the ids are
stored in the weights file as `head.token_ids`). With a 49k vocabulary and a 2-layer
draft the full head is ~80% of a draft step; 8k rows cut it ~6x. The draft then gives
q(x) = 0 outside the subset, which the rejection rule handles exactly (the residual
max(0, p - q) carries that mass), so only alpha pays: the subset's share of p.

A draft may also be conditioned on the target's hidden states (EAGLE-style; manifest
`"conditioning": "target_hidden"`): position t is fed `hidden_fuse([f_{t-1}; embed(x_t)])`,
where f_{t-1} is the target's final hidden state at the previous position (zeros at t = 0),
instead of embed(x_t) alone. The target has already done the work of reading the context
into f; the draft only has to look one token further, which a single layer does far better
than it can predict from tokens. The extra weights are `hidden_fuse.{weight,bias}`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from specdec.models.sources import (  # noqa: F401 - the manifest half lives with the sources
    ARTIFACT_FORMAT,
    DRAFT_ARTIFACT_MARKER,
    DraftArtifactError,
    artifact_target,
    read_manifest,
)

WEIGHTS_FILE = "draft_layers.safetensors"
LAYER_PREFIX = "model.layers."
HEAD_TOKEN_IDS = "head.token_ids"
HIDDEN_FUSE = "hidden_fuse"
TRAINED_PREFIXES = (LAYER_PREFIX, HIDDEN_FUSE + ".")
CONDITIONING_TOKENS = "tokens"
CONDITIONING_TARGET_HIDDEN = "target_hidden"


class VocabSubsetHead(torch.nn.Module):
    """The target's LM head restricted to `token_ids`; every other token gets logit -inf.

    forward returns full-vocabulary logits ([..., V]), so a model with this head is a drop-in
    causal LM for the services; `subset_logits` ([..., S]) is what training uses.
    """

    def __init__(self, full_weight: torch.Tensor, token_ids: torch.Tensor):
        super().__init__()
        vocab, hidden = full_weight.shape
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() == 0 or bool((token_ids < 0).any()) or bool((token_ids >= vocab).any()):
            raise DraftArtifactError(f"head token ids must be non-empty and inside [0, {vocab})")
        if token_ids.unique().numel() != token_ids.numel():
            raise DraftArtifactError("head token ids repeat")
        self.in_features, self.out_features = int(hidden), int(vocab)
        # An nn.Linear of its own: a CPU service plans its layouts and int8 products as any other's.
        self.product = torch.nn.Linear(int(hidden), token_ids.numel(), bias=False)
        self.product.weight = torch.nn.Parameter(full_weight.detach()[token_ids].clone(), requires_grad=False)
        self.register_buffer("token_ids", token_ids, persistent=False)
        # column_of[v]: v's column in the subset, or S (a sentinel column) outside it.
        column_of = torch.full((vocab,), token_ids.numel(), dtype=torch.long)
        column_of[token_ids] = torch.arange(token_ids.numel())
        self.register_buffer("column_of", column_of, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """[S, hidden]: the target head's rows for token_ids."""
        return self.product.weight

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.product(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.subset_logits(hidden)
        full = sub.new_full((*sub.shape[:-1], self.out_features), float("-inf"))
        return full.index_copy_(-1, self.token_ids, sub)


def apply_head_subset(model, token_ids) -> None:
    """Replace the model's LM head by the target head's rows for `token_ids` (frozen)."""
    head = model.get_output_embeddings()
    full = head.weight if not isinstance(head, VocabSubsetHead) else None
    if full is None:
        raise DraftArtifactError("the head is already a vocabulary subset")
    if getattr(head, "bias", None) is not None:
        raise DraftArtifactError("vocabulary-subset heads need a head without bias")
    model.set_output_embeddings(VocabSubsetHead(full, token_ids).to(full.device))
    model.config.tie_word_embeddings = False  # the subset is a copy; never re-tie it to the embedding


def head_token_ids(model) -> torch.Tensor | None:
    head = model.get_output_embeddings()
    return head.token_ids if isinstance(head, VocabSubsetHead) else None


def _draft_config(target_config, num_layers: int, init_layers: list[int]):
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = num_layers
    # Per-layer lists (e.g. sliding/full attention patterns) follow the layers the draft started from.
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == target_config.num_hidden_layers:
        config.layer_types = [layer_types[i] for i in init_layers]
    for attr in ("quantization_config",):  # a GGUF target's; the draft is plain float weights
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                setattr(config, attr, None)
    config.use_cache = True
    return config


def _decoder(model):
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise DraftArtifactError(f"{type(model).__name__}: expected model.model.layers and model.model.norm")
    return inner


def build_draft(
    target_model, num_layers: int, init_layers: list[int] | None = None, conditioning: str = CONDITIONING_TOKENS
):
    """A float32 draft with `num_layers` decoder layers copied from `init_layers` of the target.

    Embedding, final norm and LM head are copies of the target's and are frozen
    (requires_grad False); only the decoder layers train.
    """
    from transformers import AutoModelForCausalLM

    n_target = int(target_model.config.num_hidden_layers)
    if init_layers is None:
        init_layers = list(range(num_layers))
    init_layers = [i if i >= 0 else n_target + i for i in init_layers]
    if len(init_layers) != num_layers or not all(0 <= i < n_target for i in init_layers):
        raise ValueError(f"init_layers {init_layers} must name {num_layers} of the target's {n_target} layers")
    config = _draft_config(target_model.config, num_layers, init_layers)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target_inner, draft_inner = _decoder(target_model), _decoder(draft)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(target_model.get_input_embeddings().weight.float())
        draft_inner.norm.load_state_dict({k: v.float() for k, v in target_inner.norm.state_dict().items()})
        if not getattr(config, "tie_word_embeddings", False):
            draft.get_output_embeddings().weight.copy_(target_model.get_output_embeddings().weight.float())
        for dst, src in enumerate(init_layers):
            # load_state_dict, not a module copy: the attention's layer_idx (the cache slot) stays dst.
            state = {k: v.float() for k, v in target_inner.layers[src].state_dict().items()}
            draft_inner.layers[dst].load_state_dict(state)
    if conditioning == CONDITIONING_TARGET_HIDDEN:
        add_hidden_fuse(draft)
    elif conditioning != CONDITIONING_TOKENS:
        raise DraftArtifactError(f"unknown draft conditioning {conditioning!r}")
    freeze_shared(draft)
    draft.generation_config = copy.deepcopy(getattr(target_model, "generation_config", draft.generation_config))
    return draft


def add_hidden_fuse(draft) -> None:
    """Make `draft` read the target's hidden states: a trainable Linear([f; e]) -> input.

    Starts as (f + e) / 2, so the untrained draft already sees both the token and the context.
    """
    hidden = int(draft.config.hidden_size)
    fuse = torch.nn.Linear(2 * hidden, hidden, bias=True)
    with torch.no_grad():
        fuse.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1) * 0.5)
        fuse.bias.zero_()
    param = next(draft.parameters())
    setattr(draft, HIDDEN_FUSE, fuse.to(device=param.device, dtype=param.dtype))


def _fuse_passes_embedding(draft) -> None:
    fuse = getattr(draft, HIDDEN_FUSE)
    hidden = int(draft.config.hidden_size)
    with torch.no_grad():
        fuse.weight.zero_()
        fuse.weight[:, hidden:].copy_(torch.eye(hidden))
        fuse.bias.zero_()


def needs_target_hidden(model) -> bool:
    """True for a draft conditioned on the target's hidden states."""
    return isinstance(getattr(model, HIDDEN_FUSE, None), torch.nn.Module)


def fed_hidden(previous: torch.Tensor) -> torch.Tensor:
    """What each position of a hidden-state draft reads, from the target's states before it.

    previous: [..., T - 1, H], the target's final hidden states at positions 0..T-2.
    Returns [..., T, H]: row t is the state at t - 1, zeros at position 0.
    """
    zeros = previous.new_zeros((*previous.shape[:-2], 1, previous.shape[-1]))
    return torch.cat([zeros, previous], dim=-2)


def fused_inputs(model, token_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
    """The input embeddings of a hidden-state-conditioned draft.

    token_ids: [B, T]; prev_hidden: [B, T, H] from `fed_hidden`. Returns [B, T, H].
    """
    embeds = model.get_input_embeddings()(token_ids)
    fuse = getattr(model, HIDDEN_FUSE)
    return fuse(torch.cat([prev_hidden.to(embeds.dtype), embeds], dim=-1))


def freeze_shared(draft) -> None:
    for name, param in draft.named_parameters():
        param.requires_grad_(name.startswith(TRAINED_PREFIXES))


def trained_state(draft) -> dict[str, torch.Tensor]:
    """The decoder layers' (and hidden fuse's) tensors: what the artifact stores."""
    return {k: v for k, v in draft.state_dict().items() if k.startswith(TRAINED_PREFIXES)}


def save_draft_artifact(
    directory: str | Path,
    draft,
    target_spec: str,
    init_layers: list[int],
    tokenizer_fingerprint: str | None = None,
    weights_dtype: torch.dtype = torch.bfloat16,
    info: dict | None = None,
) -> Path:
    """Write the manifest and the trained layers (atomically enough: weights first, manifest last)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", weights_dtype).contiguous() for k, v in trained_state(draft).items()}
    subset = head_token_ids(draft)
    if subset is not None:
        tensors[HEAD_TOKEN_IDS] = subset.detach().to("cpu", torch.int64).contiguous()
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": ARTIFACT_FORMAT})
    tmp.replace(directory / WEIGHTS_FILE)
    (directory / WEIGHTS_FILE).chmod(0o644)
    manifest = {
        "format": ARTIFACT_FORMAT,
        "target": target_spec,
        "num_layers": int(draft.config.num_hidden_layers),
        "init_layers": [int(i) for i in init_layers],
        "weights": WEIGHTS_FILE,
        "weights_dtype": str(weights_dtype).removeprefix("torch."),
        "target_tokenizer_fingerprint": tokenizer_fingerprint,
        "shared_from_target": ["embedding", "final norm", "lm head"],
        "head_tokens": int(subset.numel()) if subset is not None else None,
        "conditioning": CONDITIONING_TARGET_HIDDEN if needs_target_hidden(draft) else CONDITIONING_TOKENS,
        "info": info or {},
    }
    tmp_manifest = directory / (DRAFT_ARTIFACT_MARKER + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp_manifest.replace(directory / DRAFT_ARTIFACT_MARKER)
    return directory


def load_draft_weights(draft, directory: str | Path, manifest: dict | None = None) -> None:
    """Copy the artifact's layers into `draft` (and switch to its vocabulary-subset head, if any).

    A tokens-only artifact loads into a draft that reads hidden states too (continued training):
    its fuse is then set to pass the embedding through and ignore the states, so the draft starts
    out exactly as the artifact and training teaches it to use them.
    """
    from safetensors.torch import load_file

    manifest = manifest or read_manifest(directory)
    path = Path(directory) / manifest.get("weights", WEIGHTS_FILE)
    if not path.is_file():
        raise DraftArtifactError(f"{path} is missing")
    tensors = load_file(str(path))
    subset = tensors.pop(HEAD_TOKEN_IDS, None)
    if subset is not None and head_token_ids(draft) is None:
        apply_head_subset(draft, subset)
    expected = set(trained_state(draft))
    if needs_target_hidden(draft) and not any(name.startswith(HIDDEN_FUSE + ".") for name in tensors):
        expected = {name for name in expected if not name.startswith(HIDDEN_FUSE + ".")}
        _fuse_passes_embedding(draft)
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise DraftArtifactError(f"{path}: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        params = dict(draft.named_parameters())
        buffers = dict(draft.named_buffers())
        for name, value in tensors.items():
            (params.get(name) if name in params else buffers[name]).copy_(value.float())
