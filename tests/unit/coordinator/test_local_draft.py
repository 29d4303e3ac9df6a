"""The coordinator's own lookup draft (LOCAL_DRAFT): the setting, the lookup settings it reads from
the coordinator's own (SPECDEC_COORDINATOR_NGRAM_* / SUFFIX_*), and what it proposes. Through the
real services: tests/integration/test_suffix_draft.py (greedy equality, the chi-square law test)."""

from __future__ import annotations

import pytest

from coordinator.local_draft import load_local_draft
from coordinator.settings import CoordinatorSettings
from specdec.core.protocols import NO_DEADLINE, DraftRequest
from specdec.core.sampling import Sampling
from specdec.models.sources import load_tokenizer
from specdec.settings import load_settings


def test_the_local_draft_setting_names_a_lookup_or_the_pool(capsys):
    assert load_settings(CoordinatorSettings, [], {}).local_draft == ""
    assert load_settings(CoordinatorSettings, [], {"SPECDEC_COORDINATOR_LOCAL_DRAFT": "suffix"}).local_draft == "suffix"
    for argv, message in (
        (["--local-draft", "model"], "local_draft must be '' (the draft pool), 'ngram' or 'suffix', got 'model'"),
        (["--ngram-max", "99"], "1 <= ngram_min <= ngram_max <= 32"),
        (["--suffix-min-match", "30"], "suffix_min_match must be in [1, suffix_max_depth - 1 = 23]"),
    ):
        with pytest.raises(SystemExit):
            load_settings(CoordinatorSettings, argv, {})
        assert message in capsys.readouterr().err


def test_the_local_draft_is_the_lookup_its_settings_describe(tiny_model_dirs):
    tokenizer_dir = tiny_model_dirs["target"]
    tokenizer = load_tokenizer(tokenizer_dir)
    settings = load_settings(CoordinatorSettings, [], {"SPECDEC_COORDINATOR_NGRAM_MAX": "2"}, tokenizer=tokenizer_dir)
    draft = load_local_draft("ngram", settings, tokenizer_dir, tokenizer)
    assert draft.drafter.max_n == 2 and draft.health.healthy
    info = draft.info(NO_DEADLINE)
    assert info.model_id == f"ngram:1-2@{tokenizer_dir}"
    assert (info.role, info.vocab_size, info.needs_target_hidden_states) == ("draft", len(tokenizer), False)
    # (5, 6) was followed by 7, 8 earlier: a point mass on what followed, up to K.
    (proposal,) = draft.propose([DraftRequest("s", [5, 6, 7, 8, 9, 5, 6], 3, 0)], Sampling(1.0), NO_DEADLINE)
    assert proposal.point_mass and list(proposal.draft_token_ids) == [7, 8, 9]
    suffix = load_local_draft("suffix", settings, tokenizer_dir, tokenizer)
    assert suffix.info(NO_DEADLINE).model_id.startswith("suffix:depth24-match2") and suffix.drafter.cached_tokens == 0
