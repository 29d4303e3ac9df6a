"""Speculative decoding on real workloads: every workload x drafter x temperature x K, with the
target alone (K = 0) measured in the same run, interleaved, as the baseline of each ratio.

  python scripts/bench.py                              all workloads, drafters model and ngram, in process
  python scripts/bench.py --drafters ngram --ks 0,4,auto --temperatures 0
  python scripts/bench.py --prompts my.jsonl           your own prompts (see below)
  python scripts/bench.py --modes grpc                 through the real stack (started per drafter)
  python scripts/bench.py --modes grpc,in-process      both, interleaved: the pipeline's own cost per round
  python scripts/bench.py --modes in-process,hf-generate  and Hugging Face `generate` on the same target
  python scripts/bench.py --address HOST:PORT          a stack that is already up (grpc mode, its one drafter)
  python scripts/bench.py --background-load 2          the same under 2 busy CPU processes
  python scripts/bench.py --json                       one JSON object per row on stdout (progress on stderr)

Workloads (scripts/workloads.py, built from the Python install's own sources and docs): code-editing,
summarisation, document-qa (input-grounded: the answer copies the prompt), multi-turn-chat (later
turns quote earlier ones) and open-ended. `--prompts FILE` takes JSONL instead, one object per line:
{"workload": "mine", "prompt": "first user turn", "turns": ["optional", "later user turns"]}.

Drafters (DRAFTERS below; adding one is a line there): `model` is the distilled draft (`--draft`,
default the one `make run` serves), `ngram` and `suffix` the model-free drafts, `hybrid` the model
with the suffix lookup tried first (`hybrid-ngram`: with ngram), as SPECDEC_DRAFT_MODEL /
SPECDEC_DRAFT_LOOKUP or the in-process pipeline's draft; `target-ngram` / `target-suffix` the
target drafting every round itself with that lookup (SPECDEC_TARGET_LOOKUP: several rounds a call);
LABEL=SPEC names any other draft model, e.g. `tokens=drafts/smollm2-135m-instruct-2l`.
Drafters run one after the other (each with its own K = 0 baseline); inside one, for every
conversation, each temperature, then every K (order rotated per conversation), then every mode, so
drift over time hits K = 0 and K > 0 alike. Requests go through the chat template (the client's
`chat=True`) with a seed per conversation shared by all K and modes. EOS ends an answer (what a user
is served; at T = 0 every K emits the same tokens); `--ignore-eos` generates exactly
--max-new-tokens every time instead. At T > 0 each K draws its own EOS, so one conversation's rows
can compare answers of different lengths, each carrying the same prompt's forward (an auto K answer
that ended after 8 tokens ran at 0.77x of K = 0's 64): by losslessness the lengths have one law, so
ratios over many conversations (`--per-workload`, `--repeats`) are fair, one conversation's are
noisy. `--ignore-eos` equalises lengths but measures text past the end of turn, which no user is
served and where drafts do not behave as before it (docs/drafts.md). A multi-turn conversation
continues its session in the grpc mode; in process (no sessions) each later turn sends the whole
history as token ids, the same context the session would hold, and the target's cache of the
previous turn serves its prefix, as the session's would.
Prompts (`--prompt-cache`): a model service's KV cache serves any new request whose prompt opens as
a cached one does (a shared system prompt, `kv_cache.fork_cache`), so a conversation's first K
would otherwise compute the prompt and every later K read it: on a 600-token prompt half of a
64-token call's time. `cold` (in process, the default) empties both models' caches before every
call: each K computes its prompt, as a new request does. `warm` computes the first turn's prompt
just before every call, untimed (a cached document or system prompt; the ratios then weigh decoding
alone); the grpc mode always primes so, as it cannot empty the services' caches.
In process, a drafter with state across sessions (a `reset()` method: suffix, hybrid) is reset
before every conversation, so no config is drafted from another config's answer to the same
prompt; the grpc mode cannot reset the draft service, so its suffix rows include that reuse.

Per row: tokens/s (generated tokens / client-side wall time of the calls), the ratio to K = 0 of the
same drafter, workload, temperature and mode with its 95% interval over the runs paired by
conversation and repeat (with two pairs or more: on this VM one pair moves +-10%, so a row of 4
pairs cannot tell 0.93x from 1.00x, and the table says so), the ratio to Hugging Face `generate` (mode hf-generate:
transformers' own decoding of the same target and tokens, run beside every K = 0, no K of its own),
acceptance, tokens and drafted tokens per round, milliseconds per round in Propose calls (draft),
Verify calls (verify) and the rest of the engine's wall time (other: accept/reject, laws, text,
Redis; the non-model overhead), and the VM's steal share. Summary rows: per
drafter x mode x temperature x K, the mean ratio over the input-grounded workloads and the minimum
over all workloads; then the issue's targets, met or not, and "not resolved" where the target lies
inside the value's interval.

--json objects, by "type":
  run       target, drafters, modes, ks, temperatures, max_new_tokens, ignore_eos,
            repeats, conversations, prompts, background_load, cpus, python; drafters is
            label -> {model, lookup}
  row       drafter, mode, workload, temperature, k, background_load, conversations, requests, tokens,
            seconds, tokens_per_s, ratio_vs_k0, ratio_interval ([low, high] or null), ratio_vs_hf,
            acceptance_rate, tokens_per_round, drafted_per_round,
            rounds, draft_ms_per_round, verify_ms_per_round, other_ms_per_round, call_ms_per_request
            (per request outside the engine: validation, tokenisation, sessions, gRPC), steal_share
            (of the VM's CPU time during the calls, what its hypervisor gave to other guests: a
            row with a large share met a slow spell of the VM; 0 without /proc/stat)
  summary   drafter, mode, temperature, k, background_load, workloads, grounded_mean_ratio,
            grounded_target, grounded_mean_vs_hf, min_ratio, min_ratio_workload, min_ratio_interval,
            auto_floor
  target    check (grounded_mean | auto_floor), mode, temperature, target, value, met, interval, resolved
            (false: the target lies inside the value's interval), drafter, k, workload
  pipeline  (both modes) drafter, temperature, k, in_process_vs_grpc, ms_per_round
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stdout
from dataclasses import astuple, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import hostinfo
import stack
import workloads
from workloads import INPUT_GROUNDED, WORKLOADS, Conversation

from specdec.models.openmp_env import set_openmp_defaults
from specdec.models.sources import DEFAULT_DRAFT as DISTILLED_DRAFT  # `model`: not stack's default draft
from specdec.v1 import coordinator_pb2

HF_MODE = "hf-generate"  # Hugging Face `generate` on the same target: what users would run instead
MODES = ("grpc", "in-process", HF_MODE)
VM_CPUS = os.cpu_count() or 1  # /proc/stat's steal counts all of the VM's CPUs, not this process's
MODEL_DRAFTER = "model"  # the distilled draft given by --draft
DEFAULT_DRAFTERS = "model,ngram"
# The issue's targets, shown next to the summary rows.
GROUNDED_TARGETS = {0.0: 1.5, 1.0: 1.2}  # input-grounded mean, best model-free drafter
AUTO_FLOOR = 0.97  # auto K, every workload and drafter
MODEL_FREE = ("ngram", "suffix")
# A busy process per core: --background-load. Each stops on its own once the bench is gone (its
# parent changes), so a killed bench leaves no spinning process behind.
BUSY_CODE = {
    "spin": "import os\np = os.getppid()\nwhile os.getppid() == p:\n    sum(range(10000))\n",
    "matmul": (
        "import os\nimport numpy as np\np = os.getppid()\na = np.random.default_rng(0).random((256, 256))\n"
        "while os.getppid() == p:\n    a = np.tanh(a @ a)\n"
    ),
}


# ------------------------------------------------------------------ running one conversation


@dataclass(frozen=True)
class Call:
    """One Generate of a conversation: its stats and the client-side wall time."""

    stats: object  # specdec.v1 GenerationStats
    seconds: float


class GrpcRunner:
    """Conversations through a coordinator: later turns continue the first turn's session."""

    def __init__(self, client):
        self.client = client

    def run(self, conversation: Conversation, **kwargs) -> list[Call]:
        calls, session = [], ""
        for text in (conversation.prompt, *conversation.turns):
            started = time.perf_counter()
            response = self.client.generate(text, chat=True, session_id=session, **kwargs)
            calls.append(Call(response.stats, time.perf_counter() - started))
            session = response.session_id
        self.client.delete_session(session)  # outside the timing: Redis stays small
        return calls

    def start_alike(self, conversation: Conversation, warm: bool) -> None:
        """Before a timed call: the first turn's prompt computed once, untimed, so every K's call
        reads it from the target's cache (warm or not: the services' caches cannot be emptied)."""
        response = self.client.generate(conversation.prompt, chat=True, max_new_tokens=1, num_speculative_tokens=0)
        self.client.delete_session(response.session_id)


