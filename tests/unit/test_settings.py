from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.settings import env_vars, load_settings
from target_service.settings import TargetSettings


def test_flag_beats_env_beats_default():
    env = {"SPECDEC_DRAFT_PORT": "6000", "SPECDEC_DRAFT_MODEL": "/models/d"}
    settings = load_settings(DraftSettings, ["--port", "7000"], env)
    assert settings.port == 7000 and settings.model == "/models/d"
    assert load_settings(DraftSettings, [], {}).port == 50052
    assert load_settings(TargetSettings, [], {}).port == 50053
    assert load_settings(CoordinatorSettings, [], {}).port == 50051


def test_each_service_has_its_own_env_prefix():
    assert env_vars(DraftSettings)["model"] == "SPECDEC_DRAFT_MODEL"
    assert env_vars(TargetSettings)["model"] == "SPECDEC_TARGET_MODEL"
    assert env_vars(CoordinatorSettings)["redis_url"] == "SPECDEC_COORDINATOR_REDIS_URL"


def test_settings_are_frozen_and_validated():
    settings = load_settings(CoordinatorSettings, [], {})
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, ["--default-num-speculative-tokens", "99"], {})
    with pytest.raises(SystemExit):
        load_settings(DraftSettings, [], {"SPECDEC_DRAFT_PORT": "not-a-number"})


def test_booleans_and_floats_parse_from_env():
    settings = load_settings(CoordinatorSettings, [], {"SPECDEC_COORDINATOR_DRAFT_TIMEOUT_S": "2.5"})
    assert settings.draft_timeout_s == 2.5


def test_the_ngram_draft_settings_and_their_bounds(capsys):
    settings = load_settings(DraftSettings, [], {"SPECDEC_DRAFT_MODEL": "ngram", "SPECDEC_DRAFT_TOKENIZER": "/t"})
    assert (settings.model, settings.tokenizer, settings.ngram_min, settings.ngram_max) == ("ngram", "/t", 1, 4)
    assert env_vars(DraftSettings)["ngram_max"] == "SPECDEC_DRAFT_NGRAM_MAX"
    assert load_settings(DraftSettings, ["--ngram-min", "2", "--ngram-max", "32"], {}).ngram_max == 32
    for env in (
        {"SPECDEC_DRAFT_NGRAM_MIN": "0"},
        {"SPECDEC_DRAFT_NGRAM_MIN": "5", "SPECDEC_DRAFT_NGRAM_MAX": "4"},
        {"SPECDEC_DRAFT_NGRAM_MAX": "33"},
    ):
        with pytest.raises(SystemExit):
            load_settings(DraftSettings, [], env)
        assert "1 <= ngram_min <= ngram_max <= 32" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        ([], {}, None),
        ([], {"SPECDEC_COORDINATOR_DEFAULT_K": "auto"}, None),
        ([], {"SPECDEC_COORDINATOR_DEFAULT_K": "AUTO"}, None),
        ([], {"SPECDEC_COORDINATOR_DEFAULT_K": "1"}, 1),
        (["--default-num-speculative-tokens", "0"], {"SPECDEC_COORDINATOR_DEFAULT_K": "auto"}, 0),
        (["--default-num-speculative-tokens", "4", "--max-num-speculative-tokens", "4"], {}, 4),
    ],
)
def test_the_default_k_is_auto_or_an_integer(argv, env, expected):
    assert env_vars(CoordinatorSettings)["default_num_speculative_tokens"] == "SPECDEC_COORDINATOR_DEFAULT_K"
    assert load_settings(CoordinatorSettings, argv, env).default_k() == expected


@pytest.mark.parametrize("value", ["17", "-1", "1.5", "automatic", ""])
def test_a_bad_default_k_is_refused_with_a_clear_message(value, capsys):
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, [], {"SPECDEC_COORDINATOR_DEFAULT_K": value})
    assert "DEFAULT_K) must be 'auto' or an integer in [0, 16]" in capsys.readouterr().err
