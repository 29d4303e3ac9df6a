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
        (dict(num_samples=2, session_id="abc"), False, "cannot continue a session"),
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


def test_session_ids_are_short_printable_and_spaceless():
    validate_session_id("a" * 128)
    for bad in ("", "a" * 129, "a\tb", "a\x00b"):
        with pytest.raises(InvalidArgument):
            validate_session_id(bad)


def test_token_ids_outside_the_vocabulary_are_refused_and_empty_text_is_no_tokens():
    assert prompt_token_ids(None, build_request([0, 7]), has_history=False, vocab_size=8) == [0, 7]
    with pytest.raises(InvalidArgument, match="outside"):
        prompt_token_ids(None, build_request([8]), has_history=False, vocab_size=8)
    assert prompt_token_ids(None, build_request(""), has_history=True, vocab_size=8) == []
