"""What a model service's MATMUL_DTYPE setting applies to (`model_service.bf16_matmuls_wanted`,
`int8_matmuls_wanted`)."""

from __future__ import annotations

import pytest
import torch

from specdec.models.bf16_matmul import bf16_supported
from specdec.models.runner import ModelRunner, SessionKVCache
from specdec.models import panels
from specdec.rpc.model_service import bf16_matmuls_wanted, int8_linears, int8_matmuls_wanted


def _runner(dtype=torch.float32) -> ModelRunner:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return ModelRunner(LlamaForCausalLM(config).eval().to(dtype), SessionKVCache(2, 100))


def test_float32_products_leave_any_model_alone():
    assert not bf16_matmuls_wanted("float32", _runner())
    assert not bf16_matmuls_wanted("float32", _runner(torch.bfloat16))


@pytest.mark.skipif(not bf16_supported(), reason="this torch build has no oneDNN bfloat16 matmul")
def test_bfloat16_products_need_an_eager_float32_cpu_model():
    assert bf16_matmuls_wanted("bfloat16", _runner())
    with pytest.raises(ValueError, match="needs a float32 model running eagerly on CPU"):
        bf16_matmuls_wanted("bfloat16", _runner(torch.bfloat16))


@pytest.mark.skipif(not panels.int8_available(), reason="no int8 products on this CPU (AVX2)")
def test_int8_products_need_an_eager_float32_cpu_model_with_4_or_8_bit_weights():
    assert not int8_matmuls_wanted("float32", _runner())
    assert int8_matmuls_wanted("int8", _runner())
    with pytest.raises(ValueError, match="needs a float32 model running eagerly on CPU"):
        int8_matmuls_wanted("int8", _runner(torch.bfloat16))
    with pytest.raises(ValueError, match="weights that are 4- or 8-bit blocks"):
        int8_linears(_runner().model)  # random weights: nothing to multiply in int8
    assert int8_linears(_runner().model, required=False) == 0  # auto: float32 then
    assert int8_matmuls_wanted("auto", _runner()) and not int8_matmuls_wanted("auto", _runner(torch.bfloat16))


def test_int8_products_say_so_where_the_cpu_lacks_them(monkeypatch):
    monkeypatch.setattr(panels, "int8_available", lambda: False)
    with pytest.raises(ValueError, match="AVX2 and the compiled kernels"):
        int8_matmuls_wanted("int8", _runner())
    assert not int8_matmuls_wanted("auto", _runner())


def test_a_service_loads_its_model_on_a_thread_that_holds_no_openmp_team(tiny_model_dirs, monkeypatch):
    """`start_model_server`'s loading thread runs on one torch thread from its first op: a team of
    its own would throttle the model thread's start-up calibration while it lives (`load_model`)."""
    import threading

    from draft_service import server as draft_server
    from draft_service.settings import DraftSettings
    from specdec.settings import load_settings

    seen: list[int] = []
    loaded = threading.Event()

    def load_draft(settings):
        seen.append(torch.get_num_threads())  # what this thread's first torch op runs on
        loaded.set()
        raise RuntimeError("not loading anything here")  # the server then stops, as on any failure

    monkeypatch.setattr(draft_server, "load_draft", load_draft)
    fields = {"model": "ngram", "tokenizer": tiny_model_dirs["target"], "host": "127.0.0.1", "port": 0}
    before = torch.get_num_threads()
    try:
        server, _ = draft_server.create_server(load_settings(DraftSettings, [], {}, metrics_port=-1, **fields))
        assert loaded.wait(30)
        server.server.stop(0).wait(5)
    finally:
        torch.set_num_threads(before)  # the count a new thread's first torch call takes, as it was
    assert seen == [1]


def test_with_a_start_lock_a_service_loads_only_once_the_other_holder_is_done(tiny_model_dirs, tmp_path):
    """Two services of one host measure their forward costs one at a time (a curve measured beside
    another's start is the contention's); the lock is the kernel's, freed with its holder."""
    import fcntl
    import threading

    from draft_service.settings import DraftSettings
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings

    lock = tmp_path / "run" / "start.lock"
    fields = {"model": tiny_model_dirs["draft"], "calibrate_max_rows": 0, "start_lock": str(lock)}
    settings = load_settings(DraftSettings, [], {}, **fields)
    lock.parent.mkdir()
    loaded = []
    with open(lock, "a") as other:  # another service, loading
        fcntl.flock(other, fcntl.LOCK_EX)
        loader = threading.Thread(target=lambda: loaded.append(load_model(settings, "draft")))
        loader.start()
        loader.join(1.0)
        assert loader.is_alive() and not loaded
        fcntl.flock(other, fcntl.LOCK_UN)
    loader.join(60)
    assert loaded and loaded[0].info.role == "draft"
    load_model(settings, "draft")  # released after each load: the next one does not wait
