"""Distilling small drafts for a target (`specdec distill`) and measuring them (`specdec eval-draft`).

Heavy imports (torch, transformers) happen inside the functions, so `specdec --help` stays fast.
"""


class DistillError(ValueError):
    """Settings that cannot work: a label cache built with other settings, an --init-from artifact
    with another layer count, a draft and target without a shared tokenizer. The CLI reports it
    as `error: ...` with exit code 2."""
