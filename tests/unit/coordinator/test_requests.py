"""coordinator.requests: what a GenerateRequest may ask for, with the settings' defaults."""

from __future__ import annotations

import pytest

from coordinator.requests import prompt_token_ids, validate_request, validate_session_id
from coordinator.settings import CoordinatorSettings
from specdec.client import build_request
from specdec.core.errors import InvalidArgument

SETTINGS = CoordinatorSettings(default_num_speculative_tokens="2", default_max_new_tokens=16, max_num_samples=4)


def test_unset_fields_take_the_settings_defaults():
    params = validate_request(build_request("hi"), SETTINGS, streaming=False)
    assert (params.max_new_tokens, params.num_speculative_tokens, params.num_samples) == (16, 2, 1)
    assert params.sampling.temperature == 1.0 and params.sampling.top_p == 1.0


def test_the_auto_default_gives_k_max_with_auto_k_and_an_explicit_k_stays_fixed():
    settings = CoordinatorSettings(max_num_speculative_tokens=6)
    assert settings.default_num_speculative_tokens == "auto"
    params = validate_request(build_request("hi"), settings, streaming=False)
    assert (params.num_speculative_tokens, params.auto_k) == (6, True)
    params = validate_request(build_request("hi", num_speculative_tokens=3), settings, streaming=False)
    assert (params.num_speculative_tokens, params.auto_k) == (3, False)
    assert validate_request(build_request("hi"), SETTINGS, False).auto_k is False
    target_only = CoordinatorSettings(default_num_speculative_tokens="auto", max_num_speculative_tokens=0)
    assert validate_request(build_request("hi"), target_only, False).auto_k is False


def test_explicit_zero_k_means_target_only():
    assert validate_request(build_request("hi", num_speculative_tokens=0), SETTINGS, False).num_speculative_tokens == 0


