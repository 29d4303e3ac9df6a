"""Behaviour through the real services: greedy equivalence, reproducibility, stats, streaming."""

from __future__ import annotations

import threading

import torch

from specdec.client import build_request
from specdec.v1 import coordinator_pb2

PROMPT = [3, 1, 4, 1, 5]


def _target_greedy(model, prompt, n):
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_speculative_equals_target_only_greedy(coordinator_stub, tiny_loaded):
    reference = _target_greedy(tiny_loaded["target"].runner.model, PROMPT, 24)
    for k in (0, 1, 3, 8):
        response = coordinator_stub.Generate(
            build_request(PROMPT, max_new_tokens=24, temperature=0, num_speculative_tokens=k, ignore_eos=True)
        )
        assert list(response.completions[0].token_ids) == reference, f"K={k}"
        assert response.completions[0].finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
        if k:
            # A disagreeing pair: the greedy path must have rejected some drafts.
            assert response.stats.accepted_tokens < response.stats.drafted_tokens


def test_same_seed_same_output_and_stats(coordinator_stub):
    request = build_request(PROMPT, max_new_tokens=30, seed=7, num_speculative_tokens=3, ignore_eos=True)
    first = coordinator_stub.Generate(request)
    second = coordinator_stub.Generate(request)
    assert first.completions[0].token_ids == second.completions[0].token_ids
    assert first.seed == 7
    other = coordinator_stub.Generate(
        build_request(PROMPT, max_new_tokens=30, seed=8, num_speculative_tokens=3, ignore_eos=True)
    )
    assert other.completions[0].token_ids != first.completions[0].token_ids
    stats = first.stats
    assert stats.generated_tokens == 30 and stats.prompt_tokens == len(PROMPT)
    assert stats.rounds >= 30 / 4
    assert stats.accepted_tokens + stats.recovered_tokens + stats.bonus_tokens >= 30
    assert 0 < stats.acceptance_rate < 1
    assert stats.acceptance_rate == stats.accepted_tokens / stats.drafted_tokens
    assert stats.draft_time_s > 0 and stats.verify_time_s > 0 and stats.tokens_per_second > 0
    assert abs(stats.total_time_s - stats.draft_time_s - stats.verify_time_s - stats.coordinator_time_s) < 1e-3


# A seed fixes the tokens at a fixed K only: auto K (the coordinator's default) chooses K from the
# request's timings, so two calls of one seed may draft differently and emit other (equally lawful) tokens.
FIXED_K = 2


def test_unseeded_requests_report_their_seed_and_replay(coordinator_stub):
    request = {"max_new_tokens": 12, "ignore_eos": True, "num_speculative_tokens": FIXED_K}
    first = coordinator_stub.Generate(build_request(PROMPT, **request))
    replay = coordinator_stub.Generate(build_request(PROMPT, **request, seed=first.seed))
    assert replay.completions[0].token_ids == first.completions[0].token_ids


def test_eos_and_stop_strings_end_generation(coordinator_stub, tiny_stack):
    # Without ignore_eos the tiny model's <eos> (id 0) ends a sample; among many samples some hit it.
    response = coordinator_stub.Generate(build_request(PROMPT, max_new_tokens=20, seed=1, num_samples=64))
    reasons = {c.finish_reason for c in response.completions}
    assert coordinator_pb2.FINISH_REASON_EOS in reasons
    for c in response.completions:
        if c.finish_reason == coordinator_pb2.FINISH_REASON_EOS:
            assert c.token_ids[-1] == 0 and 0 not in c.token_ids[:-1]
    # Stop string: the text is cut before it and the tokens end with the one that completed it.
    request = {"max_new_tokens": 20, "seed": 3, "ignore_eos": True, "num_speculative_tokens": FIXED_K}
    base = coordinator_stub.Generate(build_request(PROMPT, **request))
    words = base.completions[0].text.split()
    stop = words[3]
    stopped = coordinator_stub.Generate(build_request(PROMPT, **request, stop=[stop]))
    completion = stopped.completions[0]
    assert completion.finish_reason == coordinator_pb2.FINISH_REASON_STOP
    assert stop not in completion.text
    assert base.completions[0].text.startswith(completion.text)
    assert list(base.completions[0].token_ids[: len(completion.token_ids)]) == list(completion.token_ids)


def test_stream_chunks_concatenate_to_unary_response(coordinator_stub):
    request = build_request(PROMPT, max_new_tokens=25, seed=11, num_speculative_tokens=3, ignore_eos=True, stop=["g f"])
    unary = coordinator_stub.Generate(request)
    chunks = list(coordinator_stub.GenerateStream(request))
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == unary.completions[0].text
    assert [t for c in chunks for t in c.token_ids] == list(unary.completions[0].token_ids)
    assert chunks[-1].finish_reason == unary.completions[0].finish_reason
    assert chunks[-1].stats.generated_tokens == len(unary.completions[0].token_ids)
    assert len(chunks) - 1 == chunks[-1].stats.rounds  # one chunk per round


def test_text_prompt_is_tokenized_with_the_target_tokenizer(coordinator_stub):
    response = coordinator_stub.Generate(build_request("c a d a e", max_new_tokens=5, temperature=0, ignore_eos=True))
    by_ids = coordinator_stub.Generate(build_request(PROMPT, max_new_tokens=5, temperature=0, ignore_eos=True))
    assert response.completions[0].token_ids == by_ids.completions[0].token_ids
    assert response.stats.prompt_tokens == 5


def test_each_service_runs_its_model_on_one_thread(coordinator_stub, tiny_loaded):
    # OpenMP keeps a worker team per calling thread; forwards from many gRPC worker threads
    # would build many teams that slow each other down. Each service runs every forward on
    # its runner's single model thread, whichever gRPC thread took the call.
    seen: dict[str, set[str]] = {"draft": set(), "target": set()}
    hooks = [
        # (The head runs in every forward, transformers' or the fused layers'.)
        tiny_loaded[role].runner.model.lm_head.register_forward_pre_hook(
            lambda module, args, role=role: seen[role].add(threading.current_thread().name)
        )
        for role in seen
    ]
    try:
        for seed in range(3):
            coordinator_stub.Generate(build_request(PROMPT, max_new_tokens=12, seed=seed, num_speculative_tokens=2))
    finally:
        for hook in hooks:
            hook.remove()
    for role, names in seen.items():
        assert len(names) == 1 and next(iter(names)).startswith("model"), (role, names)
