"""coordinator.requests: a GenerateRequest carrying a whole chat conversation (`messages`)."""

from __future__ import annotations

import pytest
from tiny_models import save_tokenizer

from coordinator.requests import prompt_token_ids, validate_request
from coordinator.settings import CoordinatorSettings
from specdec.core.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import coordinator_pb2

SETTINGS = CoordinatorSettings(max_prompt_bytes=100)
# Roles as words of the tiny vocabulary, so a rendered conversation tokenises to known ids.
TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'e', 'user': 'f', 'assistant': 'g'}[m['role']] }} {{ m['content'] }} "
    "{% if m['content'] == 'd' %}{{ raise_exception('no d here') }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}g {% endif %}"
)


def conversation(*pairs, **fields) -> coordinator_pb2.GenerateRequest:
    messages = [coordinator_pb2.ChatMessage(role=r, content=c) for r, c in pairs]
    return coordinator_pb2.GenerateRequest(messages=messages, **fields)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("chat-tokenizer")
    save_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    tok.chat_template = TEMPLATE
    return tok


def test_a_conversation_renders_through_the_template_with_the_generation_prompt(tokenizer):
    request = conversation(("system", "a"), ("user", "b c"), ("assistant", "e"), ("user", "f"))
    validate_request(request, SETTINGS, streaming=True)
    # e a | f b c | g e | f f | g: each turn, then the assistant's generation prompt; no BOS added.
    assert prompt_token_ids(tokenizer, request, has_history=False, vocab_size=8) == [5, 1, 6, 2, 3, 7, 5, 6, 6, 7]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "a"}, "without prompt, prompt_token_ids or chat"),
        ({"prompt_token_ids": [1]}, "without prompt, prompt_token_ids or chat"),
        ({"chat": True}, "without prompt, prompt_token_ids or chat"),
        ({"session_id": "0" * 32}, "new conversation"),
    ],
)
def test_messages_exclude_other_prompts_and_sessions(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_request(conversation(("user", "a"), **fields), SETTINGS, streaming=False)


@pytest.mark.parametrize("role", ["tool", "", "User", "x" * 90])
def test_unknown_roles_are_refused_and_not_echoed_whole(role):
    with pytest.raises(InvalidArgument, match=r"messages\[1\]\.role must be one of system, user, assistant") as err:
        validate_request(conversation(("user", "a"), (role, "b")), SETTINGS, streaming=False)
    assert len(str(err.value)) < 200


def test_messages_count_their_utf8_bytes_against_max_prompt_bytes():
    validate_request(conversation(("user", "é" * 48)), SETTINGS, False)  # 4 + 96 bytes
    with pytest.raises(InvalidArgument, match="max_prompt_bytes") as err:
        validate_request(conversation(("user", "é" * 40), ("assistant", "x" * 12)), SETTINGS, False)
    assert "105" in str(err.value)
    with pytest.raises(InvalidArgument, match="max_prompt_bytes"):  # many small messages add up
        validate_request(conversation(*[("user", "")] * 26), SETTINGS, False)


def test_a_template_that_refuses_the_messages_is_invalid_argument(tokenizer):
    with pytest.raises(InvalidArgument, match="the chat template refused the messages: no d here"):
        prompt_token_ids(tokenizer, conversation(("user", "d")), has_history=False, vocab_size=8)


def test_a_tokenizer_without_a_chat_template_is_a_failed_precondition(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    plain = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FailedPrecondition, match="no chat template"):
        prompt_token_ids(plain, conversation(("user", "a")), has_history=False, vocab_size=8)
