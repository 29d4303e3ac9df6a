"""draft_service: the suffix drafter, the hybrid routing, and which draft the settings name."""

from __future__ import annotations

import pytest

from draft_service.hybrid import HybridDrafter
from specdec.core.lookup import SuffixDrafter
from specdec.core.protocols import NO_DEADLINE, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling
from specdec.core.suffix import SuffixParams

PARAMS = SuffixParams(max_depth=8, min_match=2)


def _request(prefix, k=3, key=""):
    return DraftRequest(key, list(prefix), k, seed=0)


class _Recording:
    """A drafter that proposes fixed tokens with a law and records what it was asked."""

    def __init__(self):
        self.asked: list[list[int]] = []

    def propose(self, requests, sampling, deadline):
        import numpy as np

        self.asked.append([r.prefix_token_ids[-1] for r in requests])
        laws = np.full((1, 4), 0.25, np.float32)
        return [DraftProposal([0], laws) for _ in requests]


def test_the_suffix_drafter_sends_point_masses_and_shares_its_cache_across_keys():
    drafter = SuffixDrafter(PARAMS, 1000)
    (first,) = drafter.propose([_request([9, 1, 2, 3, 4], key="a")], Sampling(1.0), NO_DEADLINE)
    assert first.point_mass and first.draft_probs is None and first.draft_token_ids == []
    found, none = drafter.propose([_request([1, 2], key="b"), _request([7, 7])], Sampling(1.0), NO_DEADLINE)
    assert found.point_mass and found.draft_token_ids == [3, 4]  # the end of what "a" was seen with
    assert none.point_mass and none.draft_token_ids == []
    assert drafter.cached_tokens == 7  # "a" and "b"; the keyless sample is not kept
    HybridDrafter(drafter, _Recording()).reset()  # a hybrid resets its lookup
    assert drafter.cached_tokens == 0
    (cold,) = drafter.propose([_request([1, 2], key="c")], Sampling(1.0), NO_DEADLINE)
    assert cold.draft_token_ids == []


def test_hybrid_asks_the_model_only_for_the_sequences_the_lookup_left_empty():
    model = _Recording()
    hybrid = HybridDrafter(SuffixDrafter(PARAMS, 1000), model)
    requests = [_request([5, 6, 5, 6, 5]), _request([1, 2, 3]), _request([4, 8, 4, 8])]
    proposals = hybrid.propose(requests, Sampling(1.0), NO_DEADLINE)
    assert model.asked == [[3]]  # one call, for the sequence with no confident match
    assert [p.point_mass for p in proposals] == [True, False, True]
    assert [p.draft_token_ids for p in proposals] == [[6, 5, 6], [0], [4, 8, 4]]
    assert proposals[1].draft_probs.shape == (1, 4)
    model.asked.clear()
    hybrid.propose(requests[:1], Sampling(1.0), NO_DEADLINE)
    assert model.asked == []  # every sequence matched: the model is not called
    lookup_only = [DraftRequest(r.cache_key, r.prefix_token_ids, 3, 0, lookup_only=True) for r in requests]
    proposals = hybrid.propose(lookup_only, Sampling(1.0), NO_DEADLINE)
    assert [p.draft_token_ids for p in proposals] == [[6, 5, 6], [], [4, 8, 4]]
    assert model.asked == []  # asked for the lookup alone: no match is no draft


def test_an_unknown_draft_name_fails_clearly(tmp_path):
    from draft_service.loading import DraftLoadError, load_draft
    from draft_service.settings import DraftSettings
    from specdec.settings import load_settings

    for name in ("sufix", str(tmp_path / "missing")):
        with pytest.raises(DraftLoadError, match="is neither a model-free draft \\(ngram, suffix\\) nor a model"):
            load_draft(load_settings(DraftSettings, [], {}, model=name))


def test_a_hybrid_reports_its_lookup_beside_its_model_curve(tiny_model_dirs):
    """A hybrid's Proposes cost a lookup where it matches: its Info names the lookup, so that the
    coordinator's auto K prices the model's curve for the model's part alone (and asks for the
    lookup alone where the model cannot pay) instead of for every call."""
    from draft_service.loading import load_draft
    from draft_service.settings import DraftSettings
    from specdec.settings import load_settings

    settings = {"model": tiny_model_dirs["draft"], "tokenizer": tiny_model_dirs["target"], "calibrate_max_rows": 2}
    model = load_draft(load_settings(DraftSettings, [], {}, **settings))
    hybrid = load_draft(load_settings(DraftSettings, [], {}, lookup="suffix", **settings))
    assert len(model.info.forward_cost_ms) == 2 and model.info.lookup == ""
    assert hybrid.info.model_id.endswith("+suffix") and hybrid.info.lookup == "suffix"
    assert len(hybrid.info.forward_cost_ms) == 2
