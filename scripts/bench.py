"""End-to-end throughput through the running services: target only (K = 0) vs speculative K = 1..4.

  python scripts/bench.py                      start the stack (target + shipped draft), bench, stop it
  python scripts/bench.py --address HOST:PORT  bench a stack that is already up

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import stack  # noqa: E402 - scripts/stack.py: up() / down() and the pair `make run` serves

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


def bench(address: str, ks: list[int], prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
          repeats: int) -> dict:
    from specdec.client import SpecdecClient

    totals = {k: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "rounds": 0, "draft_s": 0.0, "verify_s": 0.0} for k in ks}
    with SpecdecClient(address, timeout_s=900) as client:
        client.wait_ready(60)
        client.generate(prompts[0], chat=True, max_new_tokens=8, temperature=temperature, seed=seed,
                        num_speculative_tokens=max(ks))  # warm-up: first calls allocate
        for rep in range(repeats):
            for i, prompt in enumerate(prompts):
                for k in ks:
                    started = time.perf_counter()
                    response = client.generate(
                        prompt, chat=True, max_new_tokens=max_new_tokens, temperature=temperature,
                        seed=seed + 1000 * rep + i, num_speculative_tokens=k, ignore_eos=True,
                    )
                    elapsed = time.perf_counter() - started
                    stats = response.stats
                    row = totals[k]
                    row["tokens"] += stats.generated_tokens
                    row["seconds"] += elapsed
                    row["drafted"] += stats.drafted_tokens
                    row["accepted"] += stats.accepted_tokens
                    row["rounds"] += stats.rounds
                    row["draft_s"] += stats.draft_time_s
                    row["verify_s"] += stats.verify_time_s
                    print(f"  rep {rep} prompt {i} K={k}: {stats.generated_tokens / elapsed:6.2f} tok/s "
                          f"(acceptance {stats.acceptance_rate:.3f})", flush=True)
    base = totals[ks[0]]["tokens"] / totals[ks[0]]["seconds"] if 0 in ks else None
    rows = []
    for k in ks:
        t = totals[k]
        tps = t["tokens"] / t["seconds"]
        rows.append({
            "k": k,
            "tokens_per_s": tps,
            "speedup_vs_k0": tps / base if base else None,
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
            "tokens_per_round": t["tokens"] / t["rounds"] if t["rounds"] else None,
            "tokens": t["tokens"],
            "seconds": t["seconds"],
            # Per round, as the coordinator saw it: Propose and Verify calls (model time + gRPC),
            # and everything else (accept/reject, Redis, tokenizer, client round trip).
            "draft_ms_per_round": 1e3 * t["draft_s"] / t["rounds"] if t["rounds"] else None,
            "verify_ms_per_round": 1e3 * t["verify_s"] / t["rounds"] if t["rounds"] else None,
            "other_ms_per_round": 1e3 * (t["seconds"] - t["draft_s"] - t["verify_s"]) / t["rounds"]
            if t["rounds"] else None,
        })
    return {"address": address, "temperature": temperature, "max_new_tokens": max_new_tokens,
            "prompts": prompts, "repeats": repeats, "rows": rows}


def format_table(result: dict) -> str:
    lines = ["  K   tokens/s   vs K=0   acceptance   tokens/round   ms/round: draft  verify  other"]
    for r in result["rows"]:
        speed = f"{r['speedup_vs_k0']:.2f}x" if r["speedup_vs_k0"] else "-"
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        split = (f"{r['draft_ms_per_round']:>16.1f} {r['verify_ms_per_round']:>7.1f} {r['other_ms_per_round']:>6.1f}"
                 if r["draft_ms_per_round"] is not None else "")
        lines.append(f"  {r['k']:<3} {r['tokens_per_s']:>8.2f}   {speed:>6}   {acc:>10}   {tpr:>12}{split}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="bench this coordinator instead of starting the stack")
    parser.add_argument("--target", default=os.environ.get("SPECDEC_TARGET_MODEL", stack.DEFAULT_TARGET))
    parser.add_argument("--draft", default=os.environ.get("SPECDEC_DRAFT_MODEL", str(stack.DEFAULT_DRAFT)))
    parser.add_argument("--ks", default="0,1,2,3,4", help="comma-separated K values (0 = target only)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompt-set", default="long", choices=sorted(PROMPT_SETS))
    parser.add_argument("--prompts", type=int, default=4, help="how many prompts of the set")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    prompts = PROMPT_SETS[args.prompt_set][: args.prompts]

    address = args.address
    started = address is None
    if started:
        os.environ["SPECDEC_TARGET_MODEL"] = args.target
        os.environ["SPECDEC_DRAFT_MODEL"] = args.draft
        print(f"starting the stack: target {args.target}, draft {args.draft}")
        address = stack.up()["coordinator"]
    try:
        result = bench(address, ks, prompts, args.max_new_tokens, args.temperature, args.seed, args.repeats)
    finally:
        if started:
            stack.down()
    result.update({"target": args.target, "draft": args.draft if started else None})
    print(f"\n{len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} tokens each, "
          f"temperature {args.temperature:g}, chat template\n")
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