class InProcessRunner:
    """Conversations on an InProcessPipeline. It has no sessions, so a later turn sends the history
    (earlier turns + answers) as token ids, rendered as the coordinator renders a continued session."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def _turn_ids(self, text: str, continuing: bool) -> list[int]:
        from coordinator.requests import chat_turn_text

        tokenizer = self.pipeline.tokenizer
        return tokenizer(chat_turn_text(tokenizer, text, continuing), add_special_tokens=False)["input_ids"]

    def forget_draft_state(self) -> None:
        """Every config reruns the same conversations, and at T = 0 emits the same tokens: a drafter
        that learns across sessions (suffix, hybrid) would propose one config's answer to the next.
        Such a drafter offers reset(), called before every conversation so each starts cold."""
        drafter = getattr(getattr(self.pipeline, "draft", None), "drafter", None)
        for each in (drafter, getattr(self.pipeline, "target_lookup", None)):
            if callable(reset := getattr(each, "reset", None)):
                reset()

    def start_alike(self, conversation: Conversation, warm: bool) -> None:
        """Before a timed call: both models' KV caches emptied, whatever ran before; `warm`: then the
        first turn's prompt computed once, untimed, so the call reads it from the cache."""
        self.pipeline.clear_caches()
        if warm:
            self.pipeline.generate(conversation.prompt, chat=True, max_new_tokens=1, num_speculative_tokens=0)

    def generate(self, prompt, chat: bool = False, **kwargs):
        return self.pipeline.generate(prompt, chat=chat, **kwargs)

    def run(self, conversation: Conversation, **kwargs) -> list[Call]:
        self.forget_draft_state()
        calls, history = [], []
        for text in (conversation.prompt, *conversation.turns):
            if history:
                prompt_ids = history + self._turn_ids(text, continuing=True)
                started = time.perf_counter()
                response = self.generate(prompt_ids, **kwargs)
            else:  # a first turn is text with chat=True, exactly as the client sends it
                started = time.perf_counter()
                response = self.generate(text, chat=True, **kwargs)
            calls.append(Call(response.stats, time.perf_counter() - started))
            if conversation.turns:  # what a session would hold now: the prompt's tokens and the answer
                prompt_ids = prompt_ids if history else self._turn_ids(text, continuing=False)
                history = prompt_ids + list(response.completions[0].token_ids)
        return calls


