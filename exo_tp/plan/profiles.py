"""What a node tells its cluster about its device: its profile's scores (ProfileSummary, in
every status), the model shapes it measured, and the links it measured to its peers. The full
profile (`exo-tp bench`'s file) is exo_tp.plan.devices.DeviceProfile.

These are wire types (exo_tp.wire.profiles is where the node and the wire take them from), and
the planner reads them: they are defined here because the wire package imports the planning
one (an Assignment carries a plan), and packages never import each other both ways."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

from pydantic import Field

from exo_tp.frozen import Frozen

ENGINE_DTYPE = "float32"  # exo-tp computes in float32 unless told otherwise (launch --dtype)
FLOAT_BYTES = 4  # float32, the engine's compute dtype for float weights and activations
TOKEN_BYTES = 4  # a token id on the wire (int32)


class ShapeSeconds(Frozen):
    """One measured matvec of a model's shape (`exo-tp bench --model`), as a node tells its
    cluster: (k -> n) in weight format ``dtype``."""

    dtype: str
    k: int = Field(gt=0)
    n: int = Field(gt=0)
    seconds: float = Field(gt=0)


def measured_now() -> str:
    """A measurement's ``measured_at``: now, ISO 8601 in UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class FormatScore(Frozen):
    """The decode score measured for one weight format."""

    dtype: str  # "float32", "q4g32", ...
    seconds_per_byte: float = Field(gt=0)


class DecodeScore(Frozen):
    """A device's decode score for a weight format, and whether that format was measured."""

    dtype: str  # the format asked for
    seconds_per_byte: float = Field(gt=0)
    # False: the format was not measured and the headline score (at ``decode_dtype``) stands in
    measured: bool

    @property
    def speed(self) -> float:
        """Bytes of weights read per second at decode."""
        return 1.0 / self.seconds_per_byte


def decode_score(
    formats: tuple[FormatScore, ...], dtype: str, headline: float, headline_dtype: str
) -> DecodeScore:
    """The score measured for ``dtype``, else the headline score, saying which it is."""
    for score in formats:
        if score.dtype == dtype:
            return DecodeScore(dtype=dtype, seconds_per_byte=score.seconds_per_byte, measured=True)
    return DecodeScore(dtype=dtype, seconds_per_byte=headline, measured=dtype == headline_dtype)


# Where a link's figures come from: `exo-tp bench --peers` (a 2-rank MLX all_sum), a running
# node's probe of a peer when it joins (signed round trips over TCP: an estimate), or an
# epoch's workers timing their stage's all_sum as the group formed.
LinkSource = Literal["bench", "probe", "epoch"]


class LinkProfile(Frozen):
    """A measured link between two nodes, seen from node ``a``: ``rank@address`` labels from
    `exo-tp bench --peers`, node ids in a running cluster."""

    a: str
    b: str
    up: bool
    all_sum_latency: float | None = None  # seconds for a 4 KB all_sum
    all_sum_bandwidth: float | None = None  # payload bytes/s of an 8 MB all_sum
    send_recv_latency: float | None = None  # seconds one way, neighbours
    # seconds a small all_sum adds to a decode step inside a compute graph (hand-over, wake-up,
    # the peer's jitter): what tensor parallelism really pays per collective
    all_sum_in_graph: float | None = None
    error: str | None = None
    # Ranks of the all_sum the two all_sum figures come from: 2 is this pair alone; a running
    # cluster's ring of n > 2 ranks can only time its all_sum as a whole (no group split on ring).
    group_size: int = Field(default=2, ge=2)
    source: LinkSource = "bench"
    measured_at: str = ""  # ISO 8601 ("": not recorded)


class ProfileSummary(Frozen):
    """What a node tells its cluster about its profile: the scores without the kernel table."""

    chip: str
    cores: int = Field(ge=1)
    mlx_version: str
    mlx_device: str
    memory_total: int = Field(ge=0)
    memory_available: int = Field(ge=0)
    backends: tuple[str, ...]
    memory_bandwidth: float = Field(gt=0)
    decode_seconds_per_byte: float = Field(gt=0)
    prefill_flops: float = Field(gt=0)
    decode_dtype: str = ENGINE_DTYPE
    # decode score of each measured weight format ("float32", "q4g32", ...)
    formats: tuple[FormatScore, ...] = ()
    layer_overhead_seconds: float = Field(default=0.0, ge=0)
    # its models' matrix shapes (`exo-tp bench --model`): the leader prices them as measured
    shapes: tuple[ShapeSeconds, ...] = ()
    quick: bool = False
    measured_at: str = ""
    # The profile's own name for this device ("rank@address" from `exo-tp bench --peers`), and
    # the links it measured then to the devices benched with it: the leader plans with them.
    profile_id: str = ""
    links: tuple[LinkProfile, ...] = ()

    @property
    def shape_seconds(self) -> tuple[ShapeSeconds, ...]:
        return self.shapes

    def decode_score(self, dtype: str) -> DecodeScore:
        """The decode score for weights stored as ``dtype`` (says if the headline stands in)."""
        return decode_score(self.formats, dtype, self.decode_seconds_per_byte, self.decode_dtype)
