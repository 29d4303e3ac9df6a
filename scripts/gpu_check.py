"""GPU check of the static-cache, compiled path (issue 13): does speculation pay on this GPU?

Builds random-init models of Qwen2.5-0.5B and Qwen2.5-7B shapes from configs (bfloat16 on CUDA,
nothing downloaded) and measures, through the services' own runners:
1. target-only decode, ms per token: eager `ModelRunner` against the `StaticModelRunner` that
   `make_runner` selects on CUDA (static KV cache, torch.compile mode="reduce-overhead");
2. the draft/target cost ratio c = draft ms / target ms per decode step, for both paths;
3. a Verify's cost by rows (K + 1 new tokens after the prompt), and a batched static step of
   1 and --batch (8) sessions decoding a token each (the serving engine's step under load);
4. K=0 against K=4 end to end: the speculative engine (`SpeculativeEngine` with the in-process
   `LocalDrafter` / `LocalVerifier`, the loop `specdec.inprocess` runs, without its tokenizer),
   temperature 1, on the static runners. Random weights give near-uniform laws, so the acceptance
   is what two such laws give, not a trained pair's: the table shows the measured acceptance and
   the speedup the measured costs predict at other acceptance rates.

Run it as `scripts/gpu_check.sh` (one command, a total timeout). Without CUDA it exits with code 2
and says so; `--dry-run` runs the same steps on the CPU with tiny shapes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NO_GPU_EXIT = 2


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool


# Qwen2.5-0.5B / -7B (config.json of the released checkpoints); the weights are random.
SHAPES = {
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 151936, tie_embeddings=True),
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 151936, tie_embeddings=False),
}
DRY_RUN_SHAPES = {
    "tiny-draft": Shape(64, 2, 4, 2, 128, 512, tie_embeddings=True),
    "tiny-target": Shape(128, 3, 4, 2, 256, 512, tie_embeddings=False),
}


def qwen2_config(shape: Shape):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=32768,
        tie_word_embeddings=shape.tie_embeddings,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, backend aot_eager: a smoke test")
    parser.add_argument("--draft", default=None, help="draft shape (default qwen2.5-0.5b; dry run: tiny-draft)")
    parser.add_argument("--target", default=None, help="target shape (default qwen2.5-7b; dry run: tiny-target)")
    parser.add_argument("--tokens", type=int, default=64, help="timed decode steps per measurement")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens before the timed steps")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round in the end-to-end run")
    parser.add_argument("--e2e-tokens", type=int, default=128, help="tokens generated per end-to-end run")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats of each timing (best kept)")
    parser.add_argument("--batch", type=int, default=8, help="sessions in the batched static step timed (1-16)")
    parser.add_argument("--skip-eager", action="store_true", help="skip the eager runner's timings")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end K=0 / K=4 runs")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    shapes = DRY_RUN_SHAPES if args.dry_run else SHAPES
    args.draft = args.draft or ("tiny-draft" if args.dry_run else "qwen2.5-0.5b")
    args.target = args.target or ("tiny-target" if args.dry_run else "qwen2.5-7b")
    for name in (args.draft, args.target):
        if name not in shapes:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(shapes)}")
    if min(args.tokens, args.prompt_len, args.e2e_tokens, args.repeats) < 1 or args.k < 1:
        parser.error("--tokens, --prompt-len, --e2e-tokens, --repeats and --k must be >= 1")
    if not 1 <= args.batch <= 16:
        parser.error("--batch must be in [1, 16] (the static path's largest batch bucket)")
    args.shapes = {"draft": shapes[args.draft], "target": shapes[args.target]}
    return args


def check_device(dry_run: bool) -> str | None:
    """None when this run can go on, else why not (no CUDA GPU without --dry-run)."""
    if dry_run:
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}). Run it on a GPU machine with a CUDA "
            "build of torch, or pass --dry-run for the CPU smoke test."
        )
    return None


# ---------------------------------------------------------------- measurements


def build_model(shape: Shape, device: str, dtype, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # random init straight on the device: a 7B model in seconds
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=dtype)
    model.requires_grad_(False)
    return model.eval()


def runners(model, dry_run: bool, max_len: int):
    """(eager ModelRunner, the runner services pick on this device: static on CUDA)."""
    from specdec.models.runner import ModelRunner, SessionKVCache
    from specdec.models.static_runner import StaticModelRunner, make_runner

    cache = SessionKVCache(16, 1 << 20)
    if dry_run:  # inductor compiles for minutes on a small CPU; aot_eager checks the same graphs
        static = StaticModelRunner(model, cache, max_len=max_len, backend="aot_eager")
    else:
        static = make_runner(model, cache, "auto", max_len)
        if not isinstance(static, StaticModelRunner):
            raise RuntimeError("make_runner did not select the static runner on CUDA")
    return ModelRunner(model, SessionKVCache(16, 1 << 20)), static


def _token(i: int, vocab: int) -> int:
    return (7 * i + 3) % vocab  # any ids: a forward's cost does not depend on them


def warm_up(runner, prompt: list[int]) -> float:
    """Seconds to compile/record every bucket (1 first: its graph stays specialised)."""
    started = time.perf_counter()
    for bucket in getattr(runner, "buckets", ()):
        runner.last_logits("warm-up", prompt, 1)
        runner.last_logits("warm-up", prompt + [1] * bucket, bucket)
    runner.cache.drop("warm-up")
    return time.perf_counter() - started


def decode_ms(runner, prompt: list[int], steps: int) -> float:
    """ms per decode step (one new token after the cached prefix, logits read on the CPU)."""
    vocab = runner.vocab_size
    ids = list(prompt)
    runner.last_logits("decode", ids, 1)  # the prompt: untimed
    for i in range(3):  # untimed: first replays
        ids.append(_token(i, vocab))
        runner.last_logits("decode", ids, 1)
    started = time.perf_counter()
    for i in range(steps):
        ids.append(_token(i + 3, vocab))
        runner.last_logits("decode", ids, 1)
    elapsed = time.perf_counter() - started
    runner.cache.drop("decode")
    return 1e3 * elapsed / steps


def verify_ms(runner, prompt: list[int], rows: int, repeats: int = 10) -> float:
    """Median ms of a cached forward over `rows` new tokens after the prompt (a Verify of K + 1)."""
    vocab = runner.vocab_size
    runner.last_logits("verify", prompt, 1)
    times = []
    for r in range(repeats + 2):
        drafts = [_token(r * rows + i, vocab) for i in range(rows)]
        started = time.perf_counter()
        runner.last_logits("verify", prompt + drafts, rows)  # rolls back to the prompt each time
        times.append(time.perf_counter() - started)
    runner.cache.drop("verify")
    return 1e3 * statistics.median(times[2:])


def batched_step_ms(runner, prompt: list[int], sessions: int, steps: int) -> float:
    """ms per step of `sessions` sessions decoding one token each after their cached prompts
    (one batched forward on the static path); tokens/s in all = sessions / that."""
    from specdec.models.runner import StepItem

    vocab = runner.vocab_size
    ids = {f"batch-{s}": [_token(s, vocab), *prompt] for s in range(sessions)}  # distinct sessions
    runner.step([StepItem(name, tokens, 1) for name, tokens in ids.items()])  # the prompts: untimed
    started = 0.0
    for i in range(steps + 3):  # the first 3 untimed: compiles and first replays
        if i == 3:
            started = time.perf_counter()
        for tokens in ids.values():
            tokens.append(_token(i, vocab))
        runner.step([StepItem(name, tokens, 1) for name, tokens in ids.items()])
    elapsed = time.perf_counter() - started
    for name in ids:
        runner.cache.drop(name)
    return 1e3 * elapsed / steps


def end_to_end(draft, target, prompt: list[int], k: int, tokens: int, seed: int) -> dict:
    """One generation through the speculative engine: tokens/s and the draft's acceptance."""
    from draft_service.proposer import LocalDrafter
    from specdec.core.engine import GenerationSpec, SpeculativeEngine, Stats, new_samples
    from specdec.core.protocols import NO_DEADLINE
    from specdec.core.sampling import Sampling
    from target_service.verifier import LocalVerifier

    engine = SpeculativeEngine(LocalDrafter(draft), LocalVerifier(target), decode=lambda ids: "")
    spec = GenerationSpec(
        context_token_ids=list(prompt),
        max_new_tokens=tokens,
        sampling=Sampling(temperature=1.0),
        seed=seed,
        num_speculative_tokens=k,
        cache_key=f"e2e-{k}-{seed}",
    )
    samples, stats = new_samples(spec), Stats()
    started = time.perf_counter()
    for _ in engine.run(spec, samples, stats, NO_DEADLINE):
        pass
    elapsed = time.perf_counter() - started
    for runner in (draft, target):
        runner.cache.drop(spec.cache_key)
    return {
        "k": k,
        "tokens": stats.emitted_tokens,
        "seconds": elapsed,
        "tokens_per_s": stats.emitted_tokens / elapsed,
        "acceptance": stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None,
        "rounds": stats.rounds,
    }


