from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.core.lookup import LOOKUPS, MODEL_FREE, NGRAM_MODEL, SUFFIX_MODEL, LookupSettings
from specdec.rpc.model_service import ModelServerSettings
from specdec.settings import setting

# SPECDEC_DRAFT_MODEL=ngram or suffix: a model-free lookup draft (specdec/core/lookup.py); with a draft
# model, SPECDEC_DRAFT_LOOKUP=ngram|suffix makes it hybrid: the lookup's proposal where it has a
# confident one and the model's otherwise, per sequence per round (draft_service/hybrid.py).
__all__ = ["LOOKUPS", "MODEL_FREE", "NGRAM_MODEL", "SUFFIX_MODEL", "DraftSettings"]


@dataclass(frozen=True)
class DraftSettings(LookupSettings, ModelServerSettings):
    """Draft service settings (flags, or SPECDEC_DRAFT_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_DRAFT_"
    DEFAULT_PORT: ClassVar[int] = 50052

    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    # A draft's numerics never reach the output law (it samples from the q it sends): int8 by default.
    matmul_dtype: str = setting(
        "auto",
        "MATMUL_DTYPE",
        "a float32 draft on CPU: auto = int8 products where the CPU has AVX2, the weights rounded "
        "to 8-bit blocks (GGUF's Q8_0) first, else float32 | int8 (as auto, or an error) | bfloat16 | float32",
    )
    metrics_port: int = setting(9102, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    tokenizer: str = setting(
        "smollm2-135m-instruct",
        "TOKENIZER",
        "model=ngram or suffix: the target's tokenizer (vocabulary size, EOS ids and fingerprint for Info)",
    )
    lookup: str = setting(
        "",
        "LOOKUP",
        "with a draft model: a model-free draft tried first for each sequence each round, the model "
        "drafting where it proposes nothing (hybrid): '' (none), 'ngram' or 'suffix'",
    )

    def validate(self) -> None:
        super().validate()
        self.validate_lookups()
        self._validate_lookup()

    def _validate_lookup(self) -> None:
        self.validate_lookup_name("lookup", self.lookup, "none")
        if self.lookup and self.model in MODEL_FREE:
            raise ValueError(
                f"lookup={self.lookup!r} goes with a draft model (hybrid); model={self.model!r} is model-free already"
            )
