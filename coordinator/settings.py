from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.settings import setting


@dataclass(frozen=True)
class CoordinatorSettings:
    """Coordinator settings (flags, or SPECDEC_COORDINATOR_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_COORDINATOR_"
    DEFAULT_PORT: ClassVar[int] = 50051

    host: str = setting("0.0.0.0", "HOST", "address to bind")
    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    metrics_port: int = setting(9101, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    draft_address: str = setting(
        "localhost:50052", "DRAFT_ADDRESS", "draft service: host:port, a comma list, or a gRPC target (dns:///...)"
    )
    target_address: str = setting(
        "localhost:50053", "TARGET_ADDRESS", "target service: host:port, a comma list, or a gRPC target (dns:///...)"
    )
    redis_url: str = setting("redis://localhost:6379/0", "REDIS_URL", "Redis holding the sessions")
    tokenizer: str = setting("smollm2-135m-instruct", "TOKENIZER", "the target's tokenizer: same forms as a model spec")
    session_ttl_s: int = setting(86400, "SESSION_TTL_S", "seconds a session lives after its last update")
    session_lock_ttl_s: int = setting(60, "SESSION_LOCK_TTL_S", "lease of a session lock, renewed every round")
    session_key_prefix: str = setting("specdec:v1", "SESSION_KEY_PREFIX", "Redis key prefix")
    draft_timeout_s: float = setting(30.0, "DRAFT_TIMEOUT_S", "deadline of one Propose call")
    verify_timeout_s: float = setting(60.0, "VERIFY_TIMEOUT_S", "deadline of one Verify call")
    info_timeout_s: float = setting(10.0, "INFO_TIMEOUT_S", "deadline of one Info call")
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
    max_num_samples: int = setting(1024, "MAX_NUM_SAMPLES", "largest num_samples accepted")
    sample_batch_size: int = setting(1024, "SAMPLE_BATCH_SIZE", "samples sent to the models in one batch")
    max_workers: int = setting(32, "MAX_WORKERS", "gRPC worker threads")
    max_concurrent_requests: int = setting(
        28, "MAX_CONCURRENT_REQUESTS", "requests admitted at once; more get RESOURCE_EXHAUSTED (keep < max_workers)"
    )
    max_message_mb: int = setting(256, "MAX_MESSAGE_MB", "largest gRPC message, MiB")
    grace_s: float = setting(10.0, "GRACE_S", "seconds to drain in-flight calls on SIGTERM")
    log_level: str = setting("info", "LOG_LEVEL", "logging level")

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
        if not 1 <= self.max_concurrent_requests < self.max_workers:
            raise ValueError("max_concurrent_requests must be in [1, max_workers): health probes need a free thread")
        if self.sample_batch_size < 1 or self.max_num_samples < 1:
            raise ValueError("sample_batch_size and max_num_samples must be >= 1")
