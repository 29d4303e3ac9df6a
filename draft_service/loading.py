"""Which draft `DraftSettings` name: a model, `ngram`, `suffix`, or a model with a lookup (hybrid)."""

from __future__ import annotations

from draft_service.hybrid import HybridDrafter
from draft_service.ngram import NgramDrafter, load_ngram
from draft_service.served import ServedDraft, served
from draft_service.settings import MODEL_FREE, NGRAM_MODEL, SUFFIX_MODEL, DraftSettings
from draft_service.suffix import load_suffix, suffix_drafter


class DraftLoadError(ValueError):
    """SPECDEC_DRAFT_MODEL names neither a model-free draft nor a model that loads."""


def load_draft(settings: DraftSettings, tokenizer=None) -> ServedDraft:
    """The draft `settings.model` names; `tokenizer` (the target's) is for the model-free ones.

    A model with `settings.lookup` set serves the hybrid draft: the lookup first, the model
    where the lookup proposes nothing.
    """
    if settings.model == NGRAM_MODEL:
        return load_ngram(settings, tokenizer)
    if settings.model == SUFFIX_MODEL:
        return load_suffix(settings, tokenizer)
    model = served(_load_model(settings))
    if not settings.lookup:
        return model
    lookup = (
        NgramDrafter(settings.ngram_min, settings.ngram_max)
        if settings.lookup == NGRAM_MODEL
        else suffix_drafter(settings)
    )
    info = type(model.info)()
    info.CopyFrom(model.info)
    info.model_id = f"{model.info.model_id}+{settings.lookup}"
    # Its Proposes cost a lookup wherever the lookup matches, its model's curve elsewhere: the
    # coordinator's auto K learns the calls' cost as it goes, and reads the curve to decide whether
    # the model may serve at all (DraftSequence.lookup_only).
    info.lookup = settings.lookup
    return ServedDraft(HybridDrafter(lookup, model.drafter), info, model.runner)


def _load_model(settings: DraftSettings):
    from specdec.rpc.model_service import load_model

    try:
        return load_model(settings, "draft")
    except (OSError, ValueError) as exc:
        raise DraftLoadError(
            f"draft {settings.model!r} is neither a model-free draft ({', '.join(MODEL_FREE)}) "
            f"nor a model that loads: {exc}"
        ) from exc
