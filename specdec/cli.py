"""The `specdec` console command."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack

import grpc

from specdec.client import FINISH_REASONS, SpecdecClient
from specdec.compare import compare, format_comparison
from specdec.core.errors import ServiceError
from specdec.models.sources import DEFAULT_DRAFT, DEFAULT_MODEL


def format_stats(stats, finish_reason: int, session_id: str, seed: int) -> str:
    return "\n".join(
        [
            f"finish reason      {FINISH_REASONS.get(finish_reason, finish_reason)}",
            f"session            {session_id or '-'}   (seed {seed})",
            f"tokens             {stats.prompt_tokens} prompt, {stats.generated_tokens} generated",
            f"rounds             {stats.rounds}   ({stats.mean_tokens_per_round:.2f} tokens/round)",
            (
                f"drafted/accepted   {stats.drafted_tokens}/{stats.accepted_tokens}"
                f"   (acceptance rate {stats.acceptance_rate:.3f})"
            ),
            (
                f"time               {stats.total_time_s:.3f}s: draft {stats.draft_time_s:.3f}s, "
                f"verify {stats.verify_time_s:.3f}s, coordinator {stats.coordinator_time_s:.3f}s"
            ),
            f"throughput         {stats.tokens_per_second:.2f} tokens/s",
        ]
    )


def _client(args: argparse.Namespace) -> SpecdecClient:
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise SystemExit("error: --tls-cert-file and --tls-key-file go together")
    return SpecdecClient(
        args.address,
        timeout_s=args.timeout,
        api_key=args.api_key,
        tls=args.tls,
        tls_ca_file=args.tls_ca_file,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
    )


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Where the coordinator is and how to reach it: flags, or SPECDEC_* env vars."""
    env = os.environ.get
    parser.add_argument("--address", default=env("SPECDEC_ADDRESS", "localhost:50051"))
    parser.add_argument(
        "--api-key",
        default=env("SPECDEC_API_KEY", ""),
        help="sent as 'authorization: Bearer <key>' (default SPECDEC_API_KEY, which keeps it out of `ps`)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=env("SPECDEC_TLS", "").lower() in ("1", "true", "yes"),
        help="TLS, verifying the coordinator against the system's roots (default SPECDEC_TLS)",
    )
    parser.add_argument(
        "--tls-ca-file",
        default=env("SPECDEC_TLS_CA_FILE", ""),
        help="TLS, verifying the coordinator against this CA (default SPECDEC_TLS_CA_FILE)",
    )
    parser.add_argument(
        "--tls-cert-file",
        default=env("SPECDEC_TLS_CERT_FILE", ""),
        help="client certificate for mutual TLS (default SPECDEC_TLS_CERT_FILE)",
    )
    parser.add_argument(
        "--tls-key-file",
        default=env("SPECDEC_TLS_KEY_FILE", ""),
        help="private key of --tls-cert-file (default SPECDEC_TLS_KEY_FILE)",
    )


def _source(args: argparse.Namespace, stack: ExitStack):
    """What streams GenerateChunks: a client of the coordinator, or the pipeline loaded in this
    process (`--in-process`); both have `stream(prompt, **kwargs)`."""
    if not args.in_process:
        return stack.enter_context(_client(args))
    if getattr(args, "session", None):
        raise SystemExit("error: --session needs the coordinator (sessions live in its Redis), not --in-process")
    from specdec.models.openmp_env import set_openmp_defaults

    set_openmp_defaults()  # before torch loads
    from transformers.utils import logging as hf_logging

    from specdec.inprocess import InProcessPipeline

    hf_logging.disable_progress_bar()  # the completion streams to the same terminal

    return InProcessPipeline(args.target, args.draft or None, args.draft_lookup, args.target_lookup)


def _generate(args: argparse.Namespace) -> int:
    kwargs = {
        "session_id": args.session or "",
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "num_speculative_tokens": args.k,
        "stop": args.stop or (),
        "ignore_eos": args.ignore_eos,
        "chat": args.chat,
    }
    with ExitStack() as stack:
        last = None
        for chunk in _source(args, stack).stream(args.prompt, **kwargs):
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            last = chunk
        sys.stdout.write("\n")
        if last is not None and not args.quiet:
            print("---", file=sys.stderr)
            print(format_stats(last.stats, last.finish_reason, last.session_id, last.seed), file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    kwargs = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "chat": args.chat,
    }
    with ExitStack() as stack:
        speculative, alone = compare(_source(args, stack), args.prompt, args.k, **kwargs)
    print(format_comparison(speculative, alone, args.k, greedy=args.temperature == 0))
    return 0


def _session(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "delete":
            print("deleted" if client.delete_session(args.session_id) else "no such session")
            return 0
        session = client.get_session(args.session_id)
        print(f"session {session.session_id}: {len(session.token_ids)} tokens, expires in {session.ttl_seconds}s")
        print(session.text)
    return 0


def add_in_process_args(parser: argparse.ArgumentParser) -> None:
    """--in-process and the models it loads."""
    parser.add_argument(
        "--in-process", action="store_true", help="load the models here and run without servers or Redis"
    )
    parser.add_argument("--target", default=DEFAULT_MODEL, help="--in-process: the target model")
    parser.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help="--in-process: the draft model ('' = none, K=0 only; 'ngram' = prompt lookup, 'suffix' = "
        "suffix trie over recent sequences: no model)",
    )
    parser.add_argument(
        "--draft-lookup",
        choices=["", "ngram", "suffix"],
        help="--in-process: with a draft model, try this model-free draft first per sequence (hybrid; "
        "default SPECDEC_DRAFT_LOOKUP)",
    )
    parser.add_argument(
        "--target-lookup",
        choices=["", "ngram", "suffix"],
        help="--in-process: the target drafts every round itself with this model-free draft, several rounds "
        "a call (as `make run` serves it; default SPECDEC_TARGET_LOOKUP)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion from a coordinator")
    gen.add_argument("prompt")
    add_connection_args(gen)
    gen.add_argument("--session", help="continue this session id")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, help="K; 0 = target only")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.add_argument("--quiet", action="store_true", help="no stats")
    add_in_process_args(gen)
    gen.set_defaults(func=_generate)
    cmp = sub.add_parser(
        "compare", help="does speculation pay on this prompt? the same request with speculation, then at K = 0"
    )
    cmp.add_argument("prompt")
    add_connection_args(cmp)
    cmp.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, help="K (default: the coordinator's, auto)")
    cmp.add_argument("--max-new-tokens", type=int, default=96)
    cmp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy: both runs emit the same tokens")
    cmp.add_argument("--top-p", type=float, default=1.0)
    cmp.add_argument("--seed", type=int, default=0, help="shared by both runs")
    cmp.add_argument("--ignore-eos", action="store_true", help="both runs generate --max-new-tokens")
    cmp.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    cmp.add_argument("--timeout", type=float, default=600.0, help="deadline of each run in seconds")
    add_in_process_args(cmp)
    cmp.set_defaults(func=_compare)
    session = sub.add_parser("session", help="show or delete a stored session")
    session.add_argument("action", choices=["show", "delete"])
    session.add_argument("session_id")
    add_connection_args(session)
    session.add_argument("--timeout", type=float, default=30.0)
    session.set_defaults(func=_session)
    # distill / eval-draft live with the training code; their heavy imports load on use.
    from specdec.distill.cli import add_subcommands

    add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:  # a TLS file that cannot be read
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ServiceError as exc:  # --in-process: the same errors, without a server to turn them into statuses
        print(f"\nerror: {exc.code}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
