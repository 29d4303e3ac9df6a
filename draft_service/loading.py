"""Which draft `DraftSettings` name: a model, `ngram`, `suffix`, or a model with a lookup (hybrid)."""

from __future__ import annotations

from draft_service.hybrid import HybridDrafter
from draft_service.served import ServedDraft, served
from draft_service.settings import MODEL_FREE, DraftSettings
from specdec.core.lookup import lookup_drafter, lookup_model_id
from specdec.rpc.model_service import model_free_info


class DraftLoadError(ValueError):
    """SPECDEC_DRAFT_MODEL names neither a model-free draft nor a model that loads."""


def load_draft(settings: DraftSettings, tokenizer=None) -> ServedDraft:
    """The draft `settings.model` names; `tokenizer` (the target's) is for the model-free ones.

    A model with `settings.lookup` set serves the hybrid draft: the lookup first, the model
    where the lookup proposes nothing.
    """
    if settings.model in MODEL_FREE:
        return load_lookup(settings.model, settings, tokenizer)
    model = served(_load_model(settings))
    if not settings.lookup:
        return model
    lookup = lookup_drafter(settings.lookup, settings)
    info = type(model.info)()
    info.CopyFrom(model.info)
    info.model_id = f"{model.info.model_id}+{settings.lookup}"
    # Its Proposes cost a lookup wherever the lookup matches, its model's curve elsewhere: the
    # coordinator's auto K learns the calls' cost as it goes, and reads the curve to decide whether
    # the model may serve at all (DraftSequence.lookup_only).
    info.lookup = settings.lookup
    return ServedDraft(HybridDrafter(lookup, model.drafter), info, model.runner)


def load_lookup(name: str, settings: DraftSettings, tokenizer=None) -> ServedDraft:
    """The lookup draft `name` (ngram or suffix) over `settings.tokenizer` (loaded unless given): no
    KV cache, no position limit, Info from the target's tokenizer."""
    if tokenizer is None:
        from specdec.models.sources import load_tokenizer

        tokenizer = load_tokenizer(settings.tokenizer)
    info = model_free_info(tokenizer, lookup_model_id(name, settings, settings.tokenizer))
    return ServedDraft(lookup_drafter(name, settings), info)


def _load_model(settings: DraftSettings):
    from specdec.rpc.model_service import load_model

    try:
        return load_model(settings, "draft")
    except (OSError, ValueError) as exc:
        raise DraftLoadError(
            f"draft {settings.model!r} is neither a model-free draft ({', '.join(MODEL_FREE)}) "
            f"nor a model that loads: {exc}"
        ) from exc
