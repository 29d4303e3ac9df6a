"""Does speculation pay on this prompt? One request with speculation, then with the target alone.

`specdec compare` (and `make run`'s second demo) streams one prompt twice through a coordinator
(or the pipeline loaded in process, `--in-process`), with the same seed and sampling: at the
requested K (unset: the coordinator's default, auto K), then at K = 0. Each run's speed is its
decode speed: the tokens after the first chunk over the time from the first chunk to the last. The
first round is left out because it holds the prompt's forward, and the target keeps a prompt's KV
cache for the next request that opens alike, so whichever run came second would skip it.
Speculation runs first: a suffix draft learns from the answers its pod served, and must not copy
the K = 0 run's.

At T = 0 both runs emit the target's greedy tokens, but float rounding differs between a 1-row
forward and a multi-row Verify, so a near-tie can go either way: the report says where the two
first differ, if they do. The two sessions a coordinator made are deleted afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from specdec.core.tokens import common_prefix_length


class ChunkSource(Protocol):
    """A SpecdecClient or an InProcessPipeline: what streams a generation's GenerateChunks."""

    def stream(self, prompt: str, **kwargs) -> Iterator: ...


@dataclass(frozen=True)
class TimedRun:
    token_ids: list[int]
    first_chunk_tokens: int
    decode_s: float  # from the first chunk with tokens to the last
    stats: object  # GenerationStats of the final chunk

    @property
    def decode_tokens_per_s(self) -> float:
        later = len(self.token_ids) - self.first_chunk_tokens
        return later / self.decode_s if later and self.decode_s > 0 else 0.0


def timed_stream(client: ChunkSource, prompt: str, **kwargs) -> TimedRun:
    """Streams one generation, timing each chunk's arrival; deletes the session it made (a
    coordinator's; the in-process pipeline makes none)."""
    tokens: list[int] = []
    first_tokens, first_at, last_at = 0, 0.0, 0.0
    last = None
    for chunk in client.stream(prompt, **kwargs):
        now = time.perf_counter()
        if chunk.token_ids:
            if not tokens:
                first_tokens, first_at = len(chunk.token_ids), now
            tokens.extend(chunk.token_ids)
            last_at = now
        last = chunk
    if last is not None and last.session_id:
        client.delete_session(last.session_id)
    return TimedRun(tokens, first_tokens, last_at - first_at, last.stats if last is not None else None)


def compare(client: ChunkSource, prompt: str, k: int | None = None, **kwargs) -> tuple[TimedRun, TimedRun]:
    """(the run at K = k, None: the coordinator's default; the run at K = 0), in that order."""
    speculative = timed_stream(client, prompt, num_speculative_tokens=k, **kwargs)
    alone = timed_stream(client, prompt, num_speculative_tokens=0, **kwargs)
    return speculative, alone


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two differ (a length counts), None when equal."""
    return None if a == b else common_prefix_length(a, b)


def format_comparison(speculative: TimedRun, alone: TimedRun, k: int | None, greedy: bool) -> str:
    label = "speculation, auto K" if k is None else f"speculation, K = {k}"
    lines = [f"{'':<22}{'decode tok/s':>13}{'tokens/round':>14}{'acceptance':>12}{'tokens':>8}"]
    for name, run in ((label, speculative), ("target alone, K = 0", alone)):
        acceptance = f"{run.stats.acceptance_rate:.2f}" if run.stats.drafted_tokens else "-"
        lines.append(
            f"{name:<22}{run.decode_tokens_per_s:>13.2f}{run.stats.mean_tokens_per_round:>14.2f}"
            f"{acceptance:>12}{len(run.token_ids):>8}"
        )
    if speculative.decode_tokens_per_s and alone.decode_tokens_per_s:
        summary = f"{speculative.decode_tokens_per_s / alone.decode_tokens_per_s:.2f}x the target alone"
    else:  # all in the first chunk (an early EOS or stop, or a tiny --max-new-tokens): nothing to time
        summary = "no decode speed to compare: a run ended in its first round (raise --max-new-tokens)"
    if greedy:
        differs = first_difference(speculative.token_ids, alone.token_ids)
        summary += (
            "; the same tokens"
            if differs is None
            else f"; the tokens part at token {differs} (at T = 0 only a near-tie tipped by float rounding should)"
        )
    return "\n".join([*lines, summary])
