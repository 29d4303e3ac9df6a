from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.core.lookup import LookupSettings
from specdec.core.protocols import MAX_DECODE_STEPS, MAX_STOP_NGRAM
from specdec.rpc.logs import check_log_format
from specdec.rpc.server import MIN_KEEPALIVE_S
from specdec.rpc.tls import ServerTlsSettings
from specdec.settings import setting


@dataclass(frozen=True)
class CoordinatorSettings(LookupSettings, ServerTlsSettings):
    """Coordinator settings (flags, or SPECDEC_COORDINATOR_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_COORDINATOR_"
    DEFAULT_PORT: ClassVar[int] = 50051

    host: str = setting("0.0.0.0", "HOST", "address to bind")
    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    metrics_port: int = setting(9101, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    draft_address: str = setting(
        "localhost:50052", "DRAFT_ADDRESS", "draft service: host:port, a comma list, or a gRPC target (dns:///...)"
    )
    # A Propose through the draft pool cost 1.4-1.7 ms of round trip for a lookup that takes
    # microseconds (README "Configuration"); here the engine asks the lookup directly.
    local_draft: str = setting(
        "",
        "LOCAL_DRAFT",
        "run a lookup draft here instead of asking the draft pool: '' (the pool), ngram or suffix "
        "(configured by this service's NGRAM_* / SUFFIX_* settings)",
    )
    target_address: str = setting(
        "localhost:50053", "TARGET_ADDRESS", "target service: host:port, a comma list, or a gRPC target (dns:///...)"
    )
    redis_url: str = setting("redis://localhost:6379/0", "REDIS_URL", "Redis holding the sessions")
    tokenizer: str = setting("smollm2-135m-instruct", "TOKENIZER", "the target's tokenizer: same forms as a model spec")
    session_ttl_s: int = setting(86400, "SESSION_TTL_S", "seconds a session lives after its last update")
    session_lock_ttl_s: int = setting(
        6,
        "SESSION_LOCK_TTL_S",
        "lease of a session lock: renewed every third of it while a call runs, released on exit",
    )
    # A stream's session is saved after a round is sent once this long has passed since its last save
    # (and always when it ends or fails): one Redis write a round cost ~0.3-0.5 ms of a ~12 ms token
    # on the critical path. What a coordinator crash can lose: at most this long of rounds, which
    # the resumed stream sends again (README "Sessions").
    session_save_interval_s: float = setting(
        0.1,
        "SESSION_SAVE_INTERVAL_S",
        "a stream saves its session at most this often, and when it ends or fails (0 = every round)",
    )
    session_key_prefix: str = setting("specdec:v1", "SESSION_KEY_PREFIX", "Redis key prefix")
    # Per call, much shorter than a request's: a hung replica costs one timeout, then the call is
    # retried on another (Propose and Verify are pure functions of the request).
    draft_timeout_s: float = setting(5.0, "DRAFT_TIMEOUT_S", "deadline of one Propose attempt")
    verify_timeout_s: float = setting(20.0, "VERIFY_TIMEOUT_S", "deadline of one Verify attempt")
    verify_batch_wait_ms: float = setting(
        4.0,
        "VERIFY_BATCH_WAIT_MS",
        "longest a request's Verify waits for the other requests' to go to the target pool as one call of "
        "at most SAMPLE_BATCH_SIZE sequences (specdec.core.call_batching; 0 = each alone)",
    )
    # A K = 0 round through the services cost its step plus ~3.5 ms of round trip here (README,
    # "Decode steps"); the target samples a stretch of them itself, from the same uniforms.
    decode_steps: int = setting(
        4,
        "DECODE_STEPS",
        "K = 0 rounds the target may run in one Verify call, sampling each token from the uniforms this "
        "coordinator draws (the same tokens; tokens then stream in groups of up to this many; 1 = a call a token)",
    )
    # A round whose lookup draft found nothing cost a Verify of its own (a round trip, for one token);
    # as decode steps it runs on until a lookup could match again, and the next round drafts there.
    decode_stop_ngram: int = setting(
        2,
        "DECODE_STOP_NGRAM",
        "after a round whose draft proposed nothing, decode steps run until the last N tokens occur earlier "
        "in the sequence (where a lookup draft matches; 0 = such a round is a Verify of its own)",
    )
    info_timeout_s: float = setting(5.0, "INFO_TIMEOUT_S", "deadline of one Info call")
    call_attempts: int = setting(
        3, "CALL_ATTEMPTS", "attempts of one Propose / Verify after UNAVAILABLE, a timeout or a pod at capacity"
    )
    keepalive_s: float = setting(10.0, "KEEPALIVE_S", "HTTP/2 keepalive ping interval on pool channels (0 = off)")
    draft_backoff_s: float = setting(
        30.0,
        "DRAFT_BACKOFF_S",
        "after a failed Propose, rounds run at K=0 (still lossless) for this long before the draft is tried again",
    )
    pool_info_refresh_s: float = setting(
        60.0, "POOL_INFO_REFRESH_S", "seconds between refreshes of the pools' ModelInfo (in the background)"
    )
    pool_tls_ca_file: str = setting(
        "", "POOL_TLS_CA_FILE", "CA of the draft and target pools' certificates (set = TLS to the pools)"
    )
    pool_tls_cert_file: str = setting(
        "", "POOL_TLS_CERT_FILE", "client certificate shown to the pools (mutual TLS; empty = none)"
    )
    pool_tls_key_file: str = setting("", "POOL_TLS_KEY_FILE", "PEM private key of pool_tls_cert_file")
    api_keys_file: str = setting(
        "",
        "API_KEYS_FILE",
        "one 'key [tenant]' per line; calls need 'authorization: Bearer <key>' (empty = no authentication)",
    )
    # "auto": each request chooses K per round from its own measured acceptance and costs
    # (specdec/core/kpolicy.py), up to max K; an integer string fixes it (README "Configuration").
    default_num_speculative_tokens: str = setting(
        "auto", "DEFAULT_K", "K when a request does not set it: auto (chosen per round, up to max K) or 0..max K"
    )
    max_num_speculative_tokens: int = setting(16, "MAX_K", "largest K a request may ask for")
    default_max_new_tokens: int = setting(
        128, "DEFAULT_MAX_NEW_TOKENS", "max_new_tokens when a request does not set it"
    )
    max_new_tokens_limit: int = setting(4096, "MAX_NEW_TOKENS_LIMIT", "largest max_new_tokens accepted")
    max_num_samples: int = setting(256, "MAX_NUM_SAMPLES", "largest num_samples accepted")
    # A batch is one Propose / Verify: bounded so that no single call holds a pool for long.
    sample_batch_size: int = setting(32, "SAMPLE_BATCH_SIZE", "samples sent to the models in one batch")
    max_prompt_bytes: int = setting(
        1 << 20, "MAX_PROMPT_BYTES", "largest prompt, UTF-8 bytes (or 4 per prompt token id), checked before tokenising"
    )
    max_stop_strings: int = setting(16, "MAX_STOP_STRINGS", "most stop strings in a request")
    max_stop_bytes: int = setting(256, "MAX_STOP_BYTES", "longest stop string, UTF-8 bytes")
    max_request_tokens: int = setting(
        262144,
        "MAX_REQUEST_TOKENS",
        "most work in one request: num_samples x (context tokens + max_new_tokens)",
    )
    max_workers: int = setting(64, "MAX_WORKERS", "gRPC worker threads")
    # Each admitted request keeps at most one call in flight per pool, so a pod that admits at
    # least this many (the model services' default is 48) never refuses one coordinator's calls.
    # Threads are not what limits a coordinator (scripts/coordinator_bench.py: ~2 ms of CPU per
    # round at 1 to 128 streams, one core at ~400-480 rounds/s): the pods' admission is.
    max_concurrent_requests: int = setting(
        48, "MAX_CONCURRENT_REQUESTS", "requests admitted at once; more get RESOURCE_EXHAUSTED (keep < max_workers)"
    )
    max_message_mb: int = setting(256, "MAX_MESSAGE_MB", "largest gRPC message, MiB")
    grace_s: float = setting(
        30.0, "GRACE_S", "on SIGTERM: seconds in-flight streams may run to completion before they are cancelled"
    )
    log_level: str = setting("info", "LOG_LEVEL", "logging level")
    log_format: str = setting("text", "LOG_FORMAT", "log lines: text | json (with request, session and trace ids)")
    otlp_endpoint: str = setting(
        "",
        "OTLP_ENDPOINT",
        "OpenTelemetry traces to this OTLP gRPC collector, e.g. http://otel-collector:4317 ('' = off)",
    )

    def default_k(self) -> int | None:
        """The default K as an integer, None for auto; ValueError when it is neither."""
        text = str(self.default_num_speculative_tokens).strip().lower()
        if text == "auto":
            return None
        try:
            k = int(text)
        except ValueError:
            k = -1
        if not 0 <= k <= self.max_num_speculative_tokens:
            raise ValueError(
                f"default K (DEFAULT_K) must be 'auto' or an integer in [0, {self.max_num_speculative_tokens}] "
                f"(max K), got {self.default_num_speculative_tokens!r}"
            )
        return k

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        self.default_k()
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError("default max_new_tokens must be in [1, max_new_tokens_limit]")
        if self.session_ttl_s < 1 or self.session_lock_ttl_s < 1:
            raise ValueError("session TTLs must be >= 1 s")
        if not 0 <= self.session_save_interval_s < self.session_lock_ttl_s:
            raise ValueError("session_save_interval_s must be in [0, session_lock_ttl_s)")
        if not 1 <= self.max_concurrent_requests < self.max_workers:
            raise ValueError("max_concurrent_requests must be in [1, max_workers): health probes need a free thread")
        if self.sample_batch_size < 1 or self.max_num_samples < 1:
            raise ValueError("sample_batch_size and max_num_samples must be >= 1")
        if not 0 <= self.verify_batch_wait_ms <= 1000:
            raise ValueError("verify_batch_wait_ms must be in [0, 1000]")
        self.validate_lookup_name("local_draft", self.local_draft, "the draft pool")
        self.validate_lookups()
        if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps must be in [1, {MAX_DECODE_STEPS}]")
        if not 0 <= self.decode_stop_ngram <= MAX_STOP_NGRAM:
            raise ValueError(f"decode_stop_ngram must be in [0, {MAX_STOP_NGRAM}]")
        if self.keepalive_s and self.keepalive_s < MIN_KEEPALIVE_S:
            raise ValueError(f"keepalive_s must be 0 (off) or >= {MIN_KEEPALIVE_S} (what the pools accept)")
        limits = ("max_prompt_bytes", "max_stop_strings", "max_stop_bytes", "max_request_tokens", "call_attempts")
        for name in limits:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        self.validate_tls()
        check_log_format(self.log_format)
        if bool(self.pool_tls_cert_file) != bool(self.pool_tls_key_file):
            raise ValueError("pool_tls_cert_file and pool_tls_key_file go together")
        if self.pool_tls_cert_file and not self.pool_tls_ca_file:
            raise ValueError("a client certificate for the pools (pool_tls_cert_file) needs pool_tls_ca_file")
