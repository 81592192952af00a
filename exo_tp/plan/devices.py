"""Measured device and link profiles: what `exo-tp bench` writes and the planner reads (pure).

Scores (measured by `exo_tp.profile`, defined here so the planner and the bench agree):

- **decode score** `decode_seconds_per_byte`: the mean, over decode-shaped layer matvecs
  (1 x K . K x N at real layer sizes, each streamed over a working set of distinct matrices far
  larger than the CPU's L2 so that weights come from memory as in a real decode), of the wall
  time per byte of weights read, at the engine's compute dtype (`decode_dtype`, float32). A rank
  reading B bytes of weights per token spends about ``B * decode_seconds_per_byte`` seconds on
  them. ``decode_score(dtype)`` gives the same score for another weight format
  ("bfloat16", "q4g32", ...) when it was measured.
- **prefill score** `prefill_flops`: FLOP/s of prefill-shaped (M x K . K x N, M tokens) matmuls
  at the engine's dtype: the total FLOPs of one matmul of each measured shape over their total
  time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from exo_tp.errors import ExoTpError
from exo_tp.plan.profiles import (
    ENGINE_DTYPE,
    DecodeScore,
    FormatScore,
    LinkProfile,
    ProfileSummary,
    ShapeSeconds,
    decode_score,
)
from exo_tp.plan.spec import Frozen

PROFILE_VERSION = 1


def quant_key(bits: int, group_size: int) -> str:
    """Kernel dtype name of an affine-quantized weight format: ``q4g32`` for 4 bits, group 32."""
    return f"q{bits}g{group_size}"


class MatmulScore(Frozen):
    """One measured kernel: decode-shaped (1 x K . K x N) or prefill-shaped (M x K . K x N)."""

    kind: Literal["matvec", "matmul"]
    dtype: str  # "float32", "bfloat16", "float16", "q4g32", "q4g64", ...
    m: int
    k: int
    n: int
    seconds: float = Field(gt=0)  # mean wall time of one product
    flops: float = Field(ge=0)  # FLOP/s
    weight_bytes_per_second: float = Field(ge=0)  # bytes of weights read per second
    weight_bytes: int = Field(default=0, ge=0)  # one matrix as stored (scales/biases included)
    working_set_bytes: int = Field(default=0, ge=0)  # distinct weights cycled through per pass


def decode_seconds_per_byte(kernels: Sequence[MatmulScore], dtype: str) -> float | None:
    """Mean seconds per weight byte over the decode-shaped kernels of ``dtype`` (None: none)."""
    rates = [
        k.weight_bytes_per_second
        for k in kernels
        if k.kind == "matvec" and k.dtype == dtype and k.weight_bytes_per_second > 0
    ]
    return sum(1.0 / r for r in rates) / len(rates) if rates else None


def prefill_flops(kernels: Sequence[MatmulScore], dtype: str) -> float | None:
    """Total FLOPs over total seconds of one prefill-shaped matmul per shape (None: none)."""
    chosen = [k for k in kernels if k.kind == "matmul" and k.dtype == dtype]
    seconds = sum(k.seconds for k in chosen)
    return sum(k.flops * k.seconds for k in chosen) / seconds if chosen else None


class DeviceProfile(Frozen):
    version: int = PROFILE_VERSION
    node_id: str = ""  # "rank@address" when measured with peers
    hostname: str = ""
    chip: str  # CPU or Apple chip name
    cores: int = Field(ge=1)  # cores this process may run on
    mlx_version: str
    mlx_device: str  # "cpu" or "gpu"
    memory_total: int = Field(ge=0)  # bytes
    memory_available: int = Field(ge=0)  # bytes
    backends: tuple[str, ...]  # distributed backends usable here: ring, jaccl, mpi, nccl
    memory_bandwidth: float = Field(gt=0)  # bytes/s, streaming read
    # Decode score: seconds per byte of weights read during decode (lower is faster).
    decode_seconds_per_byte: float = Field(gt=0)
    # Prefill score: FLOP/s on prefill-shaped matmuls.
    prefill_flops: float = Field(gt=0)
    # The BLAS a CPU build's float32 matmuls ran on ("": not recorded, or a GPU).
    blas: str = ""
    decode_dtype: str = ENGINE_DTYPE  # the dtype both headline scores were measured at
    # Seconds one decoder layer adds to a decoded token beyond its weight reads (operation
    # dispatch, norms, rope, short attention: exo_tp.profile.overhead). 0: not measured.
    layer_overhead_seconds: float = Field(default=0.0, ge=0)
    kernels: tuple[MatmulScore, ...] = ()
    # Matvecs of a model's own matrix shapes (`exo-tp bench --model`), in its weight format:
    # the planner prices each matrix of that model by these (exo_tp.plan.matvec).
    shapes: tuple[MatmulScore, ...] = ()
    links: tuple[LinkProfile, ...] = ()  # this node's links to its peers (not cached)
    quick: bool = False
    measured_at: str = ""  # ISO 8601
    duration_seconds: float = 0.0

    @property
    def decode_speed(self) -> float:
        """Bytes of weights per second at decode: the planner's share weight."""
        return 1.0 / self.decode_seconds_per_byte

    @property
    def formats(self) -> tuple[FormatScore, ...]:
        """The decode score of every weight format measured."""
        dtypes = sorted({k.dtype for k in self.kernels if k.kind == "matvec"})
        scores = ((d, decode_seconds_per_byte(self.kernels, d)) for d in dtypes)
        return tuple(FormatScore(dtype=d, seconds_per_byte=s) for d, s in scores if s)

    def decode_score(self, dtype: str) -> DecodeScore:
        """The decode score for weights stored as ``dtype`` (says if the headline stands in)."""
        return decode_score(self.formats, dtype, self.decode_seconds_per_byte, self.decode_dtype)

    @property
    def shape_seconds(self) -> tuple[ShapeSeconds, ...]:
        return tuple(
            ShapeSeconds(dtype=k.dtype, k=k.k, n=k.n, seconds=k.seconds)
            for k in self.shapes
            if k.kind == "matvec"
        )

    def summary(self) -> ProfileSummary:
        own = {"formats", "shapes", "profile_id", "links"}
        return ProfileSummary(
            **self.model_dump(include=set(ProfileSummary.model_fields) - own),
            formats=self.formats,
            shapes=self.shape_seconds,
            profile_id=self.node_id,
            links=self.links,
        )


def read_profile(path: Path) -> DeviceProfile:
    """A profile written by `exo-tp bench`; a missing or invalid file is one readable error."""
    try:
        return DeviceProfile.model_validate_json(Path(path).read_bytes())
    except OSError as error:
        raise ExoTpError(f"cannot read profile {path}: {error.strerror or error}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"])) or "file"
        raise ExoTpError(
            f"profile {path} is not a valid exo-tp profile ({where}: {first['msg']})"
        ) from None
