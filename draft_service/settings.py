from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.rpc.model_service import ModelServerSettings
from specdec.settings import setting

# SPECDEC_DRAFT_MODEL=ngram: the model-free prompt-lookup draft (draft_service/ngram.py).
NGRAM_MODEL = "ngram"
MAX_NGRAM = 32


@dataclass(frozen=True)
class DraftSettings(ModelServerSettings):
    """Draft service settings (flags, or SPECDEC_DRAFT_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_DRAFT_"
    DEFAULT_PORT: ClassVar[int] = 50052

    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    metrics_port: int = setting(9102, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    ngram_min: int = setting(1, "NGRAM_MIN", "model=ngram: shortest suffix looked up in the prefix")
    ngram_max: int = setting(4, "NGRAM_MAX", f"model=ngram: longest suffix looked up in the prefix (<= {MAX_NGRAM})")
    tokenizer: str = setting(
        "smollm2-135m-instruct",
        "TOKENIZER",
        "model=ngram: the target's tokenizer (vocabulary size, EOS ids and fingerprint for Info)",
    )

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ValueError(
                f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, "
                f"got ngram_min={self.ngram_min}, ngram_max={self.ngram_max}"
            )
