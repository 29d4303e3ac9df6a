"""What K policies and model-free drafters can gain, by exact replay instead of timing.

At temperature 0 a round's outcome is a pure function of the prefix: the target's next tokens are
its greedy continuation, and a model-free drafter's proposal (ngram, suffix) is deterministic. So
one K = 0 generation per conversation, plus the drafter's proposal (up to --k-max tokens) at every
position of it, gives every round of every K policy exactly: accepted = the proposal's common
prefix with the greedy continuation, +1 token (the correction or the bonus). Only time is modelled:
a round costs the target's forward over its rows (the forward-cost curve the target service
measures at start, `ModelInfo.forward_cost_ms`) plus a fixed per-call overhead, and the policy
(`AdaptiveK`) is fed those times as it would be by the engine. The noise of a 2-core VM (+-30%,
+-0.2x per conversation in the timed bench) is absent, and --noise adds it back on purpose.

At T > 0 the same holds for these point-mass drafters, in law: a draft token x is accepted with
chance p(x), and when it is rejected the token emitted instead is drawn from p without x, so "x
accepted" is exactly "the target's own sample is x". One K = 0 generation sampled at T
(`--temperature`, --seeds of them per conversation) therefore replays every policy as one real run
at T would go: accepted = the proposal's common prefix with the sampled continuation.

Two uses:
- the ceiling: with every Verify length costing a 1-row forward (`--curve flat`), the ratio to K=0
  is the tokens per round alone; no kernel, machine or policy can beat it for that drafter;
- the policy check: with the measured curve, auto K against every fixed K and K = 0.

  python scripts/kpolicy_replay.py --record traces.json            # loads the default target (minutes)
  python scripts/kpolicy_replay.py --replay traces.json            # the tables, in a second
  python scripts/kpolicy_replay.py --replay traces.json --curve flat --noise 0.15
  python scripts/kpolicy_replay.py --record t1.json --temperature 1 --seeds 2   # sampled at T = 1

Multi-turn conversations replay their first turn only (later turns need the session's history).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.core.kpolicy import AdaptiveK, FixedK, RoundOutcome

DRAFTERS = ("ngram", "suffix")
FIXED_KS = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Costs:
    curve_s: tuple[float, ...]  # [r - 1]: seconds of a target forward over r new rows
    call_s: float = 0.001  # per Verify / Propose call: transport and the services' own work
    noise: float = 0.0  # sigma of a lognormal factor on each Verify (a busy machine)

    def verify(self, rows: int, rng: random.Random) -> float:
        curve = self.curve_s
        # Past the curve: its last step per row, continued.
        base = curve[rows - 1] if rows <= len(curve) else curve[-1] + (rows - len(curve)) * (curve[-1] - curve[-2])
        return base * (math.exp(rng.gauss(0.0, self.noise)) if self.noise else 1.0) + self.call_s


def accepted_length(proposal: Sequence[int], continuation: Sequence[int]) -> int:
    """Greedy acceptance: the proposal's common prefix with the target's own continuation."""
    n = 0
    while n < len(proposal) and n < len(continuation) and proposal[n] == continuation[n]:
        n += 1
    return n


def replay(
    generated: list[int], proposals: list[list[int]], policy, costs: Costs, rng: random.Random, prefill_s: float = 0.0
) -> float:
    """Seconds to emit `generated` under `policy`, the prompt's forward (`prefill_s`) in the first
    round as in the engine; proposals[t] is the drafter's proposal after generated[:t]."""
    t, total = 0, prefill_s
    while t < len(generated):
        k = max(0, min(policy.choose(), len(generated) - t - 1))
        proposal = proposals[t][:k]
        accepted = accepted_length(proposal, generated[t:])
        rows = len(proposal) + 1
        verify_s = costs.verify(rows, rng)
        draft_s = costs.call_s if k else 0.0  # K = 0 rounds make no Propose call
        total += verify_s + draft_s
        policy.observe(RoundOutcome(k, draft_s, verify_s, rows, [(len(proposal), accepted)]))
        t += accepted + 1
    return total


def policies(k_max: int, curve: Sequence[float]) -> list[tuple[str, Callable[[], object]]]:
    made: list[tuple[str, Callable[[], object]]] = [("K=0", lambda: FixedK(0))]
    made += [(f"K={k}", lambda k=k: FixedK(k)) for k in FIXED_KS if k <= k_max]
    made.append(("auto", lambda: AdaptiveK(k_max, verify_curve=curve)))
    return made


def ratios(
    trace: dict, drafter: str, costs: Costs, k_max: int, repeats: int, prefill: bool = True
) -> dict[str, dict[str, list[float]]]:
    """{workload: {policy: [time(K=0) / time(policy) per conversation]}}, means over `repeats` noise
    draws; `prefill`: the request's time includes the prompt's forward (what one request sees)."""
    out: dict[str, dict[str, list[float]]] = {}
    made = policies(k_max, costs.curve_s)
    for conversation in trace["conversations"]:
        generated, proposals = conversation["generated"], conversation["proposals"][drafter]
        prefill_s = conversation["prefill_ms"] / 1000 if prefill else 0.0
        times = {
            name: sum(replay(generated, proposals, make(), costs, random.Random(r), prefill_s) for r in range(repeats))
            for name, make in made
        }
        for name, seconds in times.items():
            out.setdefault(conversation["workload"], {}).setdefault(name, []).append(times["K=0"] / seconds)
    return out


def table(trace: dict, costs: Costs, k_max: int, repeats: int, prefill: bool = True) -> list[dict]:
    rows = []
    for drafter in DRAFTERS:
        for workload, by_policy in ratios(trace, drafter, costs, k_max, repeats, prefill).items():
            row = {"drafter": drafter, "workload": workload, "conversations": len(by_policy["K=0"])}
            row |= {name: round(sum(v) / len(v), 3) for name, v in by_policy.items()}
            row["auto_min"] = round(min(by_policy["auto"]), 3)
            rows.append(row)
    return rows


