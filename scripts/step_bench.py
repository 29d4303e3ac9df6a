"""What a batched `ModelRunner.step` buys over running its items one by one (issue 13).

Loads the default target (specdec.models.sources.DEFAULT_MODEL) as the target service does
(`load_model`: calibrated matmul layouts, the thread governor), gives each of 16 sessions a cached
prefix of --context random tokens, then per repeat, interleaved so that drift hits both alike:

  step N x R      one `step` of N sessions each running R new tokens after its prefix, all R
                  rows' logits kept, as a Verify of K = R - 1 (N = --sizes, R = --rows; 1: decode)
  loop N x R      the same items as N `last_logits` calls one after the other
  mixed           4 decodes + 4 verifies of 5 new tokens (num_last = 5) as one step, and looped

Every item rolls back to its prefix (the new tokens differ each repeat), so every repeat runs the
same work on ~context cached positions. Reports the median ms of each, and the speedup (loop ms /
step ms, i.e. the ratio of aggregate tokens/s) with its interquartile range over repeats, and the
ratio of the fastest runs (steadier on a shared machine); and the largest |batched - solo| logit
seen relative to that item's largest |logit|, a check that the step computed the same thing
(solo forwards in two matmul layouts differ by as much: float32 noise of kernels).

  python scripts/step_bench.py                       sizes 1,2,4,8,16, 300 cached tokens, 10 repeats
  python scripts/step_bench.py --sizes 8 --repeats 30 --threads 2
  python scripts/step_bench.py --sizes 1,8 --rows 1,2,3,5     what a batch's Verify rows cost
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from specdec.models.openmp_env import set_openmp_defaults

set_openmp_defaults()  # before torch loads, as the services do

import hostinfo
import numpy as np
import torch

from specdec.models.runner import ModelRunner, StepItem
from specdec.models.threads import set_torch_threads

SESSIONS = 16


def _load(**settings) -> ModelRunner:
    """The target as a service loads it (`settings`: TargetSettings fields): on a thread that then
    ends, so that the model thread's OpenMP team is the only one left in the process
    (`specdec.models.openmp_env`)."""
    loaded: list[ModelRunner] = []
    loader = threading.Thread(target=lambda: loaded.append(_load_here(**settings)))
    loader.start()
    loader.join()
    if not loaded:
        raise SystemExit("loading the model failed (see above)")
    return loaded[0]


def _load_here(**settings) -> ModelRunner:
    from specdec.models.sources import DEFAULT_MODEL
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    return load_model(load_settings(TargetSettings, [], {}, model=DEFAULT_MODEL, **settings), "target").runner


def _timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


class Bench:
    def __init__(self, runner: ModelRunner, context: int, seed: int):
        self.runner = runner
        self.rng = np.random.default_rng(seed)
        vocab = runner.vocab_size
        self.prefix = {f"bench-{i}": self.rng.integers(0, vocab, size=context).tolist() for i in range(SESSIONS)}
        for session, tokens in self.prefix.items():
            runner.on_model_thread(runner.last_logits, session, tokens, 1)

    def items(self, sessions: int, new: int, num_last: int, start: int = 0) -> list[StepItem]:
        names = sorted(self.prefix)[start : start + sessions]
        return [
            StepItem(s, self.prefix[s] + self.rng.integers(0, self.runner.vocab_size, size=new).tolist(), num_last)
            for s in names
        ]

    def compare(self, items: list[StepItem], step_first: bool) -> tuple[float, float, float]:
        """(seconds of one step, seconds of the items one by one, largest |step - solo| logit); the
        same items, so each run rolls back to the prefix. Which runs first alternates (the first
        after a change of shape pays for it)."""
        runner = self.runner

        def step():
            return _timed(lambda: runner.on_model_thread(runner.step, items))

        def loop():
            return _timed(lambda: [runner.on_model_thread(runner.step, [i])[0] for i in items])

        if step_first:
            (step_s, batched), (loop_s, solo) = step(), loop()
        else:
            (loop_s, solo), (step_s, batched) = loop(), step()
        # Relative to the item's largest logit: peaked laws have logits of 50+, flat ones ~15.
        diff = max(float((b.logits - s.logits).abs().max() / s.logits.abs().max()) for b, s in zip(batched, solo))
        return step_s, loop_s, diff


def _report(name: str, tokens: int, runs: list[tuple[float, float, float]]) -> None:
    step_ms = statistics.median(r[0] for r in runs) * 1e3
    loop_ms = statistics.median(r[1] for r in runs) * 1e3
    ratios = sorted(r[1] / r[0] for r in runs)
    q1, q3 = np.percentile(ratios, [25, 75])
    best = min(r[1] for r in runs) / min(r[0] for r in runs)  # steadier when other work comes and goes
    print(
        f"{name:<16} {step_ms:9.1f} {loop_ms:9.1f} {tokens / step_ms * 1e3:11.1f} {tokens / loop_ms * 1e3:11.1f}"
        f"   {statistics.median(ratios):5.2f}x [{q1:.2f}-{q3:.2f}] {best:6.2f}x   {max(r[2] for r in runs):.1e}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,4,8,16", help="sessions per decode step")
    parser.add_argument("--rows", default="1", help="new tokens per session (R - 1 = a Verify's K)")
    parser.add_argument("--context", type=int, default=300, help="cached tokens per session")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the governor chooses, as served)")
    parser.add_argument("--calibrate-max-rows", type=int, default=9, help="as the service setting")
    parser.add_argument("--layout", default="auto", help="LINEAR_LAYOUT, as the service setting")
    parser.add_argument("--dtype", default="float32", help="DTYPE, as the service setting")
    parser.add_argument("--matmul-dtype", default="float32", help="MATMUL_DTYPE, as the service setting")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV_CACHE_DTYPE, as the service setting")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # This thread's own tensor ops (the logit comparisons) stay on it: a team of its own would
    # throttle the model thread's (`specdec.models.openmp_env`).
    set_torch_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    shapes = [(n, int(r)) for n in sizes for r in args.rows.split(",")]
    if max(sizes) > SESSIONS:
        parser.error(f"at most {SESSIONS} sessions per step")

    loaded_at = time.perf_counter()
    runner = _load(
        torch_threads=args.threads,
        calibrate_max_rows=args.calibrate_max_rows,
        linear_layout=args.layout,
        dtype=args.dtype,
        matmul_dtype=args.matmul_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    bench = Bench(runner, args.context, args.seed)
    print(
        f"{hostinfo.summary(hostinfo.describe())}; loaded and prefilled in {time.perf_counter() - loaded_at:.0f} s;"
        f" ragged: {runner._ragged_ok()}"
    )
    for first in (True, False):  # warm every shape once
        for n, r in shapes:
            bench.compare(bench.items(n, r, r), first)
        bench.compare(bench.items(4, 1, 1) + bench.items(4, 5, 5, start=4), first)
    decode: dict[tuple[int, int], list] = {shape: [] for shape in shapes}
    mixed: list = []
    for rep in range(args.repeats):
        for n, r in shapes:
            decode[(n, r)].append(bench.compare(bench.items(n, r, r), rep % 2 == 0))
        mixed.append(bench.compare(bench.items(4, 1, 1) + bench.items(4, 5, 5, start=4), rep % 2 == 1))

    header = f"{'step ms':>9} {'loop ms':>9} {'step rows/s':>11} {'loop rows/s':>11}   speedup [IQR]  fastest   max rel |diff|"
    print(f"\n{'':<16} {header}")
    for (n, r), runs in decode.items():
        _report(f"{n} x {r} " + ("decode" if r == 1 else "verify"), n * r, runs)
    _report("4x1 + 4x5 mixed", 4 + 4 * 5, mixed)
    threads = runner.on_model_thread(torch.get_num_threads)
    print(
        f"\nthreads now {threads}; {args.repeats} repeats; fastest: best loop / best step; max rel |diff|: largest |step - solo| logit / largest |logit| of that item"
    )


if __name__ == "__main__":
    main()
