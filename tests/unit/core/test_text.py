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
