"""The in-process mode runs the coordinator's request path with the models in one process: same
seed, same tokens as the distributed stack; the CLI's `--in-process` in a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.client import build_request
from specdec.core.errors import InvalidArgument
from specdec.inprocess import InProcessPipeline
from specdec.v1 import coordinator_pb2


@pytest.fixture(scope="module")
def pipeline(tiny_model_dirs):
    return InProcessPipeline(tiny_model_dirs["target"], tiny_model_dirs["draft"])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_in_process_emits_what_the_distributed_stack_emits(pipeline, coordinator_stub, k):
    kwargs = dict(max_new_tokens=12, temperature=1.0, seed=7, num_speculative_tokens=k, ignore_eos=True)
    local = pipeline.generate([1, 2, 3], **kwargs)
    remote = coordinator_stub.Generate(build_request([1, 2, 3], **kwargs), timeout=60)
    assert list(local.completions[0].token_ids) == list(remote.completions[0].token_ids)
    assert local.completions[0].text == remote.completions[0].text
    assert local.stats.rounds == remote.stats.rounds and local.stats.accepted_tokens == remote.stats.accepted_tokens
    assert local.session_id == ""


def test_in_process_streams_chunks_that_add_up_to_the_text(pipeline):
    chunks = list(pipeline.stream([1, 2], max_new_tokens=8, seed=3, num_speculative_tokens=2, ignore_eos=True))
    assert chunks[-1].done and chunks[-1].finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 8
    whole = pipeline.generate([1, 2], max_new_tokens=8, seed=3, num_speculative_tokens=2, ignore_eos=True)
    assert "".join(c.text for c in chunks) == whole.completions[0].text


def test_clearing_the_caches_makes_the_next_request_compute_its_prompt(pipeline):
    """What `scripts/bench.py --prompt-cache cold` relies on: a request whose prompt opens as a cached
    one reads it (the target's cache keeps each request's entry) unless the caches were emptied."""
    target, draft = pipeline.target.runner, pipeline.draft.runner
    kwargs = dict(max_new_tokens=4, temperature=0.0, seed=1, num_speculative_tokens=2, ignore_eos=True)
    prompt = [(3 * i + 1) % 8 for i in range(20)]
    pipeline.generate(prompt, **kwargs)
    assert len(target.cache) and len(draft.cache)
    hits = target.cache.hits
    pipeline.generate(prompt, **kwargs)
    assert target.cache.hits > hits
    pipeline.clear_caches()
    assert not len(target.cache) and not len(draft.cache) and target.cache.total_tokens == 0
    hits = target.cache.hits
    first = target.on_model_thread(target.last_logits, "probe", prompt, 1)
    assert first.cached_tokens == 0 and target.cache.hits == hits


def test_in_process_refuses_a_session(pipeline):
    with pytest.raises(InvalidArgument, match="sessions"):
        pipeline.generate("a b", session_id="abc")


def test_cli_in_process_prints_text_and_stats(tiny_model_dirs):
    args = [sys.executable, "-m", "specdec.cli", "generate", "a b c", "--in-process", "--max-new-tokens", "6"]
    args += ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "-k", "2", "--seed", "1", "--ignore-eos"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "acceptance rate" in done.stderr and "6 generated" in done.stderr


def test_without_a_draft_only_k_zero_runs(tiny_model_dirs):
    from specdec.core.errors import FailedPrecondition

    target_only = InProcessPipeline(tiny_model_dirs["target"], None)
    assert len(target_only.generate([1, 2], max_new_tokens=4, num_speculative_tokens=0).completions[0].token_ids) >= 1
    with pytest.raises(FailedPrecondition, match="no draft"):
        target_only.generate([1, 2], max_new_tokens=4, num_speculative_tokens=2)


def test_a_closed_pipeline_frees_its_models_and_refuses_clearly(tiny_model_dirs):
    from specdec.core.errors import Unavailable

    with InProcessPipeline(tiny_model_dirs["target"], tiny_model_dirs["draft"]) as pipeline:
        pipeline.generate([1, 2, 3], max_new_tokens=4, num_speculative_tokens=2, ignore_eos=True)
        runners = (pipeline.target.runner, pipeline.draft.runner)
        assert all(len(r.cache) > 0 for r in runners)
    assert all(r.closed and len(r.cache) == 0 for r in runners)
    with pytest.raises(Unavailable):
        pipeline.generate([1, 2, 3], max_new_tokens=4, num_speculative_tokens=2, ignore_eos=True)
    pipeline.close()  # idempotent
