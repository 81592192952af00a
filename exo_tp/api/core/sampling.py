"""What every dialect's generation request may set alike: sampling and penalties
(`SamplingFields`, with mlx_lm.server's meanings), the limits on them and on stop sequences,
and the KV cache fields no request may set."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, field_validator

from exo_tp.api.core.strict import Strict

MAX_STOPS = 4
MAX_STOP_CHARS = 1000
CONTEXT_SIZE_LIMIT = 2**31 - 1  # mlx slices token history with 32-bit indices
SEED_RANGE = (-(2**63), 2**64)  # int64 like OpenAI, or any uint64 like mx.random.seed
PENALTY_LIMIT = 100.0  # larger additive penalties only push logits to +-inf (NaN probabilities)
MIN_REPETITION_PENALTY = 0.01  # smaller divisors overflow float32 logits

# A request cannot choose its KV cache's width: a float batch runs all its sequences in one
# pass through mlx-lm's batch caches, which have no quantized form, so one quantized sequence
# would need its own pass, its own prompt-cache entries and admission by bytes, not built.
KV_FIELDS = ("kv_bits", "kv_group_size", "quantized_kv_start")
KV_WIDTH_PER_NODE = (
    "a KV cache's width is set for the whole cluster, not per request, with "
    "`exo-tp run --kv-bits 2..8` (and `--kv-group-size`, `--quantized-kv-start`) on its nodes"
)


def check_stops(stops: Sequence[str], most: int = MAX_STOPS) -> None:
    """A ValueError (the field's 400) for too many stop sequences or one too long."""
    if len(stops) > most:
        raise ValueError(f"at most {most} stop sequences")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")


class SamplingFields(Strict):
    """Sampling and penalties, with mlx_lm.server's meanings (None: the server default)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0 or 1: off (as in mlx-lm)
    top_k: int | None = Field(default=None, ge=0)  # 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    repetition_penalty: float | None = Field(default=None, ge=0.0, le=PENALTY_LIMIT)
    repetition_context_size: int = Field(default=20, ge=1, le=CONTEXT_SIZE_LIMIT)
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    presence_context_size: int = Field(default=20, ge=1, le=CONTEXT_SIZE_LIMIT)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_context_size: int = Field(default=20, ge=1, le=CONTEXT_SIZE_LIMIT)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=0.5)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added logit

    @field_validator("repetition_penalty")
    @classmethod
    def _divisor(cls, penalty: float | None) -> float | None:
        if penalty is not None and 0 < penalty < MIN_REPETITION_PENALTY:
            raise ValueError(f"must be 0 (off) or at least {MIN_REPETITION_PENALTY}")
        return penalty

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            try:
                int(key) if len(key) <= 20 else int("not a token id")
            except ValueError:
                raise ValueError(
                    f"keys must be token ids (whole numbers), not {key[:40]!r}"
                ) from None
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be between -100 and 100, not {value}")
        return bias
