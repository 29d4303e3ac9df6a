"""Chat turns with the packaged SmolLM2 tokenizer: follow-ups do not repeat the system prompt."""

import pytest

from coordinator.requests import chat_turn_text


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specdec.models.sources import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def test_first_turn_is_the_whole_template(smollm2_tokenizer):
    text = chat_turn_text(smollm2_tokenizer, "Hi there", continuing=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi there<|im_end|>" in text


def test_follow_up_turn_has_no_second_system_prompt(smollm2_tokenizer):
    text = chat_turn_text(smollm2_tokenizer, "And then?", continuing=True)
    assert text == "<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
