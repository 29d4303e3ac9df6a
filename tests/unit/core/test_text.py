from specdec.core.text import TextStream


def test_deltas_concatenate_to_final_text_and_hold_back_stop_prefixes():
    stream = TextStream(stop=("END",))
    pieces = [
        stream.delta("Hello wor", False),
        stream.delta("Hello world E", False),
        stream.delta("Hello world EN", False),
    ]
    assert pieces[1] == "ld " and pieces[2] == ""  # "E"/"EN" could start "END"
    pieces.append(stream.delta("Hello world ", True))  # final text cut at the stop string
    assert "".join(pieces) == "Hello world "


def test_incomplete_utf8_is_held_back():
    stream = TextStream(stop=())
    assert stream.delta("caf\ufffd", False) == "caf"
    assert stream.delta("café", True) == "é"


def _letters(ids) -> str:
    return "".join("abcdefgh"[i] for i in ids)


def test_stop_point_is_the_earliest_token_count_whose_text_holds_a_stop():
    from specdec.core.text import stop_point

    assert stop_point(_letters, [0, 1, 2, 1, 2], 0, ("bc",)) == (3, "a")
    assert stop_point(_letters, [0, 1, 2, 1, 2], 0, ("cb", "bc")) == (3, "a")
    assert stop_point(_letters, [0, 1, 2], 0, ("x",)) is None
    assert stop_point(_letters, [0, 1, 2], 0, ()) is None


def test_deadline_gives_the_smaller_of_cap_and_time_left_then_raises():
    import time

    import pytest

    from specdec.core.errors import DeadlineExceeded
    from specdec.core.protocols import NO_DEADLINE, Deadline

    assert NO_DEADLINE.timeout(5.0) == 5.0
    assert 0 < Deadline(time.monotonic() + 1.0).timeout(5.0) <= 1.0
    with pytest.raises(DeadlineExceeded):
        Deadline(time.monotonic() - 0.1).check()


# ---------------------------------------------------------------- stop strings, searched in the new text only


def _reference_stop_point(decode, generated, before, stop):
    """The definition: the earliest token count above `before` whose whole text holds a stop."""
    for count in range(before + 1, len(generated) + 1):
        text = decode(generated[:count])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return count, text[: min(hits)]
    return None


def _utf8_bytes(ids) -> str:
    """Tokens are bytes: a character split across tokens decodes to U+FFFD until its last byte comes."""
    return bytes(ids).decode("utf-8", "replace")


def test_stop_point_agrees_with_its_definition_round_by_round():
    import random

    from specdec.core.text import stop_point

    rng = random.Random(0)
    alphabet = "abé"
    for _ in range(400):
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        generated: list[int] = []
        found = None
        while found is None and len(generated) < 40:
            before = len(generated)
            generated += list("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))).encode())
            found = stop_point(_utf8_bytes, generated, before, stops)
            assert found == _reference_stop_point(_utf8_bytes, generated, before, stops), (stops, generated)


def test_held_back_is_the_longest_tail_that_starts_a_stop():
    import random

    from specdec.core.text import held_back

    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 60)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        expected = max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        assert held_back(text, stop) == expected, (text, stop)


def test_a_stream_holds_back_the_longest_tail_any_stop_could_start():
    stream = TextStream(stop=("xyz", "yzzz"))
    assert stream.delta("abxyzz", False) == "abx"  # "yzz" could start "yzzz"
    assert stream.delta("abxyzzqx", False) == "yzzq"  # "x" could start "xyz"


def test_growing_text_is_the_whole_decode_every_round():
    """Rounds append a few byte tokens (characters split across rounds, stray bytes that never make
    one, U+FFFD itself) and now and then a stop string cuts a few back: the text decoded a round at a
    time is the whole list's decode every time."""
    import random

    from specdec.core.text import GrowingText

    rng = random.Random(1)
    pieces = [b"a", b" ", "é".encode(), "€".encode(), "😀".encode(), b"\xff", b"\x80", "\ufffd".encode()]
    for _ in range(300):
        grown = GrowingText(_utf8_bytes)
        tokens: list[int] = []
        for _ in range(12):
            tokens += list(b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 3))))
            if rng.random() < 0.2:
                del tokens[len(tokens) - rng.randint(0, 3) :]
            assert grown(tokens) == _utf8_bytes(tokens), tokens
            assert grown(tokens[: grown.count]) == _utf8_bytes(tokens[: grown.count])  # a prefix of the list


def test_growing_text_decodes_only_what_is_new():
    from specdec.core.text import GrowingText

    seen: list[int] = []
    grown = GrowingText(lambda ids: (seen.append(len(ids)), _utf8_bytes(ids))[1])
    tokens = list(b"abc")
    grown(tokens)
    tokens += list("é".encode())[:1]  # half a character: decoded again with the next round
    grown(tokens)
    tokens += list("é".encode())[1:] + list(b"d")
    assert grown(tokens) == "abcéd" and seen == [3, 1, 3]
