"""The devices and links a plan is chosen for, as the cost model sees them (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from pydantic import Field

from exo_tp.plan.cost import (
    DEFAULT_LINK,
    LinkCost,
    ReadPrice,
    own_read_speed,
    rank_load,
    weight_format,
)
from exo_tp.plan.devices import DeviceProfile, ProfileSummary
from exo_tp.plan.matvec import MatvecTable
from exo_tp.plan.shard_plan import Span
from exo_tp.plan.spec import Frozen, ModelSpec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel

# Share of a device's available memory a plan may fill: the OS, MLX buffers and activations
# need the rest.
MEMORY_HEADROOM = 0.9
# A link `exo-tp bench` found down: any plan over it is priced out rather than refused.
DOWN_LINK = LinkCost(latency=3600.0, bandwidth=1.0, measured=True)


class DeviceCost(Frozen):
    name: str
    seconds_per_byte: float = Field(gt=0)  # decode score for the model's weight format
    prefill_flops: float = Field(gt=0)  # FLOP/s
    memory: int = Field(ge=0)  # bytes the model's weights and KV cache may use here
    layer_overhead: float = Field(default=0.0, ge=0)  # seconds per layer per token (0: unknown)
    # the model's matrix shapes measured in its weight format (empty: priced by the score)
    matvec: MatvecTable = MatvecTable()
    # bytes/s reading the whole model at those shapes (`model_read_speed`; 0: by the score)
    read_speed: float = Field(default=0.0, ge=0)

    @property
    def speed(self) -> float:
        """Weight bytes read per second at decode: the share weight (and the order devices
        are tried and grouped in). With measured shapes it is the speed they price the model
        at, so shares and subsets follow what the planner predicts, not a mean over other
        shapes."""
        return self.read_speed or 1.0 / self.seconds_per_byte


class Link(Frozen):
    a: int  # device indices
    b: int
    cost: LinkCost


def slowest(costs: Sequence[LinkCost]) -> LinkCost:
    """A link as slow as the worst of ``costs`` in both latency and bandwidth."""
    return LinkCost(
        latency=max(c.latency for c in costs),
        bandwidth=min(c.bandwidth for c in costs),
        measured=all(c.measured for c in costs),
    )


class Cluster(Frozen):
    devices: tuple[DeviceCost, ...] = Field(min_length=1)
    links: tuple[Link, ...] = ()  # measured links; any other pair uses ``default_link``
    default_link: LinkCost = DEFAULT_LINK

    @cached_property
    def _table(self) -> dict[tuple[int, int], LinkCost]:
        return {(min(x.a, x.b), max(x.a, x.b)): x.cost for x in self.links}

    def link(self, a: int, b: int) -> LinkCost:
        return self._table.get((min(a, b), max(a, b)), self.default_link)

    def ring_link(self, devices: Sequence[int]) -> LinkCost | None:
        """The slowest link between ring neighbours (MLX's ring connects only those)."""
        if len(devices) < 2:
            return None
        pairs = zip(devices, [*devices[1:], devices[0]], strict=True)
        return slowest([self.link(a, b) for a, b in pairs])


def shape_table(profile: DeviceProfile | ProfileSummary, dtype: str) -> MatvecTable:
    """The matvec shapes ``profile`` measured in weight format ``dtype``."""
    return MatvecTable.of((x.k, x.n, x.seconds) for x in profile.shape_seconds if x.dtype == dtype)


class Reads(Frozen):
    """What prices a device's weight reads (`exo_tp.plan.cost.ReadPrice`) without the rest
    of a device."""

    seconds_per_byte: float = Field(gt=0)
    matvec: MatvecTable = MatvecTable()


def profile_read_speed(spec: ModelSpec, profile: DeviceProfile | ProfileSummary) -> float:
    """``model_read_speed`` of a profiled device: its share weight for ``spec``."""
    dtype = weight_format(spec)
    reads = Reads(
        seconds_per_byte=1.0 / profile.decode_speed_for(dtype),
        matvec=shape_table(profile, dtype),
    )
    return model_read_speed(spec, reads)


def model_read_speed(spec: ModelSpec, price: ReadPrice) -> float:
    """Bytes/s at which a device reads every matrix of ``spec`` (one rank holding the whole
    model) at its measured shapes; its decode score's speed when it measured none."""
    if not price.matvec.points:
        return 1.0 / price.seconds_per_byte
    whole = plan_tensor_parallel(spec, [1.0]).ranks[0]
    return own_read_speed(
        rank_load(spec, whole, Span(start=0, stop=spec.num_layers), True, True), price
    )


def with_read_speed(spec: ModelSpec, device: DeviceCost) -> DeviceCost:
    """``device`` with its share speed for ``spec`` at its measured shapes, if it has any."""
    if not device.matvec.points:
        return device
    return device.model_copy(update={"read_speed": model_read_speed(spec, device)})


def cluster_from_profiles(
    spec: ModelSpec,
    profiles: Sequence[DeviceProfile],
    default_link: LinkCost = DEFAULT_LINK,
    headroom: float = MEMORY_HEADROOM,
    names: Sequence[str] = (),
) -> Cluster:
    """Devices scored for ``spec``'s weight format; links measured between profiled nodes.
    Devices are named ``names[i]``, else by node id or host name."""
    dtype = weight_format(spec)
    devices = tuple(
        with_read_speed(
            spec,
            DeviceCost(
                name=names[i] if i < len(names) else p.node_id or p.hostname or f"device {i}",
                seconds_per_byte=p.seconds_per_byte(dtype),
                prefill_flops=p.prefill_flops,
                memory=int(p.memory_available * headroom),
                layer_overhead=p.layer_overhead_seconds,
                matvec=shape_table(p, dtype),
            ),
        )
        for i, p in enumerate(profiles)
    )
    index = {p.node_id: i for i, p in enumerate(profiles) if p.node_id}
    links: dict[tuple[int, int], Link] = {}
    for profile in profiles:
        for x in profile.links:
            if x.a not in index or x.b not in index:
                continue
            a, b = sorted((index[x.a], index[x.b]))
            if not x.up:
                links[a, b] = Link(a=a, b=b, cost=DOWN_LINK)
            elif x.all_sum_latency and x.all_sum_bandwidth and (a, b) not in links:
                # A collective in a forward pass costs what it costs there, not alone.
                latency = max(x.all_sum_latency, x.all_sum_in_graph or 0.0)
                links[a, b] = Link(
                    a=a,
                    b=b,
                    cost=LinkCost(latency=latency, bandwidth=x.all_sum_bandwidth, measured=True),
                )
    return Cluster(devices=devices, links=tuple(links.values()), default_link=default_link)
