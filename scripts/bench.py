"""End-to-end throughput: target only (K = 0) vs speculative K = 1..4, through the running
services (grpc mode) and with the same engine and models in this process (in-process mode).

  python scripts/bench.py                      start the stack (target + shipped draft), bench both modes, stop it
  python scripts/bench.py --address HOST:PORT  bench a stack that is already up (and the in-process mode)
  python scripts/bench.py --in-process         the in-process mode only: no servers, no Redis

The two modes run the same requests interleaved; their ratio is the distributed pipeline's own
cost (gRPC, serialisation, Redis), reported per round.

Every request uses the chat template, temperature 1, a fixed seed and ignore_eos (so every K
generates the same number of tokens). K values are interleaved per prompt and repeat, so a
background load drifting over time hits all K alike. tokens/s is generated tokens / client-side
wall time, summed over prompts and repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import stack

from specdec.models.openmp_env import set_openmp_defaults

# "long" (the default): questions whose answers run past the default 64 tokens, so the timed
# tokens are the answer itself. "short": answers that end early; with ignore_eos the rest of
# the 64 tokens is text after the end-of-turn token, which no user is served and no draft is
# trained for (acceptance there is much lower).
PROMPT_SETS = {
    "long": [
        "Explain how a refrigerator keeps food cold, step by step.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Give me five tips for learning a new language, with a sentence on each.",
        "What is the difference between a list and a tuple in Python? Explain with examples.",
    ],
    "short": [
        "Explain in two sentences why the sky is blue.",
        "Write a short poem about the sea.",
        "Give me three tips for learning a new language.",
        "What is the difference between a list and a tuple in Python?",
    ],
}


MODES = ("grpc", "in-process")


def _generate_fn(mode: str, address: str | None, target: str, draft: str, stack_exit):
    """mode -> generate(prompt, **kwargs) -> GenerateResponse, on the running stack or in this process."""
    if mode == "grpc":
        from specdec.client import SpecdecClient

        client = stack_exit.enter_context(SpecdecClient(address, timeout_s=900))
        client.wait_ready(60)
        return client.generate
    from specdec.inprocess import InProcessPipeline

    return InProcessPipeline(target, draft).generate


def _add(row: dict, stats, elapsed: float) -> None:
    row["tokens"] += stats.generated_tokens
    row["seconds"] += elapsed
    row["drafted"] += stats.drafted_tokens
    row["accepted"] += stats.accepted_tokens
    row["rounds"] += stats.rounds
    row["draft_s"] += stats.draft_time_s
    row["verify_s"] += stats.verify_time_s


def bench(generators: dict, ks: list[int], prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
          repeats: int) -> dict:
    """Every (mode, K) on every prompt and repeat, interleaved, so drift hits all alike."""
    totals = {(m, k): {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "rounds": 0, "draft_s": 0.0,
                       "verify_s": 0.0} for m in generators for k in ks}
    for generate in generators.values():  # warm-up: first calls allocate
        generate(prompts[0], chat=True, max_new_tokens=8, temperature=temperature, seed=seed,
                 num_speculative_tokens=max(k for k in ks if k != "auto") if ks != ["auto"] else None)
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            for k in ks:
                for mode, generate in generators.items():
                    started = time.perf_counter()
                    response = generate(
                        prompt, chat=True, max_new_tokens=max_new_tokens, temperature=temperature,
                        seed=seed + 1000 * rep + i, num_speculative_tokens=None if k == "auto" else k,
                        ignore_eos=True,
                    )
                    elapsed = time.perf_counter() - started
                    _add(totals[(mode, k)], response.stats, elapsed)
                    print(f"  rep {rep} prompt {i} K={k} {mode:>10}: {response.stats.generated_tokens / elapsed:6.2f}"
                          f" tok/s (acceptance {response.stats.acceptance_rate:.3f})", flush=True)
    rows = [_row(mode, k, totals) for mode in generators for k in ks]
    return {"temperature": temperature, "max_new_tokens": max_new_tokens, "prompts": prompts, "repeats": repeats,
            "rows": rows, "pipeline_overhead": _overhead(totals, ks) if len(generators) == 2 else []}


def _row(mode: str, k: int, totals: dict) -> dict:
    t = totals[(mode, k)]
    tps = t["tokens"] / t["seconds"]
    base = totals.get((mode, 0))
    per_round = (lambda seconds: 1e3 * seconds / t["rounds"]) if t["rounds"] else (lambda seconds: None)
    return {
        "mode": mode,
        "k": k,
        "tokens_per_s": tps,
        "speedup_vs_k0": tps / (base["tokens"] / base["seconds"]) if base else None,
        "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
        "tokens_per_round": t["tokens"] / t["rounds"] if t["rounds"] else None,
        "tokens": t["tokens"],
        "seconds": t["seconds"],
        # Per round, as the engine saw it: Propose and Verify calls (model time, plus gRPC in the
        # grpc mode), and everything else (accept/reject, Redis, tokenizer, client round trip).
        "draft_ms_per_round": per_round(t["draft_s"]),
        "verify_ms_per_round": per_round(t["verify_s"]),
        "other_ms_per_round": per_round(t["seconds"] - t["draft_s"] - t["verify_s"]),
    }


def _overhead(totals: dict, ks: list[int]) -> list[dict]:
    """What the distributed pipeline costs over the same engine in one process, per K."""
    out = []
    for k in ks:
        grpc_t, local_t = totals[("grpc", k)], totals[("in-process", k)]
        out.append({
            "k": k,
            "in_process_vs_grpc": (local_t["tokens"] / local_t["seconds"]) / (grpc_t["tokens"] / grpc_t["seconds"]),
            "ms_per_round": 1e3 * (grpc_t["seconds"] - local_t["seconds"]) / grpc_t["rounds"],
        })
    return out


def format_table(result: dict) -> str:
    lines = ["  mode         K   tokens/s   vs K=0   acceptance   tokens/round   ms/round: draft  verify  other"]
    for r in result["rows"]:
        speed = f"{r['speedup_vs_k0']:.2f}x" if r["speedup_vs_k0"] else "-"
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        split = (f"{r['draft_ms_per_round']:>16.1f} {r['verify_ms_per_round']:>7.1f} {r['other_ms_per_round']:>6.1f}"
                 if r["draft_ms_per_round"] is not None else "")
        lines.append(f"  {r['mode']:<10}   {r['k']!s:<4} {r['tokens_per_s']:>8.2f}   {speed:>6}   {acc:>10}   "
                     f"{tpr:>12}{split}")
    if result["pipeline_overhead"]:
        lines.append("\n  distributed pipeline's own cost (grpc vs in-process, same prompts and seeds):")
        for o in result["pipeline_overhead"]:
            lines.append(f"  K={o['k']!s:<4} in-process is {o['in_process_vs_grpc']:.2f}x the grpc mode's tokens/s; "
                         f"{o['ms_per_round']:+.1f} ms per round")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="bench this coordinator instead of starting the stack")
    parser.add_argument("--target", default=os.environ.get("SPECDEC_TARGET_MODEL", stack.DEFAULT_TARGET))
    parser.add_argument("--draft", default=os.environ.get("SPECDEC_DRAFT_MODEL", str(stack.DEFAULT_DRAFT)))
    parser.add_argument("--ks", default="0,1,2,3,4",
                        help="comma-separated K values (0 = target only; auto = the coordinator's adaptive K)")
    parser.add_argument("--modes", default=",".join(MODES), help="grpc (the running stack), in-process, or both")
    parser.add_argument("--in-process", action="store_true", help="only the in-process mode (same as --modes in-process)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompt-set", default="long", choices=sorted(PROMPT_SETS))
    parser.add_argument("--prompts", type=int, default=4, help="how many prompts of the set")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    ks = [k.strip() if k.strip() == "auto" else int(k) for k in args.ks.split(",")]
    modes = ["in-process"] if args.in_process else [m.strip() for m in args.modes.split(",")]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    prompts = PROMPT_SETS[args.prompt_set][: args.prompts]
    set_openmp_defaults()  # the in-process mode loads torch here, as the services do at start

    address = args.address
    started = address is None and "grpc" in modes
    if started:
        os.environ["SPECDEC_TARGET_MODEL"] = args.target
        os.environ["SPECDEC_DRAFT_MODEL"] = args.draft
        print(f"starting the stack: target {args.target}, draft {args.draft}")
        address = stack.up()["coordinator"]
    try:
        with ExitStack() as exits:
            generators = {m: _generate_fn(m, address, args.target, args.draft, exits) for m in modes}
            result = bench(generators, ks, prompts, args.max_new_tokens, args.temperature, args.seed, args.repeats)
    finally:
        if started:
            stack.down()
    result.update({"address": address, "target": args.target, "draft": args.draft})
    print(f"\n{len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} tokens each, "
          f"temperature {args.temperature:g}, chat template\n")
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