def predicted_speedup(alpha: float, k: int, draft_ms: float, verify_ms_k: float, target_ms: float) -> float:
    """Tokens per round (1 - a^(K+1)) / (1 - a) over a round's cost (K draft steps + a Verify of
    K + 1), against target-only decoding."""
    per_round = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return per_round * target_ms / (k * draft_ms + verify_ms_k)


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict:
    import torch

    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    prompt = [_token(i, 97) for i in range(args.prompt_len)]
    max_len = args.prompt_len + max(args.tokens + 8, args.e2e_tokens + 2 * args.k + 4) + 32
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "models": {}}
    loaded = {}
    for role, seed in (("target", 2), ("draft", 1)):
        name = getattr(args, role)
        started = time.perf_counter()
        model = build_model(args.shapes[role], device, dtype, seed)
        eager, static = runners(model, args.dry_run, max_len)
        if role == "draft":
            # Every forward on the target's model thread, as in-process serving does: CUDA graph
            # trees are per thread, so graphs recorded on one thread would re-record on another.
            for runner in (eager, static):
                runner.share_model_thread(loaded["target"][1])
        else:
            eager.share_model_thread(static)
        loaded[role] = (eager, static)
        entry = {"shape": asdict(args.shapes[role]), "build_s": time.perf_counter() - started}
        entry["compile_s"] = static.on_model_thread(warm_up, static, prompt)
        _progress(f"{role} {name}: built in {entry['build_s']:.1f} s, compiled in {entry['compile_s']:.1f} s")
        results["models"][role] = entry | {"name": name}
    _measure_decode(args, loaded, prompt, results)
    target_static = loaded["target"][1]
    results["verify_ms"] = {
        rows: target_static.on_model_thread(verify_ms, target_static, prompt, rows) for rows in (1, args.k + 1)
    }
    _progress(f"target verify ms by rows: {results['verify_ms']}")
    results["batched_step_ms"] = {
        sessions: target_static.on_model_thread(
            batched_step_ms, target_static, prompt, sessions, max(1, args.tokens // 4)
        )
        for sessions in (1, args.batch)
    }
    _progress(f"target static ms per step by sessions x 1 token: {results['batched_step_ms']}")
    if not args.skip_e2e:
        _measure_e2e(args, loaded, prompt, results)
    return results


def _measure_decode(args, loaded, prompt, results) -> None:
    paths = ("static",) if args.skip_eager else ("eager", "static")
    best = {(role, path): float("inf") for role in loaded for path in paths}
    for _ in range(args.repeats):  # interleaved, so drift hits every figure alike
        for role, (eager, static) in loaded.items():
            for path in paths:
                runner = static if path == "static" else eager
                ms = runner.on_model_thread(decode_ms, runner, prompt, args.tokens)
                best[role, path] = min(best[role, path], ms)
    for role in loaded:
        results["models"][role]["ms_per_token"] = {path: best[role, path] for path in paths}
    results["c"] = {path: best["draft", path] / best["target", path] for path in paths}
    _progress(f"decode ms/token: { ({f'{r}/{p}': round(v, 3) for (r, p), v in best.items()}) }; c: {results['c']}")


def _measure_e2e(args, loaded, prompt, results) -> None:
    draft, target = loaded["draft"][1], loaded["target"][1]  # one model thread (see run)
    runs: dict[int, dict] = {}
    for repeat in range(args.repeats):
        for k in (0, args.k):
            outcome = end_to_end(draft, target, prompt, k, args.e2e_tokens, seed=repeat + 1)
            if k not in runs or outcome["tokens_per_s"] > runs[k]["tokens_per_s"]:
                runs[k] = outcome
    alpha = runs[args.k]["acceptance"] or 0.0
    ms = {role: results["models"][role]["ms_per_token"]["static"] for role in ("draft", "target")}
    verify_k = results["verify_ms"][args.k + 1]
    results["e2e"] = {
        "runs": list(runs.values()),
        "speedup": runs[args.k]["tokens_per_s"] / runs[0]["tokens_per_s"],
        "predicted_speedup": {
            str(a): predicted_speedup(a, args.k, ms["draft"], verify_k, ms["target"])
            for a in sorted({round(alpha, 3), 0.6, 0.8})
        },
    }


def _progress(line: str) -> None:
    print(f"[gpu_check] {line}", file=sys.stderr, flush=True)


def table(results: dict, k: int) -> str:
    """The compact table printed at the end."""
    lines = [f"device: {results['device']}", f"{'model':<28}{'eager ms/tok':>14}{'static ms/tok':>15}{'gain':>8}"]
    for role in ("draft", "target"):
        entry = results["models"][role]
        ms = entry["ms_per_token"]
        eager = ms.get("eager")
        gain = f"{eager / ms['static']:.1f}x" if eager else "-"
        eager_text = f"{eager:.2f}" if eager else "-"
        lines.append(f"{role + ' ' + entry['name']:<28}{eager_text:>14}{ms['static']:>15.2f}{gain:>8}")
    c = results["c"]
    lines.append("c = draft/target: " + "  ".join(f"{path} {value:.3f}" for path, value in c.items()))
    lines.append(
        "target verify ms by rows (static): " + "  ".join(f"{r}: {v:.2f}" for r, v in results["verify_ms"].items())
    )
    steps = results.get("batched_step_ms")
    if steps:
        lines.append(
            "target static step of N sessions x 1 token, ms (tok/s): "
            + "  ".join(f"{n}: {v:.2f} ({n * 1e3 / v:.0f})" for n, v in steps.items())
        )
    e2e = results.get("e2e")
    if e2e:
        for outcome in e2e["runs"]:
            acceptance = "-" if outcome["acceptance"] is None else f"{outcome['acceptance']:.2f}"
            lines.append(
                f"end to end K={outcome['k']}: {outcome['tokens_per_s']:.1f} tok/s "
                f"({outcome['tokens']} tokens, {outcome['rounds']} rounds, acceptance {acceptance})"
            )
        predicted = "  ".join(f"a={a}: {s:.2f}x" for a, s in e2e["predicted_speedup"].items())
        lines.append(f"K={k} / K=0 measured: {e2e['speedup']:.2f}x; predicted from the costs: {predicted}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_device(args.dry_run)
    if problem:
        print(problem, file=sys.stderr)
        return NO_GPU_EXIT
    results = run(args)
    print(table(results, args.k), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
