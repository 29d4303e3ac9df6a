"""The `distill` and `eval-draft` subcommands of the `specdec` console command."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

from specdec.distill import DistillError
from specdec.models.sources import DEFAULT_MODEL  # stdlib-only: `specdec --help` stays fast


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _reports_errors(command):
    """A DistillError ends the command as `error: ...` on stderr with exit code 2 (argparse's code for
    bad usage): it is a problem with the settings, not a crash worth a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except DistillError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


@_reports_errors
def _distill(args: argparse.Namespace) -> int:
    from specdec.distill.train import DistillConfig, distill

    # Every flag's dest is the DistillConfig field it sets.
    names = {f.name for f in dataclasses.fields(DistillConfig)}
    cfg = DistillConfig(**{name: value for name, value in vars(args).items() if name in names})
    summary = distill(cfg, log=_log)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "config")}, indent=2))
    return 0


@_reports_errors
def _eval_draft(args: argparse.Namespace) -> int:
    from specdec.distill.evaluate import eval_draft, format_report

    report = eval_draft(
        draft=args.draft,
        target=args.target,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        threads=args.threads,
        timing_steps=args.timing_steps,
        max_k=args.max_k,
        log=_log,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def add_subcommands(sub) -> None:
    """Add `distill` and `eval-draft` to the `specdec` subparsers `sub`."""
    _add_distill(sub)
    _add_eval_draft(sub)


def _add_distill(sub) -> None:
    d = sub.add_parser(
        "distill",
        help="train a small draft for a target (shares its tokenizer, embedding and head)",
        description="Distil a draft: on-policy target samples for built-in chat prompts + stdlib text, "
        "top-k target laws cached once, forward KL(p_target || q_draft) at temperature 1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--target", default=DEFAULT_MODEL, help="target model spec (as the model services accept)")
    d.add_argument("--out", help="artifact directory (default drafts/<target>-<N>l)")
    d.add_argument("--work-dir", help="label cache and checkpoint (default .run/distill/<artifact name>)")
    d.add_argument("--layers", dest="num_layers", type=int, default=2, help="decoder layers in the draft")
    d.add_argument(
        "--init-layers",
        type=_int_list,
        help="target layers to start from, e.g. 0,29 (default: the best candidate by held-out alpha at initialisation)",
    )
    d.add_argument("--chat-sequences", type=int, default=1024, help="on-policy target samples to label")
    d.add_argument("--text-sequences", type=int, default=256, help="stdlib text windows to label")
    d.add_argument("--heldout-sequences", type=int, default=16, help="held-out chat samples for evaluation")
    d.add_argument("--max-new-tokens", type=int, default=192, help="length of each target sample")
    d.add_argument("--text-len", type=int, default=256, help="tokens per text window")
    d.add_argument("--top-k", type=int, default=64, help="target probabilities kept per position")
    d.add_argument("--shard-size", type=int, default=16, help="sequences per label shard (= generation batch)")
    d.add_argument("--steps", type=int, default=1000, help="optimizer steps (sets the LR schedule)")
    d.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    d.add_argument("--lr", type=float, default=5e-4)
    d.add_argument("--warmup-steps", type=int, default=30)
    d.add_argument("--eval-every", type=int, default=100)
    d.add_argument("--checkpoint-every", type=int, default=50)
    d.add_argument("--label-seconds", type=float, help="time budget for target labelling")
    d.add_argument("--max-seconds", type=float, help="time budget for training in this run")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    d.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    d.add_argument("--resume", action="store_true", help="continue from the checkpoint in the work dir")
    d.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    d.add_argument("--weights-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    d.add_argument(
        "--head-tokens",
        type=int,
        default=8192,
        help="keep only this many tokens (most target mass "
        "in the labels, plus EOS/special) in the draft's head: a cheaper draft step; 0 (or >= the "
        "vocabulary) = the full head",
    )
    d.add_argument(
        "--init-from", help="start from this draft artifact's layers (and head subset) instead of target layers"
    )
    d.add_argument(
        "--conditioning",
        choices=["tokens", "target_hidden"],
        default="tokens",
        help="target_hidden: the draft also reads the target's final hidden state at the previous "
        "position (EAGLE-style; the coordinator carries it from each Verify); tokens: a small LM",
    )
    d.add_argument(
        "--hidden-loss-weight",
        type=float,
        default=0.2,
        help="target_hidden: weight of the smooth-L1 loss between the draft's and the target's states",
    )
    d.set_defaults(func=_distill)


def _add_eval_draft(sub) -> None:
    e = sub.add_parser(
        "eval-draft",
        help="alpha, greedy agreement, cost ratio c and the Leviathan bound of a draft for a target",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--draft", required=True, help="draft model spec (a draft artifact directory, or any model)")
    e.add_argument("--target", default=DEFAULT_MODEL)
    e.add_argument("--prompts", type=int, default=8, help="held-out chat prompts")
    e.add_argument("--max-new-tokens", type=int, default=128, help="target sample length per prompt")
    e.add_argument("--temperature", type=float, default=1.0, help="alpha is measured at this temperature")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int)
    e.add_argument("--timing-steps", type=int, default=40, help="decode steps timed per model for c")
    e.add_argument("--max-k", type=int, default=8)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_eval_draft)