def print_table(rows: list[dict], curve_ms: Sequence[float]) -> None:
    print("forward ms by rows:", [round(c, 1) for c in curve_ms])
    names = [key for key in rows[0] if key.startswith("K=") or key == "auto"]
    print("drafter  workload         " + " ".join(n.rjust(6) for n in names) + "  auto(min)")
    for row in rows:
        cells = " ".join(f"{row[n]:6.2f}" for n in names)
        print(f"{row['drafter']:<8} {row['workload']:<16} {cells}  {row['auto_min']:.2f}")


def record(path: Path, per_workload: int, max_new_tokens: int, k_max: int, temperature: float, seeds: int) -> None:
    """K = 0 generations of the workloads' first turns with the default target (greedy, or sampled
    at `temperature` with seeds 0..seeds-1), and each drafter's proposal at every position (the
    drafters as the draft service builds them)."""
    from workloads import build_workloads

    from coordinator.requests import chat_turn_text
    from draft_service.loading import load_draft
    from draft_service.settings import DraftSettings
    from specdec.inprocess import InProcessPipeline
    from specdec.models.sources import DEFAULT_MODEL
    from specdec.settings import load_settings

    pipeline = InProcessPipeline(draft=None)
    tokenizer = pipeline.tokenizer
    drafters = {
        name: load_draft(load_settings(DraftSettings, [], {}, model=name, tokenizer=DEFAULT_MODEL), tokenizer).drafter
        for name in DRAFTERS
    }
    trace = {
        "forward_cost_ms": list(pipeline.target.info.forward_cost_ms),
        "k_max": k_max,
        "temperature": temperature,
        "conversations": [],
    }
    for conversation in build_workloads(per_workload=per_workload):
        prompt = tokenizer(chat_turn_text(tokenizer, conversation.prompt, False), add_special_tokens=False)
        ids = prompt["input_ids"]
        prefill_ms = _prefill_ms(pipeline.target.runner, ids)
        for seed in range(seeds if temperature > 0 else 1):
            response = pipeline.generate(
                ids, temperature=temperature, seed=seed, num_speculative_tokens=0, max_new_tokens=max_new_tokens
            )
            generated = list(response.completions[0].token_ids)
            name = conversation.name if temperature == 0 else f"{conversation.name}#{seed}"
            trace["conversations"].append(
                {
                    "workload": conversation.workload,
                    "name": name,
                    "prefill_ms": prefill_ms,
                    "generated": generated,
                    # One cache key for all seeds: the suffix draft's window of that key restarts at the
                    # prompt, so no seed's proposals read another seed's continuation.
                    "proposals": {
                        drafter_name: proposals(drafter, conversation.name, ids, generated, k_max)
                        for drafter_name, drafter in drafters.items()
                    },
                }
            )
            print(f"recorded {conversation.workload} {name}: {len(generated)} tokens", file=sys.stderr)
    path.write_text(json.dumps(trace))


def proposals(drafter, key: str, ids: list[int], generated: list[int], k_max: int) -> list[list[int]]:
    """The drafter's proposal (up to k_max tokens) after each prefix ids + generated[:t]."""
    from specdec.core.protocols import NO_DEADLINE, DraftRequest
    from specdec.core.sampling import Sampling

    def at(t: int) -> list[int]:
        (drafted,) = drafter.propose([DraftRequest(key, ids + generated[:t], k_max, 0)], Sampling(0.0), NO_DEADLINE)
        return list(drafted.draft_token_ids)

    return [at(t) for t in range(len(generated))]


def _prefill_ms(runner, ids: list[int]) -> float:
    """Best of two uncached forwards over the prompt, in ms."""
    import time

    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        runner.on_model_thread(runner.last_logits, "", ids, 1)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, help="record traces with the default target into this file")
    parser.add_argument("--replay", type=Path, help="replay the traces in this file")
    parser.add_argument("--per-workload", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="record: sample at this temperature")
    parser.add_argument("--seeds", type=int, default=2, help="record at T > 0: sampled generations per conversation")
    parser.add_argument("--curve", default="measured", help="measured (the trace's), flat, or comma ms by rows")
    parser.add_argument("--call-ms", type=float, default=1.0, help="per-call overhead")
    parser.add_argument("--noise", type=float, default=0.0, help="lognormal sigma on each Verify")
    parser.add_argument("--repeats", type=int, default=5, help="noise draws per conversation")
    parser.add_argument("--decode-only", action="store_true", help="leave the prompt's forward out of every time")
    parser.add_argument("--json", action="store_true", help="one object per row")
    args = parser.parse_args(argv)
    if args.record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from specdec.models.openmp_env import set_openmp_defaults

        set_openmp_defaults()  # before torch loads, as the services do: the trace's curve is theirs
        record(args.record, args.per_workload, args.max_new_tokens, args.k_max, args.temperature, args.seeds)
    if not args.replay:
        return 0
    trace = json.loads(args.replay.read_text())
    measured = trace["forward_cost_ms"]
    curve_ms = {"measured": measured, "flat": [measured[0]] * len(measured)}.get(args.curve)
    if curve_ms is None:
        curve_ms = [float(v) for v in args.curve.split(",")]
    costs = Costs(tuple(c / 1000 for c in curve_ms), args.call_ms / 1000, args.noise)
    repeats = args.repeats if args.noise else 1
    rows = table(trace, costs, min(args.k_max, trace["k_max"]), repeats, prefill=not args.decode_only)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows, curve_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
