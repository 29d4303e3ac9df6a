from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.rpc.model_service import ModelServerSettings
from specdec.settings import setting


@dataclass(frozen=True)
class DraftSettings(ModelServerSettings):
    """Draft service settings (flags, or SPECDEC_DRAFT_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_DRAFT_"
    DEFAULT_PORT: ClassVar[int] = 50052

    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    metrics_port: int = setting(9102, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
