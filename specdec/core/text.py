"""Tokens -> text for streaming: deltas that never take back what they sent, and stop strings.

Both run every round over a text that grows, so neither does Python-level work in proportion
to the whole text times the stop strings (400 stop strings of 5 KB once made a stream 23x slower).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

_PARTIAL = "\ufffd"  # what a decode shows for a UTF-8 character whose bytes have not all come


_HEAD = 16  # characters of a stop string searched for first: a rare match, found at C speed


class GrowingText:
    """decode(tokens) for one sample's tokens as rounds append to them (and a stop string cuts them
    back), decoding only the tokens since the text last ended on a whole character: each round's
    decode then costs what the round added, not the whole answer (at 1,200 tokens ~8 us a token
    against ~195 for decoding the whole text every round).

    For a decode that concatenates there (`concatenates`: a byte-level BPE's, whose text is the UTF-8
    of its tokens' bytes, which restarts at every whole character): decode(a + b) == decode(a) +
    decode(b) whenever decode(a) does not end in a partial character. Every call must pass the same
    growing list (or a prefix of it): what was decoded before is not looked at again.
    """

    def __init__(self, decode: Decode):
        self.decode = decode
        self.count = 0  # tokens[:count] decode to `text`, which ends on a whole character
        self.text = ""

    def __call__(self, tokens: Sequence[int]) -> str:
        if len(tokens) < self.count:  # cut back: decode afresh from the start
            self.count, self.text = 0, ""
        tail = self.decode(tokens[self.count :])
        if not tail or tail.endswith(_PARTIAL):
            return self.text + tail  # (a partial character may complete with the next tokens)
        self.count, self.text = len(tokens), self.text + tail
        return self.text


def concatenates(decode: Decode) -> bool:
    """Whether `decode` says its text concatenates (`GrowingText`); a plain function does not."""
    return bool(getattr(decode, "concatenates", False))


def held_back(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop` (0 when none).

    Reads only the last len(stop) - 1 characters: where stop's first characters occur there
    (a `find`), then each of the last few positions, where fewer than those are left.
    """
    low = max(0, len(text) - len(stop) + 1)
    head = stop[:_HEAD]
    start = text.find(head, low)
    while start != -1:
        if stop.startswith(text[start:]):
            return len(text) - start
        start = text.find(head, start + 1)
    start = text.find(head[0], max(low, len(text) - len(head) + 1))
    while start != -1:
        if head.startswith(text[start:]):
            return len(text) - start
        start = text.find(head[0], start + 1)
    return 0


class TextStream:
    """Turns a growing token list into text deltas whose concatenation is the final text.

    Holds back a trailing partial UTF-8 character and any tail that could be the
    start of a stop string, since the final text may cut it.
    """

    def __init__(self, stop: tuple[str, ...], sent: str = ""):
        self.stop = stop
        self.sent = sent  # text already delivered (a resumed stream's earlier part)

    def _safe(self, text: str) -> str:
        text = text.rstrip(_PARTIAL)
        hold = max((held_back(text, stop) for stop in self.stop), default=0)
        return text[: len(text) - hold]

    def delta(self, text: str, final: bool) -> str:
        visible = text if final else self._safe(text)
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        out = visible[len(self.sent) :]
        self.sent = visible
        return out


def _first_stop(text: str, stop: tuple[str, ...]) -> int:
    """Where the earliest stop string in `text` starts; -1 when there is none."""
    hits = [text.find(s) for s in stop]
    return min((h for h in hits if h != -1), default=-1)


def stop_point(decode: Decode, generated: Sequence[int], before: int, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """Where a stop string ends the generation: (tokens kept, text cut before the stop), or None.

    Only token counts above `before` (what earlier rounds already checked) are examined; the
    earliest count whose text holds any stop string wins. A round costs one decode and a `find`
    per stop string (C speed: with the coordinator's limits, 16 of at most 256 bytes, that is
    well under a decode); searching only the new text would need a second decode, which costs more.
    """
    if not stop or _first_stop(decode(generated), stop) == -1:
        return None
    # A stop string appeared this round: find the first token count that shows it (once per sample).
    for count in range(before + 1, len(generated) + 1):
        text = decode(generated[:count])
        at = _first_stop(text, stop)
        if at != -1:
            return count, text[:at]
    return None