class HfGenerateRunner(InProcessRunner):
    """The baseline users would run instead: transformers' `generate` on a fresh copy of the target
    (its own dynamic KV cache, greedy or plain sampling at T), the same tokens and seed. It runs on the
    pipeline's model thread: a second OpenMP team in one process throttles the other's forwards."""

    def __init__(self, pipeline, target: str):
        super().__init__(pipeline)
        from specdec.models.loading import load_causal_lm

        self.runner = pipeline.target.runner
        self.model, _ = self.runner.on_model_thread(load_causal_lm, target)
        eos = self.model.generation_config.eos_token_id
        self.pad_id = (eos[0] if isinstance(eos, list) and eos else eos) or 0  # only to quiet a warning

    def forget_draft_state(self) -> None:
        pass

    def start_alike(self, conversation: Conversation, warm: bool) -> None:
        pass  # `generate` computes every prompt (--prompt-cache warm refuses this mode)

    def generate(self, prompt, chat: bool = False, **kwargs) -> coordinator_pb2.GenerateResponse:
        """The engine's response message, in its terms: one round (one forward) per token."""
        ids = self._turn_ids(prompt, continuing=False) if chat else list(prompt)
        started = time.perf_counter()
        tokens = self.runner.on_model_thread(self._generate, ids, **kwargs)
        seconds = time.perf_counter() - started
        stats = coordinator_pb2.GenerationStats(
            rounds=len(tokens), generated_tokens=len(tokens), verify_time_s=seconds, total_time_s=seconds
        )
        return coordinator_pb2.GenerateResponse(completions=[coordinator_pb2.Completion(token_ids=tokens)], stats=stats)

    def _generate(self, ids, max_new_tokens, temperature, seed, ignore_eos, num_speculative_tokens=None):
        import torch

        torch.manual_seed(seed)
        config = copy.deepcopy(self.model.generation_config)
        config.update(max_new_tokens=max_new_tokens, pad_token_id=self.pad_id, top_k=None, top_p=None)
        config.update(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None)
        # As the engine's ignore_eos: EOS may be drawn and does not stop (min_new_tokens would forbid
        # it). No EOS ids, not None: generate fills None in from the model's defaults.
        if ignore_eos:
            config.eos_token_id = []
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=config
            )
        return out[0, len(ids) :].tolist()


@dataclass(frozen=True)
class Drafter:
    """A --drafters entry: its label in the results, the draft model spec, the lookup (hybrid) and
    the target's own lookup."""

    label: str
    model: str  # SPECDEC_DRAFT_MODEL, or the in-process pipeline's draft
    lookup: str = ""  # SPECDEC_DRAFT_LOOKUP: a model-free draft tried before the model (hybrid)
    target_lookup: str = ""  # SPECDEC_TARGET_LOOKUP: the target drafts every round itself (no draft pool)


# name -> (draft model, lookup, target's lookup); MODEL_DRAFTER stands for --draft. Adding a drafter
# is one line here. target-*: the draft service runs (model-free, unused) but the target drafts.
DRAFTERS = {
    "model": (MODEL_DRAFTER, "", ""),
    "ngram": ("ngram", "", ""),
    "suffix": ("suffix", "", ""),
    "hybrid": (MODEL_DRAFTER, "suffix", ""),
    "hybrid-ngram": (MODEL_DRAFTER, "ngram", ""),
    "target-ngram": ("ngram", "", "ngram"),
    "target-suffix": ("ngram", "", "suffix"),
}


def parse_drafter(entry: str, model_draft: str) -> Drafter:
    """A name of DRAFTERS, or LABEL=SPEC for any other draft model; ValueError for an unknown name."""
    if "=" in entry:
        label, spec = (part.strip() for part in entry.split("=", 1))
        if not label or not spec:
            raise ValueError(f"drafter {entry!r}: expected LABEL=SPEC")
        return Drafter(label, spec)
    if entry not in DRAFTERS:
        raise ValueError(f"unknown drafter {entry!r}; choose from {sorted(DRAFTERS)} or give LABEL=SPEC")
    model, lookup, target_lookup = DRAFTERS[entry]
    return Drafter(entry, model_draft if model == MODEL_DRAFTER else model, lookup, target_lookup)


