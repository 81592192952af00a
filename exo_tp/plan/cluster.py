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
from exo_tp.plan.devices import DeviceProfile
from exo_tp.plan.matvec import MatvecTable
from exo_tp.plan.profiles import LinkProfile, LinkSource, ProfileSummary
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
    # False: that format was not measured, and the headline score prices it
    score_measured: bool = True
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
    source: LinkSource = "bench"  # where the figures come from
    measured_at: str = ""  # ISO 8601, of the newest measurement behind it

    @property
    def origin(self) -> str:
        """How and when it was measured: "probe 2026-12-01T21:00:00+00:00"."""
        return " ".join(filter(None, (self.source, self.measured_at)))


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
        seconds_per_byte=profile.decode_score(dtype).seconds_per_byte,
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


Profile = DeviceProfile | ProfileSummary


def _label(profile: Profile) -> str:
    """The profile's own name for its device (the labels its links use)."""
    return profile.node_id if isinstance(profile, DeviceProfile) else profile.profile_id


def _default_name(profile: Profile, i: int) -> str:
    hostname = profile.hostname if isinstance(profile, DeviceProfile) else ""
    return _label(profile) or hostname or f"device {i}"


def device_cost(
    spec: ModelSpec,
    profile: Profile,
    name: str,
    headroom: float = MEMORY_HEADROOM,
    slowdown: float = 1.0,
    memory: int = 0,
) -> DeviceCost:
    """One device scored for ``spec``'s weight format. ``slowdown``: how many times slower it
    runs now than its profile says (live rebalancing); ``memory``: bytes available now, where
    known (else the profile's figure)."""
    dtype = weight_format(spec)
    score = profile.decode_score(dtype)
    device = DeviceCost(
        name=name,
        seconds_per_byte=score.seconds_per_byte * slowdown,
        score_measured=score.measured,
        prefill_flops=profile.prefill_flops,
        memory=int((memory or profile.memory_available) * headroom),
        layer_overhead=profile.layer_overhead_seconds,
        matvec=shape_table(profile, dtype).scaled(slowdown),
    )
    return with_read_speed(spec, device)


class _Measured(Frozen):
    """One measurement of a pair's link, on the way to the pair's `Link`."""

    priority: int  # lower wins: an all_sum's (benched together, an epoch's) before a probe
    profile: LinkProfile


def _link_cost(x: LinkProfile) -> LinkCost | None:
    if not x.up:
        return DOWN_LINK
    if not (x.all_sum_latency and x.all_sum_bandwidth):
        return None
    # A collective in a forward pass costs what it costs there, not alone.
    latency = max(x.all_sum_latency, x.all_sum_in_graph or 0.0)
    return LinkCost(latency=latency, bandwidth=x.all_sum_bandwidth, measured=True)


def _pair_link(a: int, b: int, found: Sequence[_Measured]) -> Link | None:
    """The pair's link from its best class of measurements: the slowest of them (two nodes'
    views of one link), down if any says so."""
    best = min(m.priority for m in found)
    chosen = [m.profile for m in found if m.priority == best]
    costs = [c for x in chosen if (c := _link_cost(x)) is not None]
    if not costs:
        return None
    cost = DOWN_LINK if DOWN_LINK in costs else slowest(costs)
    newest = max(chosen, key=lambda x: x.measured_at)
    return Link(a=a, b=b, cost=cost, source=newest.source, measured_at=newest.measured_at)


def cluster_from_profiles(
    spec: ModelSpec,
    profiles: Sequence[Profile],
    default_link: LinkCost = DEFAULT_LINK,
    headroom: float = MEMORY_HEADROOM,
    names: Sequence[str] = (),
    links: Sequence[LinkProfile] = (),
    slowdown: Sequence[float] = (),
    memory: Sequence[int] = (),
) -> Cluster:
    """The one cluster model: `exo-tp plan` and a running cluster's leader both plan over it.

    Devices are scored for ``spec``'s weight format and named ``names[i]``, else by the
    profile's node id or host name. Links: those the profiles measured between devices benched
    together (`exo-tp bench --peers`), else ``links`` (a running cluster's probes, labelled by
    ``names``); any other pair gets ``default_link``. ``slowdown`` and ``memory``: per device,
    see `device_cost`."""
    devices = tuple(
        device_cost(
            spec,
            p,
            names[i]
            if i < len(names)
            else _label(p) or getattr(p, "hostname", "") or f"device {i}",
            headroom,
            slowdown[i] if i < len(slowdown) else 1.0,
            memory[i] if i < len(memory) else 0,
        )
        for i, p in enumerate(profiles)
    )
    index: dict[str, int] = {}
    for i, p in enumerate(profiles):
        for label in (_label(p), names[i] if i < len(names) else ""):
            if label:
                index.setdefault(label, i)
    found: dict[tuple[int, int], list[_Measured]] = {}
    measured = [
        (int(x.source == "probe"), x) for x in (*(x for p in profiles for x in p.links), *links)
    ]
    for priority, x in measured:
        if x.a in index and x.b in index and index[x.a] != index[x.b]:
            pair = (min(index[x.a], index[x.b]), max(index[x.a], index[x.b]))
            found.setdefault(pair, []).append(_Measured(priority=priority, profile=x))
    pairs = (_pair_link(a, b, ms) for (a, b), ms in sorted(found.items()))
    return Cluster(
        devices=devices,
        links=tuple(x for x in pairs if x is not None),
        default_link=default_link,
    )


def pricing_note(cluster: Cluster) -> str:
    """How the cluster's devices and links are priced, for a log line or a report: which
    devices by measured shapes, which by a headline score standing in for an unmeasured
    weight format, and which links were measured (how, and when)."""
    names = [d.name for d in cluster.devices]
    shaped = [f"{d.name} ({len(d.matvec.points)})" for d in cluster.devices if d.matvec.points]
    headline = [d.name for d in cluster.devices if not d.score_measured]
    links = [
        f"{names[x.a]}-{names[x.b]} {x.cost.latency * 1e3:.3g} ms, "
        f"{x.cost.bandwidth / 1e6:.3g} MB/s ({x.origin})"
        for x in cluster.links
    ]
    assumed = len(names) * (len(names) - 1) // 2 - len(cluster.links)
    return (
        f"weight reads priced by measured shapes: {', '.join(shaped) or 'none'} (the others by "
        f"their decode score); headline score standing in for the model's weight format: "
        f"{', '.join(headline) or 'none'}; links measured: {'; '.join(links) or 'none'}"
        + (f"; {assumed} assumed ({cluster.default_link.latency * 1e3:.3g} ms)" if assumed else "")
    )
