from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.core.lookup import LookupSettings
from specdec.rpc.model_service import ModelServerSettings
from specdec.settings import setting


@dataclass(frozen=True)
class TargetSettings(LookupSettings, ModelServerSettings):
    """Target service settings (flags, or SPECDEC_TARGET_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_TARGET_"
    DEFAULT_PORT: ClassVar[int] = 50053

    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    metrics_port: int = setting(9103, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    # A drafting round cost its step plus a round trip to the coordinator (and back for the next
    # round); rounds drafted here by a lookup of microseconds run on without one (README, "Configuration").
    lookup: str = setting(
        "",
        "LOOKUP",
        "a lookup draft this service drafts rounds with itself when a coordinator asks (VerifySequence.lookup_k): "
        "'' (none), ngram or suffix (configured by this service's NGRAM_* / SUFFIX_* settings)",
    )

    def validate(self) -> None:
        super().validate()
        self.validate_lookups()
        self.validate_lookup_name("lookup", self.lookup, "none")