@contextmanager
def open_runners(drafter: Drafter, modes: list[str], args) -> Iterator[dict]:
    """mode -> runner for one drafter: the stack started with it (unless --address), the pipeline loaded."""
    with ExitStack() as exits:
        runners = {}
        if "grpc" in modes:
            runners["grpc"] = GrpcRunner(exits.enter_context(_grpc_client(drafter, args)))
        if "in-process" in modes or HF_MODE in modes:
            from specdec.inprocess import InProcessPipeline

            # lookup only for a hybrid: other drafters keep the pipeline's own default.
            extra = {"lookup": drafter.lookup} if drafter.lookup else {}
            if drafter.target_lookup:  # (no draft to load: the target drafts)
                extra = {"draft": None, "target_lookup": drafter.target_lookup}
            # Closed with the drafter: a pipeline left open keeps its model thread's OpenMP team,
            # which throttled the next drafter's forwards (its K = 0 rounds 1.4x slower, measured).
            pipeline = exits.enter_context(InProcessPipeline(args.target, **({"draft": drafter.model} | extra)))
            if "in-process" in modes:
                runners["in-process"] = InProcessRunner(pipeline)
            if HF_MODE in modes:
                runners[HF_MODE] = HfGenerateRunner(pipeline, args.target)
        yield runners


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` for the block (the stack's services inherit it), then as it was."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pair_env(target: str, drafter: Drafter) -> dict[str, str]:
    """The services' environment that serves `target` with `drafter`."""
    return {
        "SPECDEC_TARGET_MODEL": target,
        "SPECDEC_DRAFT_MODEL": drafter.model,
        "SPECDEC_DRAFT_LOOKUP": drafter.lookup,
        "SPECDEC_TARGET_LOOKUP": drafter.target_lookup,
        "SPECDEC_DRAFT_TOKENIZER": target,  # a model-free draft's vocabulary
    }


@contextmanager
def _grpc_client(drafter: Drafter, args):
    from specdec.client import SpecdecClient

    address = args.address
    if address is None:
        env = pair_env(args.target, drafter)
        drafts = f"{drafter.model} {drafter.lookup}"
        log(f"starting the stack: target {args.target} {drafter.target_lookup}, draft {drafts}")
        with _environment(env), redirect_stdout(sys.stderr):  # stdout carries only results (--json)
            address = stack.up()["coordinator"]
    try:
        with SpecdecClient(address, timeout_s=900) as client:
            client.wait_ready(60)
            yield client
    finally:
        if args.address is None:
            with redirect_stdout(sys.stderr):
                stack.down()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ measuring


@dataclass
class Tally:
    """Sums over the calls of one (drafter, mode, workload, temperature, K)."""

    conversations: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0  # client-side wall time of the calls
    engine_s: float = 0.0  # the engine's own wall time (GenerationStats.total_time_s)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    steal_s: float = 0.0  # CPU seconds the hypervisor took from this VM during the calls
    # Per run (a conversation's calls at one repeat): (run key, tokens, seconds), so a K's runs pair
    # with K = 0's runs of the same conversation and repeat (`paired_interval`).
    runs: list = field(default_factory=list)

    def add(self, calls: list[Call], steal_s: float = 0.0, run: tuple = ()) -> None:
        self.conversations += 1
        self.steal_s += steal_s
        self.runs.append((run, sum(c.stats.generated_tokens for c in calls), sum(c.seconds for c in calls)))
        for call in calls:
            s = call.stats
            self.requests += 1
            self.tokens += s.generated_tokens
            self.seconds += call.seconds
            self.engine_s += s.total_time_s
            self.rounds += s.rounds
            self.drafted += s.drafted_tokens
            self.accepted += s.accepted_tokens
            self.draft_s += s.draft_time_s
            self.verify_s += s.verify_time_s

    def merged(self, other: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class Plan:
    conversations: list[Conversation]
    ks: list  # 0 first; ints and "auto"
    temperatures: list[float]
    max_new_tokens: int
    seed: int = 0
    repeats: int = 1
    ignore_eos: bool = False
    prompt_cache: str = "cold"  # --prompt-cache: "warm" computes each call's prompt just before it
    totals: dict = field(default_factory=dict)  # (drafter, mode, workload, temperature, k) -> Tally


def rotated(ks: list, shift: int) -> list:
    """ks in an order that changes per conversation, so no K always runs first (or right after K=0)."""
    shift %= len(ks)
    return ks[shift:] + ks[:shift]


def _request_kwargs(plan: Plan, temperature: float, k, seed: int, max_new_tokens: int) -> dict:
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "num_speculative_tokens": None if k == "auto" else k,  # unset: the coordinator's auto K
        "ignore_eos": plan.ignore_eos,
    }


def warm_up(runners: dict, plan: Plan) -> None:
    """First calls allocate caches and buffers: one short call per mode at K = 0 and the largest fixed K."""
    largest = max(k for k in plan.ks if k != "auto")
    ks = [0] + ([largest] if largest else []) + (["auto"] if "auto" in plan.ks and not largest else [])
    for runner in runners.values():
        for k in ks:
            runner.run(plan.conversations[0], **_request_kwargs(plan, plan.temperatures[0], k, plan.seed, 8))


def bench_drafter(drafter: str, runners: dict, plan: Plan) -> None:
    """Every conversation x temperature x K x mode for one drafter, interleaved; adds to plan.totals."""
    warm_up(runners, plan)
    for rep in range(plan.repeats):
        for i, conv in enumerate(plan.conversations):
            seed = plan.seed + 1000 * rep + i
            for temperature in plan.temperatures:
                for k in rotated(plan.ks, i + rep):
                    kwargs = _request_kwargs(plan, temperature, k, seed, plan.max_new_tokens)
                    for mode, runner in runners.items():
                        if mode == HF_MODE and k != 0:  # it has no K: one run beside each K = 0
                            continue
                        runner.start_alike(conv, warm=plan.prompt_cache == "warm")
                        stolen = hostinfo.steal_seconds()
                        calls = runner.run(conv, **kwargs)
                        stolen = hostinfo.steal_seconds() - stolen if stolen is not None else 0.0
                        key = (drafter, mode, conv.workload, temperature, k)
                        plan.totals.setdefault(key, Tally()).add(calls, stolen, run=(conv.name, rep))
                        tokens = sum(c.stats.generated_tokens for c in calls)
                        seconds = sum(c.seconds for c in calls)
                        drafted = sum(c.stats.drafted_tokens for c in calls)
                        accepted = sum(c.stats.accepted_tokens for c in calls)
                        acceptance = f"{accepted / drafted:.3f}" if drafted else "-"
                        log(
                            f"  {drafter} rep {rep} {conv.workload}/{conv.name} T={temperature:g} K={k} {mode}: "
                            f"{tokens} tokens, {tokens / seconds:6.2f} tok/s, acceptance {acceptance}"
                            + (f", steal {stolen / seconds / VM_CPUS:.0%}" if stolen else "")
                        )


# ------------------------------------------------------------------ results


def _per_round(seconds: float, rounds: int) -> float | None:
    return 1e3 * seconds / rounds if rounds else None


def _tokens_per_s(tally: Tally | None) -> float | None:
    return tally.tokens / tally.seconds if tally and tally.seconds else None


# Student's t at 97.5% by degrees of freedom (a two-sided 95% interval); past the table, the normal's.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
_T975 |= {12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def _t975(df: int) -> float:
    return _T975[max(d for d in _T975 if d <= df)] if df <= max(_T975) else 1.96


def paired_interval(tally: Tally, base: Tally | None) -> tuple[float, float] | None:
    """A 95% interval of the typical ratio to K = 0: the geometric mean of the runs' tokens/s over
    K = 0's run of the same conversation and repeat (Student's t over their logs). None under two
    pairs. What it says: whether the run-to-run noise of this machine (+-10% a pair here) leaves a
    row's ratio distinguishable from a target; the row's own ratio is of the summed tokens and time."""
    if base is None:
        return None
    base_runs = {run: tokens / seconds for run, tokens, seconds in base.runs if run and seconds and tokens}
    logs = [
        math.log(tokens / seconds / base_runs[run])
        for run, tokens, seconds in tally.runs
        if run in base_runs and seconds and tokens
    ]
    if len(logs) < 2:
        return None
    half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def row(key: tuple, tally: Tally, base: Tally | None, background_load: int, hf: Tally | None = None) -> dict:
    drafter, mode, workload, temperature, k = key
    tps = _tokens_per_s(tally) or 0.0
    base_tps, hf_tps = _tokens_per_s(base), _tokens_per_s(hf)
    interval = paired_interval(tally, base) if k != 0 else None
    return {
        "type": "row",
        "drafter": drafter,
        "mode": mode,
        "workload": workload,
        "temperature": temperature,
        "k": k,
        "background_load": background_load,
        "conversations": tally.conversations,
        "requests": tally.requests,
        "tokens": tally.tokens,
        "seconds": tally.seconds,
        "tokens_per_s": tps,
        "ratio_vs_k0": tps / base_tps if base_tps else None,
        # 95% interval of the runs' ratios to K = 0's runs (`paired_interval`); None under two pairs.
        "ratio_interval": list(interval) if interval else None,
        # Against HF `generate` on the same conversations (the hf-generate mode, when run).
        "ratio_vs_hf": tps / hf_tps if hf_tps else None,
        "acceptance_rate": tally.accepted / tally.drafted if tally.drafted else None,
        "tokens_per_round": tally.tokens / tally.rounds if tally.rounds else None,
        "drafted_per_round": tally.drafted / tally.rounds if tally.rounds else None,
        "rounds": tally.rounds,
        "draft_ms_per_round": _per_round(tally.draft_s, tally.rounds),
        "verify_ms_per_round": _per_round(tally.verify_s, tally.rounds),
        # The engine's wall time outside Propose and Verify calls: the non-model overhead per round.
        "other_ms_per_round": _per_round(tally.engine_s - tally.draft_s - tally.verify_s, tally.rounds),
        # Per request, outside the engine: validation, tokenisation, sessions, and gRPC in the grpc mode.
        "call_ms_per_request": 1e3 * (tally.seconds - tally.engine_s) / tally.requests if tally.requests else None,
        # Of the VM's CPU time during the calls, the share its hypervisor gave to others.
        "steal_share": tally.steal_s / (tally.seconds * VM_CPUS) if tally.seconds else None,
    }


def _ordered_keys(plan: Plan) -> list[tuple]:
    """The totals' keys grouped for reading: drafter, mode, temperature, then workload and K as given."""
    drafters = list(dict.fromkeys(key[0] for key in plan.totals))
    modes = list(dict.fromkeys(key[1] for key in plan.totals))
    names = list(dict.fromkeys(c.workload for c in plan.conversations))
    return sorted(
        plan.totals,
        key=lambda key: (
            drafters.index(key[0]),
            modes.index(key[1]),
            plan.temperatures.index(key[3]),
            names.index(key[2]),
            plan.ks.index(key[4]),
        ),
    )


def rows(plan: Plan, background_load: int) -> list[dict]:
    out = []
    for key in _ordered_keys(plan):
        drafter, mode, workload, temperature, _ = key
        base = plan.totals.get((drafter, mode, workload, temperature, 0))
        hf = plan.totals.get((drafter, HF_MODE, workload, temperature, 0))
        out.append(row(key, plan.totals[key], base, background_load, hf))
    return out


def summaries(result_rows: list[dict]) -> list[dict]:
    """Per drafter x mode x temperature x K > 0: the input-grounded mean ratio and the minimum ratio."""
    groups: dict[tuple, list[dict]] = {}
    for r in result_rows:
        if r["k"] != 0 and r["ratio_vs_k0"] is not None:
            groups.setdefault((r["drafter"], r["mode"], r["temperature"], r["k"]), []).append(r)
    out = []
    for (drafter, mode, temperature, k), group in groups.items():
        grounded = [r["ratio_vs_k0"] for r in group if r["workload"] in INPUT_GROUNDED]
        vs_hf = [r["ratio_vs_hf"] for r in group if r["workload"] in INPUT_GROUNDED and r["ratio_vs_hf"]]
        lowest = min(group, key=lambda r: r["ratio_vs_k0"])
        out.append(
            {
                "type": "summary",
                "drafter": drafter,
                "mode": mode,
                "temperature": temperature,
                "k": k,
                "background_load": group[0]["background_load"],
                "workloads": [r["workload"] for r in group],
                "grounded_mean_ratio": sum(grounded) / len(grounded) if grounded else None,
                "grounded_target": GROUNDED_TARGETS.get(temperature),
                "grounded_mean_vs_hf": sum(vs_hf) / len(vs_hf) if vs_hf else None,
                "min_ratio": lowest["ratio_vs_k0"],
                "min_ratio_workload": lowest["workload"],
                "min_ratio_interval": lowest["ratio_interval"],
                "auto_floor": AUTO_FLOOR if k == "auto" else None,
            }
        )
    return out


def target_checks(summary_rows: list[dict]) -> list[dict]:
    """The issue's targets per mode and temperature: the best model-free drafter's input-grounded
    mean (any K), and the lowest ratio auto K reached on any workload with any drafter."""
    out = []
    for mode, temperature in dict.fromkeys((s["mode"], s["temperature"]) for s in summary_rows):
        group = [s for s in summary_rows if (s["mode"], s["temperature"]) == (mode, temperature)]
        free = [s for s in group if s["drafter"] in MODEL_FREE and s["grounded_mean_ratio"] is not None]
        if free and temperature in GROUNDED_TARGETS:
            best = max(free, key=lambda s: s["grounded_mean_ratio"])
            value, goal = best["grounded_mean_ratio"], GROUNDED_TARGETS[temperature]
            out.append(_check("grounded_mean", mode, temperature, goal, value, best["drafter"], best["k"], None, None))
        if auto := [s for s in group if s["k"] == "auto"]:
            worst = min(auto, key=lambda s: s["min_ratio"])
            workload = worst["min_ratio_workload"]
            out.append(
                _check(
                    "auto_floor",
                    mode,
                    temperature,
                    AUTO_FLOOR,
                    worst["min_ratio"],
                    worst["drafter"],
                    "auto",
                    workload,
                    worst["min_ratio_interval"],
                )
            )
    return out


def _check(
    check: str, mode: str, temperature: float, goal: float, value: float, drafter: str, k, workload, interval
) -> dict:
    """One target's verdict. `resolved`: whether the value's 95% interval (None: not known) leaves the
    target on one side of it: a miss inside the interval may be the machine's noise, not a miss."""
    return {
        "type": "target",
        "check": check,
        "mode": mode,
        "temperature": temperature,
        "target": goal,
        "value": value,
        "met": value >= goal,
        "interval": interval,
        "resolved": interval is None or not interval[0] <= goal <= interval[1],
        "drafter": drafter,
        "k": k,
        "workload": workload,
    }


def pipeline_costs(totals: dict) -> list[dict]:
    """With both modes: what the distributed pipeline costs over the same engine in one process,
    per drafter x temperature x K, summed over workloads (same conversations and seeds)."""
    merged: dict[tuple, dict[str, Tally]] = {}
    for (drafter, mode, _, temperature, k), tally in totals.items():
        by_mode = merged.setdefault((drafter, temperature, k), {})
        by_mode[mode] = by_mode[mode].merged(tally) if mode in by_mode else tally
    out = []
    for (drafter, temperature, k), by_mode in merged.items():
        if not {"grpc", "in-process"} <= set(by_mode):
            continue
        grpc_t, local_t = by_mode["grpc"], by_mode["in-process"]
        out.append(
            {
                "type": "pipeline",
                "drafter": drafter,
                "temperature": temperature,
                "k": k,
                "in_process_vs_grpc": (local_t.tokens / local_t.seconds) / (grpc_t.tokens / grpc_t.seconds),
                "ms_per_round": 1e3 * (grpc_t.seconds - local_t.seconds) / grpc_t.rounds if grpc_t.rounds else None,
            }
        )
    return out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _interval(interval: list[float] | None) -> str:
    return "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}"


def format_rows(result_rows: list[dict]) -> list[str]:
    lines = []
    header = (
        f"  {'workload':<16} {'K':<4} {'tok/s':>7} {'vs K=0':>7} {'95% pairs':>11} {'vs HF':>6} {'accept':>7}"
        f" {'tok/rnd':>7} {'drft/rnd':>8} {'steal':>5} | ms/round: {'draft':>6} {'verify':>7} {'other':>6}"
    )
    group = None
    for r in result_rows:
        if (r["drafter"], r["mode"], r["temperature"]) != group:
            group = (r["drafter"], r["mode"], r["temperature"])
            lines += ["", f"drafter {r['drafter']}, {r['mode']}, T={r['temperature']:g}", header]
        lines.append(
            f"  {r['workload']:<16} {r['k']!s:<4} {r['tokens_per_s']:>7.2f} {_fmt(r['ratio_vs_k0'], '.2f', 'x'):>7} "
            f"{_interval(r['ratio_interval']):>11} "
            f"{_fmt(r['ratio_vs_hf'], '.2f', 'x'):>6} "
            f"{_fmt(r['acceptance_rate'], '.3f'):>7} {_fmt(r['tokens_per_round'], '.2f'):>7} "
            f"{_fmt(r['drafted_per_round'], '.2f'):>8} {_fmt(r['steal_share'], '.0%'):>5} | {'':>9} "
            f"{_fmt(r['draft_ms_per_round'], '.1f'):>6} "
            f"{_fmt(r['verify_ms_per_round'], '.1f'):>7} {_fmt(r['other_ms_per_round'], '.1f'):>6}"
        )
    return lines


def format_summaries(summary_rows: list[dict]) -> list[str]:
    lines = ["", "summary: ratio to K=0 (input-grounded = " + ", ".join(INPUT_GROUNDED) + ")"]
    lines.append(
        f"  {'drafter':<10} {'mode':<10} {'T':>3} {'K':<4} {'grounded mean':>13} {'target':>6} {'vs HF':>6}"
        "   min (workload)"
    )
    for s in summary_rows:
        floor = f"  (auto floor {s['auto_floor']:.2f}x)" if s["auto_floor"] else ""
        lines.append(
            f"  {s['drafter']:<10} {s['mode']:<10} {s['temperature']:>3g} {s['k']!s:<4} "
            f"{_fmt(s['grounded_mean_ratio'], '.2f', 'x'):>13} {_fmt(s['grounded_target'], '.1f', 'x'):>6} "
            f"{_fmt(s['grounded_mean_vs_hf'], '.2f', 'x'):>6}   "
            f"{s['min_ratio']:.2f}x ({s['min_ratio_workload']}){floor}"
        )
    return lines


def format_table(result: dict) -> str:
    lines = format_rows(result["rows"]) + format_summaries(result["summaries"])
    if result["targets"]:
        lines += ["", "targets (issue 11):"]
    for t in result["targets"]:
        what = "best model-free input-grounded mean" if t["check"] == "grounded_mean" else "auto K's lowest ratio"
        where = f"{t['drafter']} K={t['k']}" + (f", {t['workload']}" if t["workload"] else "")
        verdict = "met" if t["met"] else "NOT met"
        if not t["resolved"]:
            verdict += f" (not resolved: the target lies in its 95% interval, {_interval(t['interval'])})"
        lines.append(
            f"  {t['mode']:<10} T={t['temperature']:g} {what}: {t['value']:.2f}x ({where}), "
            f"target {t['target']:.2f}x: {verdict}"
        )
    if result["pipeline"]:
        lines += ["", "distributed pipeline's own cost (grpc vs in-process, same conversations and seeds):"]
        for p in result["pipeline"]:
            lines.append(
                f"  {p['drafter']:<10} T={p['temperature']:g} K={p['k']!s:<4} in-process is "
                f"{p['in_process_vs_grpc']:.2f}x the grpc mode's tokens/s; {_fmt(p['ms_per_round'], '+.1f')} ms per round"
            )
    return "\n".join(lines)


@contextmanager
def background_load(n: int, kind: str = "spin") -> Iterator[list[int]]:
    """n busy processes (one core each) for the duration; yields their pids."""
    # One thread each, so n processes load n cores, not n x BLAS threads.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", BUSY_CODE[kind]], env=env, stdin=subprocess.DEVNULL) for _ in range(n)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ------------------------------------------------------------------ command line


def parse_ks(text: str) -> list:
    """'1,auto' -> [0, 1, 'auto']: K = 0 always runs (every ratio needs it), first."""
    ks = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if item != "auto" and not item.isdigit():
            raise ValueError(f"K must be a non-negative integer or auto, got {item!r}")
        k = item if item == "auto" else int(item)
        if k not in ks:
            ks.append(k)
    return [0] + [k for k in ks if k != 0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="bench this running coordinator (grpc mode; one drafter: the one it serves)")
    p.add_argument("--target", default=os.environ.get("SPECDEC_TARGET_MODEL", stack.DEFAULT_TARGET))
    p.add_argument(
        "--matmul-dtype",
        default=os.environ.get(stack.MATMUL_DTYPE_ENV, stack.DEFAULT_MATMUL_DTYPE),
        help=f"the target's MATMUL_DTYPE, as `make run` sets it (default {stack.DEFAULT_MATMUL_DTYPE}: int8 "
        "products where the CPU and weights allow, else float32; every K of a run alike)",
    )
    p.add_argument(
        "--draft",
        default=os.environ.get("SPECDEC_DRAFT_MODEL", DISTILLED_DRAFT),
        help="the draft of the `model` drafter",
    )
    p.add_argument(
        "--drafters",
        default=None,
        help=f"comma list of {', '.join(DRAFTERS)}, or LABEL=SPEC (default {DEFAULT_DRAFTERS}; "
        "with --address: one label, default model)",
    )
    p.add_argument("--ks", default="0,1,2,4,auto", help="comma list of K (0 is always added; auto = adaptive K)")
    p.add_argument("--temperatures", default="0,1", help="comma list of temperatures (0 = greedy)")
    p.add_argument("--temperature", type=float, help="one temperature (same as --temperatures T)")
    p.add_argument(
        "--modes",
        help=f"comma list of in-process, grpc (the real stack), {HF_MODE} (the baseline: transformers' generate "
        "on the same target, in process) (default: in-process; grpc with --address)",
    )
    p.add_argument("--in-process", action="store_true", help="same as --modes in-process")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of built-in workloads")
    p.add_argument("--per-workload", type=int, default=2, help="conversations per built-in workload")
    p.add_argument(
        "--max-chars",
        type=int,
        default=workloads.DEFAULT_MAX_CHARS,
        help="longest passage of a built-in prompt, in characters (~4 per token)",
    )
    p.add_argument("--prompts", metavar="FILE", help="JSONL conversations instead of the built-in workloads")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per request (each turn of a conversation)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--prompt-cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold: in process, every call computes its prompt (a new request); warm: each call's first prompt "
        "is computed just before it, untimed (a cached system prompt or document); the grpc mode is always warm",
    )
    p.add_argument("--background-load", type=int, default=0, metavar="N", help="N busy CPU processes during the run")
    p.add_argument("--background-kind", default="spin", choices=sorted(BUSY_CODE))
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="one JSON object per row: on stdout (no table), or into FILE (table on stdout)",
    )
    return p.parse_args(argv)


def build_plan(args: argparse.Namespace, parser_error) -> tuple[Plan, list[Drafter], list[str]]:
    """(plan, drafters, modes) from the arguments; parser_error for anything wrong."""
    default_mode = "grpc" if args.address else "in-process"
    modes = ["in-process"] if args.in_process else [m.strip() for m in (args.modes or default_mode).split(",")]
    if unknown := sorted(set(modes) - set(MODES)):
        parser_error(f"unknown modes {unknown}; choose from {list(MODES)}")
    entries = [d.strip() for d in (args.drafters or (MODEL_DRAFTER if args.address else DEFAULT_DRAFTERS)).split(",")]
    if args.address and len(entries) != 1:
        parser_error("--address benches the one drafter that stack serves: give one --drafters label")
    try:
        drafters = [parse_drafter(entry, args.draft) for entry in entries if entry]
        ks = parse_ks(args.ks)
        temps = [args.temperature] if args.temperature is not None else [float(t) for t in args.temperatures.split(",")]
        if args.prompts:
            conversations = workloads.load_prompts(args.prompts)
        else:
            names = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
            conversations = workloads.build_workloads(names, args.per_workload, args.max_chars)
    except ValueError as exc:  # PromptFileError included
        parser_error(str(exc))
    if args.prompt_cache == "warm" and HF_MODE in modes:
        parser_error(f"--prompt-cache warm: {HF_MODE} computes every prompt, so its ratios would not compare")
    plan = Plan(
        conversations, ks, temps, args.max_new_tokens, args.seed, args.repeats, args.ignore_eos, args.prompt_cache
    )
    return plan, drafters, modes


def run(args: argparse.Namespace, plan: Plan, drafters: list[Drafter], modes: list[str]) -> dict:
    with background_load(args.background_load, args.background_kind) as busy:
        if busy:
            log(f"background load: {len(busy)} {args.background_kind} processes (pids {busy})")
        for drafter in drafters:
            with open_runners(drafter, modes, args) as runners:
                bench_drafter(drafter.label, runners, plan)
    result_rows = rows(plan, args.background_load)
    summary_rows = summaries(result_rows)
    return {
        "rows": result_rows,
        "summaries": summary_rows,
        "targets": target_checks(summary_rows),
        "pipeline": pipeline_costs(plan.totals),
    }


def run_info(args: argparse.Namespace, plan: Plan, drafters: list[Drafter], modes: list[str]) -> dict:
    return {
        "type": "run",
        "target": args.target,
        "matmul_dtype": args.matmul_dtype,
        "drafters": {
            d.label: {"model": d.model, "lookup": d.lookup, "target_lookup": d.target_lookup} for d in drafters
        },
        "modes": modes,
        "ks": plan.ks,
        "temperatures": plan.temperatures,
        "max_new_tokens": plan.max_new_tokens,
        "ignore_eos": plan.ignore_eos,
        "prompt_cache": plan.prompt_cache,
        "repeats": plan.repeats,
        "conversations": len(plan.conversations),
        "prompts": args.prompts,
        "background_load": args.background_load,
        **hostinfo.describe(),  # cpus, cpu, isa
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def error(message: str):
        raise SystemExit(f"bench.py: error: {message}")

    plan, drafters, modes = build_plan(args, error)
    os.environ[stack.MATMUL_DTYPE_ENV] = args.matmul_dtype  # the in-process target and any stack started
    set_openmp_defaults()  # before torch loads (the in-process mode loads it here, as the services do)
    result = run(args, plan, drafters, modes)
    objects = [run_info(args, plan, drafters, modes)]
    objects += [*result["rows"], *result["summaries"], *result["targets"], *result["pipeline"]]
    if args.json == "-":
        for obj in objects:
            print(json.dumps(obj), flush=True)
        return 0
    if args.json:
        Path(args.json).write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    info = objects[0]
    print(
        f"\n{info['conversations']} conversations x {plan.repeats}, up to {plan.max_new_tokens} tokens per turn, "
        f"chat template, prompts {plan.prompt_cache}, target {args.target} (MATMUL_DTYPE {args.matmul_dtype}), "
        f"{hostinfo.summary(info)}, "
        f"background load {args.background_load}"
    )
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
