from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.rpc.model_service import ModelServerSettings
from specdec.settings import setting

# SPECDEC_DRAFT_MODEL=ngram: the model-free prompt-lookup draft (draft_service/ngram.py).
NGRAM_MODEL = "ngram"
MAX_NGRAM = 32
# SPECDEC_DRAFT_MODEL=suffix: the model-free suffix-trie draft over this pod's recent sequences
# (draft_service/suffix.py, specdec/core/suffix.py).
SUFFIX_MODEL = "suffix"
MODEL_FREE = (NGRAM_MODEL, SUFFIX_MODEL)
# SPECDEC_DRAFT_LOOKUP=ngram|suffix with a draft model: hybrid, the lookup's proposal where it has a
# confident one and the model's otherwise, per sequence per round (draft_service/hybrid.py).
LOOKUPS = ("", *MODEL_FREE)
MAX_SUFFIX_DEPTH = 64
MAX_SUFFIX_CACHE_TOKENS = 100_000_000


@dataclass(frozen=True)
class DraftSettings(ModelServerSettings):
    """Draft service settings (flags, or SPECDEC_DRAFT_* env vars)."""

    ENV_PREFIX: ClassVar[str] = "SPECDEC_DRAFT_"
    DEFAULT_PORT: ClassVar[int] = 50052

    port: int = setting(DEFAULT_PORT, "PORT", "gRPC port (0 = any free port)")
    # A draft's numerics never reach the output law (it samples from the q it sends): int8 by default.
    matmul_dtype: str = setting(
        "auto",
        "MATMUL_DTYPE",
        "a float32 draft on CPU: auto = int8 products where the CPU has AVX-512 VNNI, the weights rounded "
        "to 8-bit blocks (GGUF's Q8_0) first, else float32 | int8 (as auto, or an error) | bfloat16 | float32",
    )
    metrics_port: int = setting(9102, "METRICS_PORT", "Prometheus /metrics port (-1 = off, 0 = any free port)")
    ngram_min: int = setting(1, "NGRAM_MIN", "model=ngram: shortest suffix looked up in the prefix")
    ngram_max: int = setting(4, "NGRAM_MAX", f"model=ngram: longest suffix looked up in the prefix (<= {MAX_NGRAM})")
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
    suffix_max_depth: int = setting(
        24,
        "SUFFIX_MAX_DEPTH",
        f"suffix: longest substring indexed (contexts up to this - 1 tokens; <= {MAX_SUFFIX_DEPTH})",
    )
    suffix_min_match: int = setting(2, "SUFFIX_MIN_MATCH", "suffix: shortest context a proposal may start from")
    suffix_min_token_prob: float = setting(
        0.3, "SUFFIX_MIN_TOKEN_PROB", "suffix: least share of its context's continuations a proposed token needs"
    )
    suffix_min_path_prob: float = setting(
        0.3, "SUFFIX_MIN_PATH_PROB", "suffix: least product of those shares along a proposal"
    )
    suffix_cache_max_tokens: int = setting(
        65536,
        "SUFFIX_CACHE_MAX_TOKENS",
        "suffix: most tokens indexed over all cached prefixes (latest per session, LRU; ~0.5 KB a token at depth 24)",
    )

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ValueError(
                f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, "
                f"got ngram_min={self.ngram_min}, ngram_max={self.ngram_max}"
            )
        self._validate_lookup()
        self._validate_suffix()

    def _validate_lookup(self) -> None:
        if self.lookup not in LOOKUPS:
            raise ValueError(f"lookup must be '' (none), 'ngram' or 'suffix', got {self.lookup!r}")
        if self.lookup and self.model in MODEL_FREE:
            raise ValueError(
                f"lookup={self.lookup!r} goes with a draft model (hybrid); model={self.model!r} is model-free already"
            )

    def _validate_suffix(self) -> None:
        if not 2 <= self.suffix_max_depth <= MAX_SUFFIX_DEPTH:
            raise ValueError(f"suffix_max_depth must be in [2, {MAX_SUFFIX_DEPTH}], got {self.suffix_max_depth}")
        if not 1 <= self.suffix_min_match < self.suffix_max_depth:
            raise ValueError(
                f"suffix_min_match must be in [1, suffix_max_depth - 1 = {self.suffix_max_depth - 1}], "
                f"got {self.suffix_min_match}"
            )
        for name in ("suffix_min_token_prob", "suffix_min_path_prob"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 1 <= self.suffix_cache_max_tokens <= MAX_SUFFIX_CACHE_TOKENS:
            raise ValueError(
                f"suffix_cache_max_tokens must be in [1, {MAX_SUFFIX_CACHE_TOKENS}], got {self.suffix_cache_max_tokens}"
            )