@pytest.mark.parametrize(
    "kwargs, streaming, message",
    [
        (dict(max_new_tokens=0), False, "max_new_tokens must be in"),
        (dict(max_new_tokens=SETTINGS.max_new_tokens_limit + 1), False, "max_new_tokens must be in"),
        (dict(num_speculative_tokens=SETTINGS.max_num_speculative_tokens + 1), False, "num_speculative_tokens"),
        (dict(num_samples=5), False, "num_samples must be in"),
        (dict(num_samples=2, session_id="0" * 32), False, "cannot continue a session"),
        (dict(num_samples=2), True, "GenerateStream serves one sample"),
        (dict(temperature=-1.0), False, "temperature"),
        (dict(top_p=0.0), False, "top_p"),
        (dict(stop=["ok", ""]), False, "stop strings must be non-empty"),
        (dict(session_id="has space"), False, "session_id"),
    ],
)
def test_out_of_range_requests_name_the_field(kwargs, streaming, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_request(build_request("hi", **kwargs), SETTINGS, streaming)


def test_prompt_and_token_ids_together_or_chat_on_ids_are_refused():
    both = build_request("hi")
    both.prompt_token_ids.append(1)
    with pytest.raises(InvalidArgument, match="not both"):
        validate_request(both, SETTINGS, False)
    with pytest.raises(InvalidArgument, match="chat applies"):
        validate_request(build_request([1, 2], chat=True), SETTINGS, False)


def test_session_ids_are_exactly_the_form_the_coordinator_issues():
    from coordinator.sessions import SessionStore

    validate_session_id(SessionStore.new_session_id())
    good = "0123456789abcdef" * 2
    validate_session_id(good)
    for bad in ("", good + ":lock", good[:-1], good + "0", good.upper(), "g" * 32, "a" * 128, "a b", "x" * 10**6):
        with pytest.raises(InvalidArgument, match="session"):
            validate_session_id(bad)


def test_token_ids_outside_the_vocabulary_are_refused_and_empty_text_is_no_tokens():
    assert prompt_token_ids(None, build_request([0, 7]), has_history=False, vocab_size=8) == [0, 7]
    with pytest.raises(InvalidArgument, match="outside"):
        prompt_token_ids(None, build_request([8]), has_history=False, vocab_size=8)
    assert prompt_token_ids(None, build_request(""), has_history=True, vocab_size=8) == []


# ---------------------------------------------------------------- limits on the size of a request

LIMITS = CoordinatorSettings(
    max_prompt_bytes=100, max_stop_strings=3, max_stop_bytes=8, max_request_tokens=1000, max_num_samples=64
)


def _refused(request, limit: str, env: str, settings=LIMITS) -> str:
    with pytest.raises(InvalidArgument) as err:
        validate_request(request, settings, streaming=False)
    message = str(err.value)
    assert limit in message and env in message and "--" + limit.replace("_", "-") in message, message
    return message


def test_a_prompt_counts_its_utf8_bytes_or_4_per_token_id_against_max_prompt_bytes():
    validate_request(build_request("x" * 100), LIMITS, False)
    validate_request(build_request("é" * 50), LIMITS, False)  # 100 bytes
    message = _refused(build_request("é" * 51), "max_prompt_bytes", "SPECDEC_COORDINATOR_MAX_PROMPT_BYTES")
    assert "102" in message and "100" in message
    validate_request(build_request([1] * 25, max_new_tokens=1), LIMITS, False)
    _refused(build_request([1] * 26, max_new_tokens=1), "max_prompt_bytes", "SPECDEC_COORDINATOR_MAX_PROMPT_BYTES")


def test_an_8_mb_prompt_is_refused_by_the_default_limit_naming_its_size():
    # validate_request takes no tokenizer: what it refuses is never tokenised.
    message = _refused(
        build_request("x" * (8 << 20)),
        "max_prompt_bytes",
        "SPECDEC_COORDINATOR_MAX_PROMPT_BYTES",
        CoordinatorSettings(),
    )
    assert str(8 << 20) in message and str(1 << 20) in message


def test_stop_strings_are_limited_in_number_and_in_bytes():
    validate_request(build_request("hi", stop=["a", "b", "c"]), LIMITS, False)
    _refused(build_request("hi", stop=["a", "b", "c", "d"]), "max_stop_strings", "SPECDEC_COORDINATOR_MAX_STOP_STRINGS")
    validate_request(build_request("hi", stop=["é" * 4]), LIMITS, False)  # 8 bytes
    _refused(build_request("hi", stop=["é" * 4 + "x"]), "max_stop_bytes", "SPECDEC_COORDINATOR_MAX_STOP_BYTES")
    _refused(build_request("hi", stop=["x" * 10**6]), "max_stop_bytes", "SPECDEC_COORDINATOR_MAX_STOP_BYTES")


def test_the_work_of_a_request_is_samples_times_context_plus_new_tokens():
    from coordinator.requests import check_request_work

    params = validate_request(build_request("hi", num_samples=10, max_new_tokens=90), LIMITS, False)
    check_request_work(params, 10, LIMITS)  # 10 x (10 + 90) = 1000
    with pytest.raises(InvalidArgument) as err:
        check_request_work(params, 11, LIMITS)
    assert "max_request_tokens" in str(err.value) and "1010" in str(err.value)
    # Token ids are context known before tokenising: checked by validate_request itself.
    _refused(
        build_request([1] * 11, num_samples=10, max_new_tokens=90),
        "max_request_tokens",
        "SPECDEC_COORDINATOR_MAX_REQUEST_TOKENS",
    )


def test_samples_and_new_tokens_name_the_settings_that_raise_them():
    _refused(build_request("hi", num_samples=65), "max_num_samples", "SPECDEC_COORDINATOR_MAX_NUM_SAMPLES")
    _refused(
        build_request("hi", max_new_tokens=LIMITS.max_new_tokens_limit + 1),
        "max_new_tokens_limit",
        "SPECDEC_COORDINATOR_MAX_NEW_TOKENS_LIMIT",
    )
