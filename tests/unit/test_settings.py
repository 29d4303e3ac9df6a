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


def test_the_suffix_draft_settings_and_their_bounds(capsys):
    settings = load_settings(DraftSettings, [], {"SPECDEC_DRAFT_MODEL": "suffix"})
    assert settings.model == "suffix" and settings.lookup == ""
    assert (settings.suffix_max_depth, settings.suffix_min_match) == (24, 2)
    assert (settings.suffix_min_token_prob, settings.suffix_min_path_prob) == (0.3, 0.3)
    assert settings.suffix_cache_max_tokens == 65536
    assert env_vars(DraftSettings)["suffix_cache_max_tokens"] == "SPECDEC_DRAFT_SUFFIX_CACHE_MAX_TOKENS"
    flags = ["--suffix-max-depth", "64", "--suffix-min-match", "63", "--suffix-min-token-prob", "1"]
    assert load_settings(DraftSettings, flags, {}).suffix_max_depth == 64
    for env, message in (
        ({"SPECDEC_DRAFT_SUFFIX_MAX_DEPTH": "1"}, "suffix_max_depth must be in [2, 64]"),
        ({"SPECDEC_DRAFT_SUFFIX_MAX_DEPTH": "65"}, "suffix_max_depth must be in [2, 64]"),
        ({"SPECDEC_DRAFT_SUFFIX_MIN_MATCH": "0"}, "suffix_min_match must be in [1, suffix_max_depth - 1 = 23]"),
        ({"SPECDEC_DRAFT_SUFFIX_MIN_MATCH": "24"}, "suffix_min_match must be in [1, suffix_max_depth - 1 = 23]"),
        ({"SPECDEC_DRAFT_SUFFIX_MIN_TOKEN_PROB": "0"}, "suffix_min_token_prob must be in (0, 1]"),
        ({"SPECDEC_DRAFT_SUFFIX_MIN_PATH_PROB": "1.5"}, "suffix_min_path_prob must be in (0, 1]"),
        ({"SPECDEC_DRAFT_SUFFIX_MIN_PATH_PROB": "nan"}, "suffix_min_path_prob must be in (0, 1]"),
        ({"SPECDEC_DRAFT_SUFFIX_CACHE_MAX_TOKENS": "0"}, "suffix_cache_max_tokens must be in [1, 100000000]"),
    ):
        with pytest.raises(SystemExit):
            load_settings(DraftSettings, [], {"SPECDEC_DRAFT_MODEL": "suffix", **env})
        assert message in capsys.readouterr().err


def test_a_lookup_makes_a_model_draft_hybrid_and_needs_one(capsys):
    env = {"SPECDEC_DRAFT_MODEL": "/models/d", "SPECDEC_DRAFT_LOOKUP": "suffix"}
    assert load_settings(DraftSettings, [], env).lookup == "suffix"
    assert load_settings(DraftSettings, ["--lookup", "ngram"], {}).lookup == "ngram"
    for env, message in (
        ({"SPECDEC_DRAFT_LOOKUP": "sufix"}, "lookup must be '' (none), 'ngram' or 'suffix', got 'sufix'"),
        ({"SPECDEC_DRAFT_LOOKUP": "hybrid"}, "lookup must be '' (none), 'ngram' or 'suffix', got 'hybrid'"),
        (
            {"SPECDEC_DRAFT_MODEL": "ngram", "SPECDEC_DRAFT_LOOKUP": "suffix"},
            "lookup='suffix' goes with a draft model (hybrid); model='ngram' is model-free already",
        ),
    ):
        with pytest.raises(SystemExit):
            load_settings(DraftSettings, [], env)
        assert message in capsys.readouterr().err


def test_a_target_drafts_with_a_lookup_of_its_own_only_when_named(capsys):
    assert load_settings(TargetSettings, [], {}).lookup == ""
    env = {"SPECDEC_TARGET_LOOKUP": "suffix", "SPECDEC_TARGET_SUFFIX_MIN_MATCH": "3"}
    settings = load_settings(TargetSettings, [], env)
    assert (settings.lookup, settings.suffix_min_match) == ("suffix", 3)
    for env, message in (
        ({"SPECDEC_TARGET_LOOKUP": "model"}, "lookup must be '' (none), 'ngram' or 'suffix', got 'model'"),
        ({"SPECDEC_TARGET_NGRAM_MAX": "0"}, "ngram_min and ngram_max must satisfy"),
    ):
        with pytest.raises(SystemExit):
            load_settings(TargetSettings, [], env)
        assert message in capsys.readouterr().err


def test_the_batching_settings_reach_the_scheduler():
    from specdec.rpc.model_service import scheduler_limits

    env = {"SPECDEC_TARGET_BATCH_WAIT_MS": "3", "SPECDEC_TARGET_BATCH_WAIT_SHARE": "0.5"}
    flags = ["--max-batch-tokens", "512", "--prefill-chunk-tokens", "64"]
    limits = scheduler_limits(load_settings(TargetSettings, flags, env))
    assert (limits.batch_wait_s, limits.batch_wait_share, limits.max_batch_tokens) == (0.003, 0.5, 512)
    assert limits.prefill_chunk_tokens == 64
    with pytest.raises(SystemExit):
        load_settings(TargetSettings, [], {"SPECDEC_TARGET_BATCH_WAIT_SHARE": "2"})


def test_the_matmul_dtype_setting_and_what_it_refuses(capsys):
    assert load_settings(TargetSettings, [], {}).matmul_dtype == "float32"
    assert load_settings(TargetSettings, [], {"SPECDEC_TARGET_MATMUL_DTYPE": "bfloat16"}).matmul_dtype == "bfloat16"
    assert load_settings(TargetSettings, ["--matmul-dtype", "int8"], {}).matmul_dtype == "int8"
    with pytest.raises(SystemExit):
        load_settings(TargetSettings, ["--matmul-dtype", "int4"], {})
    assert "matmul_dtype must be one of float32, bfloat16, int8, auto, got 'int4'" in capsys.readouterr().err
    for dtype in ("bfloat16", "int8"):
        with pytest.raises(SystemExit):
            load_settings(DraftSettings, ["--matmul-dtype", dtype, "--compile", "on"], {})
        assert f"matmul_dtype {dtype} runs eagerly" in capsys.readouterr().err
