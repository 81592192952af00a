"""Transfer planning (pure): who fetches which boxes from whom so every node holds its share.

A node holds its shard store's boxes ("memory": written by earlier transfers, kept on disk and
in the page cache, what its worker loaded) and, if it has the model folder, every byte
("files"). A node with the files loads its shard from them and fetches nothing. Any other node
fetches its new share minus what its store holds, each piece from the cheapest peer that holds
it: a peer's store before a peer's files (page cache before disk), the least loaded peer first,
so the bytes spread over every peer that has them. Each fetch lists every peer holding it, so
the client can fall back when its source fails. When nodes are (re)numbered, choose_rank_order
picks the rank order that moves the fewest bytes.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen, replace
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.weights import ranges as R
from exo_tp.weights.boxes import Boxes, rank_boxes
from exo_tp.weights.manifest import ModelManifest, TensorEntry
from exo_tp.wire.ids import ModelIdentity, NodeId, Rank
from exo_tp.wire.weights import SourceKind

COST: dict[str, int] = {"memory": 0, "files": 1}  # a peer's page cache before a peer's disk
# Load is spread over sources in pieces of about this size (whole digest blocks).
CHUNK_BYTES = 16 << 20
# Rank orders tried exhaustively up to this many (5 nodes); beyond, pairwise swaps from the
# given order (never worse than it).
EXHAUSTIVE_ORDERS = 120


class TransferError(ExoTpError):
    """No node holds some bytes a node needs."""


class Holding(Frozen):
    node: NodeId
    files: bool = False  # has the model folder (every byte)
    store: Boxes = Boxes()  # verified boxes in its shard store
    extras: bool = False  # its store holds every extra file (config.json, tokenizer files)


class Source(Frozen):
    node: NodeId
    kind: SourceKind


class Fetch(Frozen):
    """Indices [start, stop) of a tensor (whole digest blocks) and the peers holding them, the
    planned one first, then the fallbacks by cost."""

    tensor: str
    start: int
    stop: int
    sources: tuple[Source, ...]


class NodeTransfer(Frozen):
    node: NodeId
    rank: Rank
    load_from: Literal["files", "store"]
    share: Boxes  # what its rank reads
    retained: Boxes  # the share it already holds
    fetches: tuple[Fetch, ...]
    # Peers to fetch the extra files (config.json, tokenizer files) from, by preference.
    file_sources: tuple[Source, ...] = ()

    @property
    def fetched(self) -> Boxes:
        return Boxes.of((f.tensor, [(f.start, f.stop)]) for f in self.fetches)

    def fetch_bytes(self, manifest: ModelManifest) -> int:
        return sum(manifest.tensor(f.tensor).bytes_of(((f.start, f.stop),)) for f in self.fetches)


class TransferPlan(Frozen):
    model: ModelIdentity
    order: tuple[NodeId, ...]  # the node at each global rank
    nodes: tuple[NodeTransfer, ...]
    moved_bytes: int
    retained_bytes: int
    source_bytes: dict[NodeId, int]  # planned bytes each node serves

    def node(self, node: NodeId) -> NodeTransfer:
        return next(n for n in self.nodes if n.node == node)


def _chunks(entry: TensorEntry, start: int, stop: int, limit: int) -> Iterable[tuple[int, int]]:
    """[start, stop) in runs of whole blocks of at most ``limit`` bytes (at least one block)."""
    blocks = entry.blocks(start, stop)
    lo = start
    for b in blocks:
        hi = entry.cuts[b + 1]
        if hi > lo and (hi - lo) * entry.unit_bytes > limit and entry.cuts[b] > lo:
            yield lo, entry.cuts[b]
            lo = entry.cuts[b]
    if stop > lo:
        yield lo, stop


def _holders(
    entry: TensorEntry, start: int, stop: int, receiver: NodeId, holdings: Sequence[Holding]
) -> list[Source]:
    out = []
    for h in holdings:
        if h.node == receiver:
            continue
        if h.files:
            out.append(Source(node=h.node, kind="files"))
        elif R.covers(h.store.ranges.get(entry.name, ()), ((start, stop),)):
            out.append(Source(node=h.node, kind="memory"))
    return out


def _fetches(
    manifest: ModelManifest,
    receiver: NodeId,
    missing: Boxes,
    holdings: Sequence[Holding],
    load: dict[NodeId, int],
    chunk: int,
) -> list[Fetch]:
    out: list[Fetch] = []
    for name, wanted in missing.ranges.items():
        entry = manifest.tensor(name)
        # Cut where any peer's store starts or stops holding, so each piece is all-or-nothing
        # for every peer.
        bounds = sorted(
            {
                p
                for h in holdings
                if h.node != receiver
                for r in h.store.ranges.get(name, ())
                for p in r
            }
        )
        for a, b in R.split_at(wanted, bounds):
            for lo, hi in _chunks(entry, a, b, chunk):
                sources = _holders(entry, lo, hi, receiver, holdings)
                if not sources:
                    raise TransferError(
                        f"no node holds {name}[{lo}:{hi}] for {receiver} "
                        f"(nobody has the model files)"
                    )
                sources.sort(key=lambda s: (COST[s.kind], load[s.node], s.node))
                load[sources[0].node] += entry.bytes_of(((lo, hi),))
                last = out[-1] if out else None
                if (
                    last is not None
                    and last.tensor == name
                    and last.stop == lo
                    and last.sources[0] == sources[0]
                    and set(last.sources) == set(sources)
                ):
                    out[-1] = replace(last, stop=hi)
                else:
                    out.append(Fetch(tensor=name, start=lo, stop=hi, sources=tuple(sources)))
    return out


def _held(holding: Holding, share: Boxes) -> Boxes:
    return share if holding.files else share.meet(holding.store)


def plan_transfer(
    manifest: ModelManifest,
    plan: PipelinePlan,
    order: Sequence[NodeId],
    holdings: Iterable[Holding],
    chunk: int = CHUNK_BYTES,
) -> TransferPlan:
    """Every node's fetches for ``plan`` with node ``order[r]`` at rank r."""
    if len(order) != plan.size or len(set(order)) != len(order):
        raise ExoTpError(f"{len(order)} nodes {list(order)} for a plan of {plan.size} ranks")
    shares = [rank_boxes(manifest, plan, rank) for rank in range(plan.size)]
    return plan_shares(manifest, shares, order, holdings, chunk)


