"""Distilling small drafts for a target (`specdec distill`) and measuring them (`specdec eval-draft`).

Heavy imports (torch, transformers) happen inside the functions, so `specdec --help` stays fast.
"""
