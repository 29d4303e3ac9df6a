"""Tokens -> text for streaming: deltas that never take back what they sent, and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class TextStream:
    """Turns a growing token list into text deltas whose concatenation is the final text.

    Holds back a trailing partial UTF-8 character and any tail that could be the
    start of a stop string, since the final text may cut it.
    """

    def __init__(self, stop: tuple[str, ...], sent: str = ""):
        self.stop = stop
        self.sent = sent  # text already delivered (a resumed stream's earlier part)

    def _safe(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    text = text[:-size]
                    break
        return text

    def delta(self, text: str, final: bool) -> str:
        visible = text if final else self._safe(text)
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        out = visible[len(self.sent) :]
        self.sent = visible
        return out


def stop_point(decode: Decode, generated: Sequence[int], before: int, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """Where a stop string ends the generation: (tokens kept, text cut before the stop), or None.

    Only token counts above `before` (what earlier rounds already checked) are examined; the
    earliest count whose text holds any stop string wins.
    """
    if not stop or not any(s in decode(generated) for s in stop):
        return None
    for count in range(before + 1, len(generated) + 1):
        text = decode(generated[:count])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return count, text[: min(hits)]
    return None