def plan_shares(
    manifest: ModelManifest,
    shares: Sequence[Boxes],
    order: Sequence[NodeId],
    holdings: Iterable[Holding],
    chunk: int = CHUNK_BYTES,
) -> TransferPlan:
    """Every node's fetches when node ``order[r]`` needs ``shares[r]`` (a serving plan's
    shards, or a fine-tuning job's rows)."""
    by_node = {h.node: h for h in holdings}
    everyone = [by_node.get(n, Holding(node=n)) for n in dict.fromkeys([*by_node, *order])]
    load: dict[NodeId, int] = defaultdict(int)
    nodes, moved, retained = [], 0, 0
    for rank, node in enumerate(order):
        share = shares[rank]
        mine = by_node.get(node, Holding(node=node))
        kept = _held(mine, share)
        fetches = (
            [] if mine.files else _fetches(manifest, node, share.minus(kept), everyone, load, chunk)
        )
        file_sources = (
            []
            if mine.files
            else sorted(
                (
                    Source(node=h.node, kind="files" if h.files else "memory")
                    for h in everyone
                    if h.node != node and (h.files or h.extras)
                ),
                key=lambda s: (COST[s.kind], s.node),
            )
        )
        transfer = NodeTransfer(
            node=node,
            rank=Rank(rank),
            load_from="files" if mine.files else "store",
            share=share,
            retained=kept,
            fetches=tuple(fetches),
            file_sources=tuple(file_sources),
        )
        nodes.append(transfer)
        moved += transfer.fetch_bytes(manifest)
        retained += kept.nbytes(manifest)
    return TransferPlan(
        model=manifest.identity,
        order=tuple(order),
        nodes=tuple(nodes),
        moved_bytes=moved,
        retained_bytes=retained,
        source_bytes=dict(load),
    )


def bytes_to_move(
    manifest: ModelManifest,
    plan: PipelinePlan,
    order: Sequence[NodeId],
    holdings: Mapping[NodeId, Holding],
) -> int:
    """The least bytes any transfer for this order moves: every node's share minus what it
    holds."""
    total = 0
    for rank, node in enumerate(order):
        mine = holdings.get(node, Holding(node=node))
        if not mine.files:
            total += rank_boxes(manifest, plan, rank).minus(mine.store).nbytes(manifest)
    return total


def _swaps(order: tuple[NodeId, ...]) -> Iterable[tuple[NodeId, ...]]:
    for i, j in itertools.combinations(range(len(order)), 2):
        swapped = list(order)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        yield tuple(swapped)


def choose_rank_order(
    manifest: ModelManifest,
    nodes: Sequence[NodeId],
    plan_for: Callable[[tuple[NodeId, ...]], PipelinePlan],
    holdings: Iterable[Holding],
    exhaustive: int = EXHAUSTIVE_ORDERS,
) -> tuple[tuple[NodeId, ...], PipelinePlan]:
    """The order of ``nodes`` over ranks (and its plan: ``plan_for(order)``, which lets shares
    follow the nodes) that moves the fewest bytes; ties keep the given order.

    Exact (every permutation) up to ``exhaustive`` orders; beyond, the best of repeated
    pairwise swaps starting from the given order, so never worse than it.
    """
    by_node = {h.node: h for h in holdings}
    start = tuple(nodes)
    scored: dict[tuple[NodeId, ...], tuple[int, PipelinePlan]] = {}

    def score(order: tuple[NodeId, ...]) -> int:
        if order not in scored:
            plan = plan_for(order)
            scored[order] = (bytes_to_move(manifest, plan, order, by_node), plan)
        return scored[order][0]

    if math.factorial(len(start)) <= exhaustive:
        best = min(itertools.permutations(start), key=lambda o: (score(o), o != start))
    else:
        best = start
        while True:
            better = min(_swaps(best), key=score, default=best)
            if score(better) >= score(best):
                break
            best = better
    score(best)
    return best, scored[best][1]
