"""What the two model services (draft and target) share: settings, model loading, `ModelInfo`,
request validation, and a server that reports SERVING once its model has loaded."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc

from specdec.core.errors import Cancelled, DeadlineExceeded, InvalidArgument, Unavailable
from specdec.core.protocols import MAX_DECODE_STEPS, Deadline
from specdec.models.layouts import AUTO, LAYOUTS
from specdec.rpc.logs import check_log_format
from specdec.rpc.metrics import STEP_SEQUENCES_BUCKETS, Registry
from specdec.rpc.server import GrpcServer, build_grpc_server, configure_observability
from specdec.rpc.tls import ServerTlsSettings, TlsFiles
from specdec.settings import setting
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

MATMUL_DTYPES = ("float32", "bfloat16", "int8", "auto")
KV_CACHE_DTYPES = ("float32", "float16", "auto")


@dataclass(frozen=True)
class ModelServerSettings(ServerTlsSettings):
    """Settings of a model service (draft or target)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_MODEL_"

    host: str = setting("0.0.0.0", "HOST", "address to bind")
    port: int = setting(50052, "PORT", "gRPC port (0 = any free port)")
    metrics_port: int = setting(9102, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    model: str = setting("smollm2-135m-instruct", "MODEL", "packaged short name, GGUF file, HF directory or hub id")
    dtype: str = setting(
        "float32",
        "DTYPE",
        "float32 | bfloat16 | float16 (a 16-bit CPU model's Verify and decodes differ; MATMUL_DTYPE keeps it exact)",
    )
    device: str = setting("cpu", "DEVICE", "cpu | cuda | cuda:N | auto")
    cache_max_entries: int = setting(64, "CACHE_MAX_ENTRIES", "KV cache: most sessions kept (LRU)")
    # SmolLM2-135M keeps 46 KB of keys/values per token in fp32: 32768 tokens is ~1.5 GB.
    cache_max_tokens: int = setting(32768, "CACHE_MAX_TOKENS", "KV cache: most tokens kept over all sessions")
    max_draft_tokens: int = setting(32, "MAX_DRAFT_TOKENS", "largest K accepted per request")
    max_batch_sequences: int = setting(8192, "MAX_BATCH_SEQUENCES", "most sequences in one request")
    max_workers: int = setting(64, "MAX_WORKERS", "gRPC worker threads")
    # An admitted call is a thread blocked on the scheduler, whose batched steps gain throughput
    # with company (SmolLM2-135M on 2 cores: 17.5 / 41 / 53 tokens/s at 1 / 8 / 16 sessions).
    # At least the coordinator's MAX_CONCURRENT_REQUESTS, so one coordinator's streams are never refused.
    max_concurrent_requests: int = setting(
        48, "MAX_CONCURRENT_REQUESTS", "calls admitted at once; more get RESOURCE_EXHAUSTED (keep < max_workers)"
    )
    # Iteration-level batching (specdec.models.scheduler): the sequences of concurrent calls share steps.
    batch_wait_ms: float = setting(
        2.0, "BATCH_WAIT_MS", "longest a call waits from its arrival for sessions due soon to share a step (0 = never)"
    )
    batch_wait_share: float = setting(
        1.0, "BATCH_WAIT_SHARE", "... and after a step, at most this share of a usual step's time (in [0, 1])"
    )
    max_batch_tokens: int = setting(
        2048, "MAX_BATCH_TOKENS", "most new tokens in one batched step (a larger single sequence runs alone)"
    )
    prefill_chunk_tokens: int = setting(
        512, "PREFILL_CHUNK_TOKENS", "a prompt's new tokens past this many run over several steps (0 = never split)"
    )
    max_queued_sequences: int = setting(
        16384,
        "MAX_QUEUED_SEQUENCES",
        "sequences admitted and not finished; more get RESOURCE_EXHAUSTED (>= max_batch_sequences)",
    )
    max_message_mb: int = setting(256, "MAX_MESSAGE_MB", "largest gRPC message, MiB")
    max_connection_age_s: float = setting(
        300.0, "MAX_CONNECTION_AGE_S", "close client connections after this age so new pods get traffic (0 = never)"
    )
    torch_threads: int = setting(
        0, "TORCH_THREADS", "torch intra-op threads (0 = measured per forward, up to the CPUs this process may use)"
    )
    linear_layout: str = setting(
        "auto",
        "LINEAR_LAYOUT",
        "float32 on CPU: matmul kernel of the linear layers, auto (the fastest per row count, measured at "
        "start) | linear | transposed (2x weight memory) | weight_major | packed (oneDNN, 2x weight memory) "
        "| panels (a compiled kernel, x86-64, 2x weight memory)",
    )
    # specdec.models.bf16_matmul: AMX multiplies bfloat16 several times faster than float32 past a few rows.
    matmul_dtype: str = setting(
        "float32",
        "MATMUL_DTYPE",
        "float32 models on CPU: bfloat16 = the decoder layers' linear products in bfloat16 (for CPUs with AMX; "
        "each position computed as a one-token decode computes it, so the law stays exact) | int8 = every "
        "product of a 4- or 8-bit (GGUF) weight with its rows rounded to 8-bit blocks, llama.cpp's arithmetic "
        "(AVX2, faster with AVX-512 VNNI; another model's numerics, ~2-3x cheaper rows) | auto = int8 where the CPU and the "
        "weights allow it, else float32 | float32",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV_CACHE_DTYPE",
        "what session caches store: float16 = keys/values rounded to float16 (half the memory a cached token "
        "takes and half what attention reads a step; needs the compiled CPU kernels) | auto = float16 with int8 "
        "products (already another model's numerics), else float32 | float32 = as the model computes them",
    )
    calibrate_max_rows: int = setting(
        9, "CALIBRATE_MAX_ROWS", "measure forwards of 1..N new rows at start (ModelInfo.forward_cost_ms; 0 = skip)"
    )
    start_lock: str = setting(
        "",
        "START_LOCK",
        "a file the services of one host lock while each loads and measures its model, one at a time (a curve "
        "measured beside another's loading is the contention's: a 1 ms draft forward read 35-62 ms); '' = none",
    )
    # specdec.models.static_runner: the eager forward is launch-bound on a GPU (a draft costs ~0.9 of its target).
    compile: str = setting(
        "auto",
        "COMPILE",
        "cached forwards on a static KV cache with torch.compile (CUDA graphs on CUDA): auto (on with CUDA) | on | off",
    )
    static_cache_len: int = setting(
        4096, "STATIC_CACHE_LEN", "compile: positions of the static KV cache (longer sequences run eagerly)"
    )
    grace_s: float = setting(10.0, "GRACE_S", "seconds to drain in-flight calls on SIGTERM")
    log_level: str = setting("info", "LOG_LEVEL", "logging level")
    log_format: str = setting("text", "LOG_FORMAT", "log lines: text | json (with request, session and trace ids)")
    otlp_endpoint: str = setting(
        "",
        "OTLP_ENDPOINT",
        "OpenTelemetry traces to this OTLP gRPC collector, e.g. http://otel-collector:4317 ('' = off)",
    )

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.linear_layout not in (AUTO, *LAYOUTS):
            raise ValueError(f"linear_layout must be auto or one of {', '.join(LAYOUTS)}, got {self.linear_layout!r}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {', '.join(MATMUL_DTYPES)}, got {self.matmul_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.matmul_dtype in ("bfloat16", "int8") and self.compile == "on":
            raise ValueError(f"matmul_dtype {self.matmul_dtype} runs eagerly: set compile to off or auto")
        if not 0 <= self.calibrate_max_rows <= 64:
            raise ValueError(f"calibrate_max_rows must be in [0, 64], got {self.calibrate_max_rows}")
        if self.compile not in ("auto", "on", "off") or self.static_cache_len < 1:
            raise ValueError(f"compile must be auto, on or off (got {self.compile!r}) and static_cache_len >= 1")
        if self.max_draft_tokens < 1 or self.max_batch_sequences < 1 or self.max_workers < 1:
            raise ValueError("max_draft_tokens, max_batch_sequences and max_workers must be >= 1")
        if not 0 <= self.batch_wait_ms <= 1000 or not 0 <= self.batch_wait_share <= 1 or self.max_batch_tokens < 1:
            raise ValueError("batch_wait_ms must be in [0, 1000], batch_wait_share in [0, 1] and max_batch_tokens >= 1")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        if self.max_queued_sequences < self.max_batch_sequences:
            raise ValueError("max_queued_sequences must be >= max_batch_sequences: every valid call must fit")
        if not 1 <= self.max_concurrent_requests < self.max_workers:
            raise ValueError("max_concurrent_requests must be in [1, max_workers): health probes need a free thread")
        self.validate_tls()
        check_log_format(self.log_format)


def model_info_proto(runner, source, tokenizer, role: str, dtype: str, device: str) -> common_pb2.ModelInfo:
    from specdec.models.loading import eos_token_ids
    from specdec.models.sources import tokenizer_fingerprint

    return common_pb2.ModelInfo(
        model_id=source.spec,
        vocab_size=runner.vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        eos_token_ids=eos_token_ids(runner.model, tokenizer),
        dtype=dtype,
        device=str(runner.device),
        max_position_embeddings=runner.max_positions,
        role=role,
        hidden_size=runner.hidden_size,
        needs_target_hidden_states=runner.needs_target_hidden,
        max_decode_steps=MAX_DECODE_STEPS if role == "target" else 0,
    )


def model_free_info(tokenizer, model_id: str) -> common_pb2.ModelInfo:
    """Info of a draft without a model: the vocabulary, EOS ids and fingerprint of the target's
    tokenizer (its proposals are ids of that vocabulary), no position limit, no hidden states."""
    from specdec.models.sources import tokenizer_fingerprint

    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return common_pb2.ModelInfo(
        model_id=model_id,
        vocab_size=len(tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        eos_token_ids=eos,
        dtype="",
        device="cpu",
        max_position_embeddings=0,  # no position limit of its own
        role="draft",
        hidden_size=0,
        needs_target_hidden_states=False,
    )


def validate_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    for token in token_ids:
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{what} contains token id {token}, outside [0, {vocab_size})")


def validate_sequence_count(count: int, limit: int) -> None:
    if count < 1:
        raise InvalidArgument("request has no sequences")
    if count > limit:
        raise InvalidArgument(f"request has {count} sequences, the limit is {limit}")


def validate_length(total: int, max_positions: int) -> None:
    if max_positions and total > max_positions:
        raise InvalidArgument(f"sequence of {total} tokens exceeds the model's {max_positions} positions")


# A key names a cache entry the service keeps (KV cache, hidden rows): the coordinator's are 32
# hex digits (a session id) or 16; a longer one would only grow the service's memory.
MAX_KEY_BYTES = 128


def validate_key(key: str, what: str) -> None:
    """INVALID_ARGUMENT when a cache key (cache_key, hidden_states_key) is over MAX_KEY_BYTES."""
    # Characters first: a long key is refused before it is encoded.
    if len(key) > MAX_KEY_BYTES or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidArgument(f"{what} is longer than the limit of {MAX_KEY_BYTES} bytes ({len(key)} characters)")


@dataclass(frozen=True)
class CallDeadline(Deadline):
    """A model call's Deadline that also ends when its caller has gone (cancelled, or past its
    deadline): checked before a queued call's forward runs and between forwards, so a service
    never computes what nobody will read."""

    context: object = None  # grpc.ServicerContext

    @classmethod
    def of(cls, context) -> CallDeadline:
        remaining = context.time_remaining()
        at = None if remaining is None or remaining > 1e8 else time.monotonic() + remaining
        return cls(at, context)

    def check(self) -> None:
        super().check()  # DeadlineExceeded once the caller's deadline has passed
        if not self.context.is_active():
            remaining = self.context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("the caller's deadline passed")
            raise Cancelled("the caller cancelled the call")


@dataclass(frozen=True)
class LoadedModel:
    runner: "ModelRunner"  # noqa: F821 - imported lazily (torch)
    info: common_pb2.ModelInfo


def load_model(settings: ModelServerSettings, role: str) -> LoadedModel:
    """Load the model, its tokenizer (for the fingerprint) and wrap them in a cached runner whose
    matmul layouts and forward costs were measured (`specdec.models.calibration`).

    Call it on a thread set to one torch thread (`threads.set_torch_threads(1)`) before its first
    torch op: an OpenMP team of the loading thread's lives until that thread ends, and beside the
    model thread's it throttles every parallel region (`openmp_env`), so the layouts and the curve
    measured here were a throttled forward's (SmolLM2 on an AMX Xeon: 1 row 52-56 ms at start
    against 32 ms once loaded, 4 rows 1.21x a row against 1.38x; the K policy read that curve).
    With `start_lock` set, it waits for the other services of the host to finish theirs first."""
    with one_start_at_a_time(settings.start_lock):
        return _load_model(settings, role)


@contextlib.contextmanager
def one_start_at_a_time(path: str):
    """Hold an exclusive lock on `path` ('' = none): services on one host load and measure their
    models one at a time. The kernel frees it when a holder dies, so a crashed start blocks nobody."""
    if not path:
        yield
        return
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        if not _try_lock(handle, fcntl):
            log.info("waiting for %s: another service on this host is loading its model", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _try_lock(handle, fcntl) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _load_model(settings: ModelServerSettings, role: str) -> LoadedModel:
    import torch

    from specdec.models.bf16_matmul import use_bf16_forwards
    from specdec.models.calibration import plan_layouts
    from specdec.models.cpu_layout import round_to_q8_blocks
    from specdec.models.loading import load_causal_lm
    from specdec.models.openmp_env import available_cpus
    from specdec.models.runner import SessionKVCache
    from specdec.models.scheduler import scheduler_for
    from specdec.models.sources import load_tokenizer
    from specdec.models.static_runner import make_runner
    from specdec.models.threads import ThreadGovernor, set_torch_threads, thread_candidates

    model, source = load_causal_lm(settings.model, settings.dtype, settings.device)
    if role == "target" and settings.dtype != "float32" and next(model.parameters()).device.type == "cpu":
        # specdec.models.bf16_matmul: rounding every op to 16 bits makes kernel-order noise visible.
        # (A draft's numerics never matter: it samples from the very q it sends.)
        log.warning(
            "%s runs in %s: a Verify's rows and one-token decodes of the same positions then differ "
            "(SmolLM2 in bfloat16: next-token laws up to TV 7.7e-2 apart), so speculation's output law is "
            "only near the target's; MATMUL_DTYPE=bfloat16 keeps it exact",
            role,
            settings.dtype,
        )
    tokenizer = load_tokenizer(settings.model)
    cache = SessionKVCache(settings.cache_max_entries, settings.cache_max_tokens)
    # Static cache + compiled forwards where settings.compile says so (auto: on CUDA); compiled
    # lazily, so the calibration below compiles the buckets it measures (a warm-up on CUDA).
    runner = make_runner(model, cache, settings.compile, settings.static_cache_len)
    threads = settings.torch_threads or available_cpus()
    runner.on_model_thread(set_torch_threads, threads)  # OpenMP reads it per calling thread
    matmul_dtype = ""
    if bf16_matmuls_wanted(settings.matmul_dtype, runner):
        block = runner.on_model_thread(use_bf16_forwards, runner, role == "target")
        matmul_dtype = "bfloat16" if block else ""
        log.info("%s decoder linears in bfloat16, rows in blocks of %d", role, block)
    int8 = int8_matmuls_wanted(settings.matmul_dtype, runner)
    if int8 and role == "draft":
        # A draft samples from the very q it sends: weights in 8-bit blocks change which q, never
        # the output law, and its forward reads a quarter of the bytes.
        rounded = runner.on_model_thread(round_to_q8_blocks, runner.model)
        log.info("draft: %d float32 linears rounded to 8-bit blocks for int8 products", rounded)
    costs = plan_layouts(
        runner,
        settings.linear_layout,
        settings.calibrate_max_rows,
        int8=int8,
        before_measuring=lambda: use_kv_cache_dtype(runner, settings.kv_cache_dtype, role),
    )
    if int8 and (count := int8_linears(runner.model, required=settings.matmul_dtype == "int8")):
        matmul_dtype = "int8"
        log.info("%s: %d linears multiply int8 rows (MATMUL_DTYPE %s)", role, count, settings.matmul_dtype)
    if not settings.torch_threads and runner.device.type == "cpu":
        runner.governor = ThreadGovernor(thread_candidates(threads), set_torch_threads, torch.get_num_threads)
        for rows, seconds in enumerate(costs.seconds if costs is not None else (), start=1):
            runner.governor.seed(rows, threads, seconds)  # measured at `threads`, warm
    info = model_info_proto(runner, source, tokenizer, role, settings.dtype, settings.device)
    info.matmul_dtype = matmul_dtype
    if costs is not None:
        info.forward_cost_ms.extend(costs.milliseconds())
        scheduler_for(runner).draft_rows.use_curve(costs.seconds)  # (what a drafted row costs a step)
        log.info("%s forward ms by rows: %s; layouts by rows: %s", role, costs.milliseconds(), costs.describe())
    return LoadedModel(runner, info)


def bf16_matmuls_wanted(setting: str, runner) -> bool:
    """Whether a service's MATMUL_DTYPE setting swaps `runner`'s linears (`specdec.models.bf16_matmul`);
    bfloat16 needs a float32 model running eagerly on CPU (a compiled graph chooses its own kernels)
    and oneDNN's bfloat16."""
    import torch

    from specdec.models.bf16_matmul import amx_available, bf16_supported
    from specdec.models.runner import ModelRunner

    if setting != "bfloat16":
        return False
    if not (
        type(runner) is ModelRunner
        and runner.device.type == "cpu"
        and next(runner.model.parameters()).dtype == torch.float32
    ):
        raise ValueError("matmul_dtype bfloat16 needs a float32 model running eagerly on CPU")
    if not bf16_supported():
        raise ValueError("matmul_dtype bfloat16: this torch build has no oneDNN bfloat16 matmul on this CPU")
    if not amx_available():
        # Measured on an AVX-512 EPYC with avx512_bf16: within noise of float32 (docs/performance.md, bfloat16 products).
        log.warning("matmul_dtype bfloat16 on a CPU without AMX tiles: expect no gain over float32")
    return True


def use_kv_cache_dtype(runner, setting: str, role: str) -> None:
    """Applies a service's KV_CACHE_DTYPE to its runner (once its linears are planned). auto:
    float16 where the linears multiply int8 rows (the model's numerics are llama.cpp's already) and
    the compiled kernels attend, else float32. A target with float16 caches also runs uncached
    sequences through them (not left-padded in transformers' forward, whose attention would read
    unrounded keys), so every law it sends is computed one way."""
    import torch

    half = setting == "float16" or (
        setting == "auto" and runner.fuses_layers() and int8_linears(runner.model, required=False) > 0
    )
    runner.store_caches_as(torch.float16 if half else None)  # None: as the model computes them
    if half and role == "target":
        runner.pads_uncached = False
    log.info("%s KV caches in %s (KV_CACHE_DTYPE %s)", role, "float16" if half else "float32", setting)


def int8_matmuls_wanted(setting: str, runner) -> bool:
    """Whether a service's MATMUL_DTYPE setting asks for int8 products (kernels/int8.cpp) here: they
    need a float32 model running eagerly on a CPU with AVX2 (int8 without them is a
    ValueError; auto then means float32)."""
    import torch

    from specdec.models import panels
    from specdec.models.runner import ModelRunner

    if setting not in ("int8", "auto"):
        return False
    eager_cpu = (
        type(runner) is ModelRunner
        and runner.device.type == "cpu"
        and next(runner.model.parameters()).dtype == torch.float32
    )
    if setting == "auto":
        return eager_cpu and panels.int8_available()
    if not eager_cpu:
        raise ValueError("matmul_dtype int8 needs a float32 model running eagerly on CPU")
    if not panels.int8_available():
        raise ValueError("matmul_dtype int8 needs a CPU with AVX2 and the compiled kernels (see the log)")
    return True


def int8_linears(model, required: bool = True) -> int:
    """How many of model's linears multiply int8 rows; a ValueError when `required` and none can
    (no weight is 4- or 8-bit blocks)."""
    from specdec.models.cpu_layout import PlannedLinear

    count = sum(1 for m in model.modules() if isinstance(m, PlannedLinear) and m.int8)
    if count == 0 and required:
        raise ValueError("matmul_dtype int8 needs weights that are 4- or 8-bit blocks (GGUF Q4_1 / Q8_0): none here")
    return count


class ModelServicerBase:
    """Holds the model once loaded; calls before that get UNAVAILABLE, not a hang."""

    role = "model"

    def __init__(self, settings: ModelServerSettings):
        self.settings = settings
        self._loaded: LoadedModel | None = None

    def attach(self, loaded: LoadedModel) -> None:
        self._loaded = loaded

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise Unavailable(f"{self.role} model is still loading")
        return self._loaded


def observe_kv_cache(registry: Registry, cache, role: str) -> None:
    """KV-cache counters and gauges, read from the cache at scrape time."""
    labels = {"service": role}
    registry.observe(
        "specdec_kv_cache_hits_total", "KV cache lookups that reused keys/values", "counter", labels, lambda: cache.hits
    )
    registry.observe(
        "specdec_kv_cache_misses_total", "KV cache lookups that recomputed", "counter", labels, lambda: cache.misses
    )
    registry.observe("specdec_kv_cache_sessions", "sessions held in the KV cache", "gauge", labels, lambda: len(cache))
    registry.observe(
        "specdec_kv_cache_tokens", "tokens held in the KV cache", "gauge", labels, lambda: cache.total_tokens
    )


def scheduler_limits(settings: ModelServerSettings):
    from specdec.models.scheduler import SchedulerLimits

    return SchedulerLimits(
        batch_wait_s=settings.batch_wait_ms / 1000,
        batch_wait_share=settings.batch_wait_share,
        max_batch_tokens=settings.max_batch_tokens,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        max_queued_sequences=settings.max_queued_sequences,
    )


def observe_scheduler(registry: Registry, scheduler, role: str) -> None:
    """What the model's batched steps carried, read from its scheduler at scrape time."""
    labels, stats = {"service": role}, scheduler.stats
    registry.observe("specdec_steps_total", "batched model steps run", "counter", labels, lambda: stats.steps)
    registry.observe(
        "specdec_shared_steps_total", "steps that served more than one call", "counter", labels, lambda: stats.shared
    )
    registry.observe(
        "specdec_draft_rows_cut_total",
        "drafted rows of auto K's rounds a shared step left out, their expected tokens not worth their cost",
        "counter",
        labels,
        lambda: scheduler.draft_rows.cut,
    )
    registry.observe(
        "specdec_queued_sequences",
        "sequences admitted to the scheduler and not finished",
        "gauge",
        labels,
        lambda: scheduler.queued,
    )
    seconds = registry.histogram("specdec_step_seconds", "seconds of one batched model step", ("service",))
    sequences = registry.histogram(
        "specdec_step_sequences", "sequences one batched model step carried", ("service",), STEP_SEQUENCES_BUCKETS
    )
    seconds, sequences = seconds.labels(service=role), sequences.labels(service=role)

    def observe(count: int, step_s: float) -> None:
        seconds.observe(step_s)
        sequences.observe(count)

    scheduler.step_observers.append(observe)


# On SIGTERM the admitted calls get the drain's grace less this to finish; the rest then fail with
# UNAVAILABLE and a reason (the coordinator retries them elsewhere) before gRPC cancels them.
CLOSE_MARGIN_S = 0.5


def close_on_stop(grpc_server: GrpcServer, scheduler, grace_s: float) -> threading.Thread:
    """A thread that closes the model's scheduler once a stop is requested (SIGTERM): when its
    admitted calls have drained, or CLOSE_MARGIN_S before the grace period ends. It ends, closing
    nothing, when the server stops without a request (tests stop servers sharing a model)."""

    def watch() -> None:
        while not grpc_server.stop_requested.is_set():
            if not grpc_server.server.wait_for_termination(0.25):  # False: it has terminated
                return
        drain_until = time.monotonic() + max(0.0, grace_s - CLOSE_MARGIN_S)
        while scheduler.queued and time.monotonic() < drain_until:
            time.sleep(0.05)
        left = scheduler.queued
        stopped = scheduler.close()
        if stopped:  # nothing of the scheduler's is queued on the model thread any more
            scheduler.runner.close()
        log.info(
            "model scheduler closed (%d sequences failed UNAVAILABLE; model thread %s)",
            left,
            "free" if stopped else "still busy",
        )

    thread = threading.Thread(target=watch, name="scheduler-close", daemon=True)
    thread.start()
    grpc_server.closers.append(thread)
    return thread


def start_model_server(
    settings: ModelServerSettings,
    servicer: ModelServicerBase,
    register: Callable[[grpc.Server], None],
    service_name: str,
    loaded: LoadedModel | None,
    load: Callable[[], LoadedModel] | None = None,
) -> GrpcServer:
    """Start serving at once (health NOT_SERVING); SERVING once the model is attached.

    With `loaded` given (tests) that is immediate; otherwise the model loads in
    a background thread (`load`, by default `load_model`) and a failure to load stops
    the server, so the process exits instead of hanging unhealthy. A model-free draft
    attaches an object with `info` and `runner=None`: it has no KV cache to observe.
    """
    configure_observability(f"specdec-{servicer.role}", settings)
    grpc_server = build_grpc_server(
        settings.host,
        settings.port,
        settings.max_workers,
        settings.max_message_mb,
        register,
        [service_name],
        metrics_label=servicer.role,
        metrics_port=settings.metrics_port,
        max_connection_age_s=settings.max_connection_age_s,
        max_concurrent_requests=settings.max_concurrent_requests,
        tls=TlsFiles.from_settings(settings),
    )
    grpc_server.server.start()

    def attach(model: LoadedModel) -> None:
        servicer.attach(model)
        if model.runner is not None:
            from specdec.models.scheduler import scheduler_for

            observe_kv_cache(grpc_server.registry, model.runner.cache, servicer.role)
            # One scheduler per model, made here with this service's limits (or found, if
            # another server in this process already serves the model: tests).
            scheduler = scheduler_for(model.runner, scheduler_limits(settings))
            observe_scheduler(grpc_server.registry, scheduler, servicer.role)
            close_on_stop(grpc_server, scheduler, settings.grace_s)
        grpc_server.set_serving(True)
        log.info("%s model %s loaded; serving on port %d", servicer.role, model.info.model_id, grpc_server.port)

    if loaded is not None:
        attach(loaded)
    else:

        def load_in_background() -> None:
            from specdec.models.threads import set_torch_threads

            set_torch_threads(1)  # no OpenMP team of this thread's beside the model thread's (`load_model`)
            try:
                attach(load() if load is not None else load_model(settings, servicer.role))
            except Exception:
                log.exception("loading the %s model failed; stopping", servicer.role)
                grpc_server.failed = True
                grpc_server.stop_requested.set()

        threading.Thread(target=load_in_background, name="model-loader", daemon=True).start()
    return grpc_server
