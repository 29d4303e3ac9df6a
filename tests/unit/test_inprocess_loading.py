"""How `specdec.inprocess` loads its models (the pipeline itself: tests/integration/test_inprocess.py)."""

from __future__ import annotations

import threading

import torch

from specdec import inprocess
from specdec.models import sources
from specdec.rpc import model_service


def test_models_load_on_a_thread_that_holds_no_openmp_team(monkeypatch):
    """The loading thread runs on one torch thread from its first op: a team of its own would
    throttle the model thread's start-up calibration while it lives (`model_service.load_model`)."""
    seen: list[int] = []

    def load_model(settings, role):
        seen.append(torch.get_num_threads())  # what this thread's first torch op runs on
        return "loaded"

    monkeypatch.setattr(model_service, "load_model", load_model)
    monkeypatch.setattr(sources, "load_tokenizer", lambda spec: "tokenizer")
    before = torch.get_num_threads()
    try:
        loader = threading.Thread(target=lambda: seen.append(inprocess._load("tiny", None, None)))
        loader.start()
        loader.join()
    finally:
        torch.set_num_threads(before)  # the count a new thread's first torch call takes, as it was
    assert seen == [1, ("loaded", None, None, "tokenizer")]
