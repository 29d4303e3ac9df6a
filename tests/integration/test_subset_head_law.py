"""Losslessness with a vocabulary-subset draft head, through the REAL services.

A draft whose head keeps only some tokens gives q(x) = 0 for the rest while the target's
p(x) > 0 there: that mass can only come out of the residual max(0, p - q). This runs the
shipped draft's shape (an artifact: target-initialised layers + a subset head) on the tiny
target and tests the pipeline's 3-token samples against the target's exact law.
Chi-square at significance 0.001, fixed seeds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from law import exact_sequence_law, fit_to_law, sample_counts

from specdec.core.sampling import Sampling

SIGNIFICANCE = 0.001
PROMPT = [3, 1, 4]
LENGTH = 3
SUBSET = [0, 1, 2, 5, 6]  # EOS (0) and four of the seven other tokens


@pytest.fixture(scope="module")
def subset_stack(tiny_loaded, tiny_model_dirs, redis_url, tmp_path_factory):
    from service_stack import start_stack, stop_stack

    from draft_service.settings import DraftSettings
    from specdec.models.draft_artifact import apply_head_subset, build_draft, save_draft_artifact
    from specdec.models.loading import load_causal_lm
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from specdec.v1 import coordinator_pb2_grpc

    target, _ = load_causal_lm(tiny_model_dirs["target"])
    draft = build_draft(target, 1, [1])
    with torch.no_grad():  # a draft that disagrees with the target beyond the subset cut
        generator = torch.Generator().manual_seed(5)
        for param in draft.model.layers.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=generator) * param.std())
    apply_head_subset(draft, torch.tensor(SUBSET))
    artifact = save_draft_artifact(tmp_path_factory.mktemp("subset") / "draft", draft, tiny_model_dirs["target"], [1])
    loaded = load_model(load_settings(DraftSettings, [], {}, model=str(artifact)), "draft")
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=loaded)
    channel = stack.channel()
    yield {"stub": coordinator_pb2_grpc.CoordinatorStub(channel), "draft": loaded}
    channel.close()
    stop_stack(stack)


def test_subset_draft_proposes_only_subset_tokens_and_says_so(subset_stack):
    from draft_service.proposer import propose
    from specdec.core.protocols import DraftRequest

    runner = subset_stack["draft"].runner
    assert runner.vocab_size == 8 and subset_stack["draft"].info.vocab_size == 8
    (proposal,) = propose(runner, [DraftRequest("subset-q", PROMPT, 4, 11)], Sampling(1.0))
    outside = [t for t in range(8) if t not in SUBSET]
    assert set(proposal.draft_token_ids) <= set(SUBSET)
    assert np.all(np.asarray(proposal.draft_probs)[:, outside] == 0.0)
    assert np.allclose(np.asarray(proposal.draft_probs).sum(-1), 1.0, atol=1e-5)


def test_pipeline_with_subset_draft_follows_target_law(subset_stack, tiny_loaded, record_property):
    total, k, sampling = 14_000, 3, Sampling(1.0)
    law = exact_sequence_law(tiny_loaded["target"].runner.model, PROMPT, LENGTH, sampling)
    # The cut matters: the target puts real mass on tokens the draft can never propose.
    outside = [t for t in range(8) if t not in SUBSET]
    assert law.sum(axis=(1, 2))[outside].sum() > 0.05
    counts, drafted, accepted, recovered = sample_counts(
        subset_stack["stub"], PROMPT, LENGTH, k, sampling, total, LENGTH, seed=424
    )
    fit = fit_to_law("subset-head K3-T1", counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    assert total >= fit.needed, fit.summary
    assert recovered > total * 0.1, fit.summary
    assert fit.p_value > SIGNIFICANCE, fit.summary
