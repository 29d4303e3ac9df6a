from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.rpc.logs import check_log_format
from specdec.settings import setting


@dataclass(frozen=True)
class GatewaySettings:
    """OpenAI-compatible HTTP gateway settings (flags, or SPECDEC_GATEWAY_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_GATEWAY_"
    DEFAULT_PORT: ClassVar[int] = 8000  # vLLM's, so OpenAI clients and benchmarks find it where they expect

    host: str = setting("0.0.0.0", "HOST", "address to bind")
    port: int = setting(DEFAULT_PORT, "PORT", "HTTP port (0 = any free port)")
    coordinator_address: str = setting(
        "localhost:50051",
        "COORDINATOR_ADDRESS",
        "the coordinators: host:port, a comma list, or a gRPC target (dns:///...); calls go round-robin",
    )
    coordinator_tls_ca_file: str = setting(
        "", "COORDINATOR_TLS_CA_FILE", "CA of the coordinator's certificate (set = TLS to it; empty = plaintext)"
    )
    model_name: str = setting(
        "smollm2-135m-instruct", "MODEL_NAME", "the model id /v1/models lists and every request must name"
    )
    request_timeout_s: float = setting(600.0, "REQUEST_TIMEOUT_S", "deadline of one coordinator call")
    tls_cert_file: str = setting("", "TLS_CERT_FILE", "PEM certificate chain for HTTPS (empty = plain HTTP)")
    tls_key_file: str = setting("", "TLS_KEY_FILE", "PEM private key of tls_cert_file")
    otlp_endpoint: str = setting("", "OTLP_ENDPOINT", "OTLP gRPC collector for traces (empty = tracing off)")
    # A JSON body may escape each character of a prompt the coordinator accepts (1 MiB) in up to 6 bytes.
    max_body_bytes: int = setting(8 << 20, "MAX_BODY_BYTES", "largest request body; larger ones get HTTP 413")
    log_level: str = setting("info", "LOG_LEVEL", "logging level")
    log_format: str = setting("text", "LOG_FORMAT", "log lines: text | json (with request and trace ids)")

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if not self.model_name:
            raise ValueError("model_name must be set: requests name it")
        if self.request_timeout_s <= 0 or self.max_body_bytes < 1:
            raise ValueError("request_timeout_s and max_body_bytes must be > 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        check_log_format(self.log_format)
