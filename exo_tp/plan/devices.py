"""Measured device and link profiles: what `exo-tp bench` writes and the planner reads (pure)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.plan.spec import Frozen

PROFILE_VERSION = 1


class MatmulScore(Frozen):
    """One measured kernel: decode-shaped (1 x K . K x N) or prefill-shaped (M x K . K x N)."""

    kind: Literal["matvec", "matmul"]
    dtype: str  # "float32", "bfloat16", "float16", "q4g32", "q4g64", ...
    m: int
    k: int
    n: int
    seconds: float = Field(gt=0)
    flops: float = Field(ge=0)  # FLOP/s
    weight_bytes_per_second: float = Field(ge=0)  # bytes of weights read per second


class DeviceProfile(Frozen):
    version: int = PROFILE_VERSION
    node_id: str = ""
    hostname: str = ""
    chip: str  # CPU or Apple chip name
    cores: int = Field(ge=1)
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
    kernels: tuple[MatmulScore, ...] = ()
    quick: bool = False
    measured_at: str = ""  # ISO 8601
    duration_seconds: float = 0.0

    @property
    def decode_speed(self) -> float:
        """Bytes of weights per second at decode: the planner's share weight."""
        return 1.0 / self.decode_seconds_per_byte


class LinkProfile(Frozen):
    """A measured link between two nodes (or ranks)."""

    a: str
    b: str
    up: bool
    all_sum_latency: float | None = None  # seconds for a 4 KB all_sum
    all_sum_bandwidth: float | None = None  # bytes/s for an 8 MB all_sum
    send_recv_latency: float | None = None  # seconds one way, neighbours
    error: str | None = None
