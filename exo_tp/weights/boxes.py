"""Which ranges of which file tensors one rank of a PipelinePlan reads (pure).

This follows the loader step by step (exo_tp.shard.apply.load_shard, blocks.BlockSharder,
slicing.WeightSlicer) over the manifest's parameter names instead of a built model: a stage's
layers only; in each layer the rules whose module exists, a branch of which the rank holds no
split weight replaced by a stand-in (nothing inside it read), split weights cut by
RankSelector, a row-parallel bias whole on the one rank that keeps it, every other parameter
whole; the vocabulary-parallel embedding (first stage, and the last when tied) and LM head (last
stage); the final norm and the checkpoint's MTP heads on the last stage only.

Tensors the loader does not read straight from the files (``TensorEntry.sliceable`` false:
model.sanitize() renames, stacks or transforms them) are needed whole by every rank holding
their layer (every rank for tensors outside the layers): correct whatever sanitize makes of
them, at the cost of moving more than the share for such checkpoints (mlx-lm's own converted
checkpoints have none).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from exo_tp.arch import ArchTable, Dim, LinearRule, table_for
from exo_tp.arch.table import is_under
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan.mtp import is_heads_tensor
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.slices import RankSelector
from exo_tp.weights import ranges as R
from exo_tp.weights.layout import Place, locate
from exo_tp.weights.manifest import ModelManifest, TensorEntry
from exo_tp.weights.ranges import Ranges


class Boxes(Frozen):
    """Index ranges of file tensors, each along its manifest axis (``TensorEntry.axis``) and
    whole along every other axis; tensors without ranges are absent."""

    ranges: dict[str, Ranges] = {}

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, Iterable[tuple[int, int]]]]) -> Boxes:
        merged: dict[str, list[tuple[int, int]]] = {}
        for name, rs in pairs:
            merged.setdefault(name, []).extend(rs)
        return cls(ranges={k: n for k, v in merged.items() if (n := R.normalize(v))})

    def union(self, other: Boxes) -> Boxes:
        return Boxes.of([*self.ranges.items(), *other.ranges.items()])

    def minus(self, other: Boxes) -> Boxes:
        out = {}
        for name, rs in self.ranges.items():
            left = R.subtract(rs, other.ranges.get(name, ()))
            if left:
                out[name] = left
        return Boxes(ranges=out)

    def meet(self, other: Boxes) -> Boxes:
        out = {}
        for name, rs in self.ranges.items():
            both = R.intersect(rs, other.ranges.get(name, ()))
            if both:
                out[name] = both
        return Boxes(ranges=out)

    def covers(self, other: Boxes) -> bool:
        return not other.minus(self).ranges

    def nbytes(self, manifest: ModelManifest) -> int:
        return sum(manifest.tensor(n).bytes_of(rs) for n, rs in self.ranges.items())

    def pieces(self) -> Iterator[tuple[str, int, int]]:
        for name, rs in self.ranges.items():
            for a, b in rs:
                yield name, a, b


def whole(manifest: ModelManifest) -> Boxes:
    """Every byte of the model (what a node with the model files holds)."""
    return Boxes(ranges={t.name: ((0, t.length),) for t in manifest.tensors if t.length})


def loader_axis(rule: LinearRule, key: str | None, ndim: int) -> int:
    """The axis exo_tp.shard.slicing cuts a split parameter on."""
    if rule.style == "stacked":
        return 0
    if key == "bias":
        return ndim - 1
    return ndim - (2 if rule.style == "column" else 1)


class _Reads:
    """Accumulates one rank's reads, checked against the manifest's axes and blocks."""

    def __init__(self, manifest: ModelManifest):
        self.manifest = manifest
        self.ranges: dict[str, list[tuple[int, int]]] = {}

    def _entry(self, name: str) -> TensorEntry | None:
        entry = self.manifest.by_name.get(name)
        # Not read from the files as such: its sources are moved whole (see the docstring).
        return entry if entry is not None and entry.sliceable else None

    def whole(self, name: str) -> None:
        if (entry := self._entry(name)) is not None and entry.length:
            self.ranges.setdefault(name, []).append((0, entry.length))

    def slices(self, name: str, axis: int, ranges: list[tuple[int, int]], total: int) -> None:
        """``ranges`` of the logical axis (length ``total``) the loader cuts ``name`` on."""
        entry = self._entry(name)
        if entry is None or not ranges:
            return
        if entry.axis != axis or not entry.shape:
            raise ExoTpError(
                f"{name}: the manifest cuts it on axis {entry.axis}, the loader "
                f"on axis {axis}: rebuild the manifest"
            )
        stored = []
        for a, b in ranges:  # storage index = logical * length / total (packed columns)
            if (a * entry.length) % total or (b * entry.length) % total:
                raise ExoTpError(f"{name}: a slice [{a}, {b}) of {total} cuts packed storage")
            stored.append((a * entry.length // total, b * entry.length // total))
        for lo, hi in R.normalize(stored):
            entry.blocks(lo, hi)  # raises if a plan cuts inside a digest block
        self.ranges.setdefault(name, []).extend(stored)

    def boxes(self) -> Boxes:
        return Boxes.of(self.ranges.items())


# (id of a table in TABLES, the layer kind's modules a rule may apply ``where``, path in a layer)
_PLACES: dict[tuple[int, frozenset[str], str], Place] = {}


def _locate_in_layer(table: ArchTable, kinds: frozenset[str], path: str) -> Place:
    """Where ``path`` inside any layer holding the modules ``kinds`` (of all the table's
    ``where`` paths) sits: the same in every such layer."""
    key = (id(table), kinds, path)
    if key not in _PLACES:
        has = {f"{table.layers}.0.{k}" for k in kinds}.__contains__
        _PLACES[key] = locate(f"{table.layers}.0.{path}", table, has)
    return _PLACES[key]


def _rule_ranges(selector: RankSelector, rule: LinearRule) -> tuple[list[tuple[int, int]], int]:
    cache = selector.__dict__.setdefault("_rules", {})  # per call of rank_boxes
    if id(rule) not in cache:
        cache[id(rule)] = selector.rule(rule)
    return cache[id(rule)]


def _layer(
    reads: _Reads, table: ArchTable, selectors: list[RankSelector], local: int, layer: int
) -> None:
    """BlockSharder.shard, as reads."""
    manifest = reads.manifest
    prefix = f"{table.layers}.{layer}"
    selectors = [s.layer(layer) for s in selectors]  # its sizes (ModelSpec.variants)
    mine = selectors[local]

    def has(path: str) -> bool:
        return manifest.has(f"{prefix}.{path}")

    rules = [r for r in table.linears if r.applies(has)]
    branches = [b for b in table.branches if b.applies(has)]
    wheres = {r.where for r in (*table.linears, *table.branches) if r.where is not None}
    kinds = frozenset(w for w in wheres if has(w))
    empty = [
        b for b in branches if not any(mine.holds(r) for r in rules if is_under(r.path, b.path))
    ]
    gone = [
        b.path for b in empty if not any(o is not b and is_under(b.path, o.path) for o in empty)
    ]
    for path in manifest.numbered.get((table.layers, layer), ()):
        if any(is_under(path, g) for g in gone):
            continue
        name = f"{prefix}.{path}"
        place = _locate_in_layer(table, kinds, path)
        entry = manifest.by_name.get(name)
        if place.kind == "grouped" and entry is not None:
            _grouped(reads, place, entry, mine)
            continue
        if place.kind != "rule" or entry is None:
            reads.whole(name)
            continue
        rule = place.rule
        assert rule is not None
        if rule.style == "row" and place.key == "bias":
            holder = next((s for s in selectors if s.holds(rule)), None)
            if holder is mine:
                reads.whole(name)
            continue
        ranges, total = _rule_ranges(mine, rule)
        reads.slices(name, loader_axis(rule, place.key, len(entry.shape)), ranges, total)


def _grouped(reads: _Reads, place: Place, entry: TensorEntry, mine: RankSelector) -> None:
    """BlockSharder._grouped_output, as reads: the groups this rank's heads touch."""
    attention = mine.spec.compressed_attention
    if attention is None:  # no sizes to cut by: read whole, as the loader would need it
        reads.whole(entry.name)
        return
    touched = mine.touched_groups(attention.o_groups)
    if not place.outer:
        reads.slices(entry.name, 0, [(touched.start, touched.stop)], attention.o_groups)
        return
    width = attention.o_lora_rank
    columns = [(touched.start * width, touched.stop * width)]
    reads.slices(entry.name, len(entry.shape) - 1, columns, attention.o_groups * width)


def rank_boxes(manifest: ModelManifest, plan: PipelinePlan, rank: int) -> Boxes:
    """Everything rank ``rank`` of ``plan`` reads from the model files to build its shard."""
    spec = plan.spec
    table = table_for(spec.model_type)
    index, local = plan.locate(rank)
    stage = plan.stages[index]
    first, last = index == 0, index == len(plan.stages) - 1
    selectors = [RankSelector(stage.tp, r) for r in range(stage.size)]
    reads = _Reads(manifest)
    for layer in range(stage.layers.start, stage.layers.stop):
        _layer(reads, table, selectors, local, layer)

    tied = not manifest.has(table.lm_head)
    vocab = selectors[local].ranges(Dim.VOCAB)
    numbered = {
        f"{head}.{i}.{p}"
        for (head, i), paths in manifest.numbered.items()
        if head == table.layers
        for p in paths
    }
    for name in manifest.parameters:
        if name in numbered:
            continue
        place = locate(name, table)
        if place.kind in ("embedding", "lm_head", "vocab_table"):
            if place.kind == "lm_head":
                held = last and not tied
            else:  # the embedding serves as the tied head too; other tables only the first
                held = first or (last and tied and place.kind == "embedding")
            entry = manifest.by_name.get(name)
            if held and entry is not None and entry.shape[-2:-1] != (spec.vocab_size,):
                reads.whole(name)  # a table of another vocabulary: kept whole
            elif held and entry is not None:  # (vocab, hidden): rows are tokens
                reads.slices(name, len(entry.shape) - 2, vocab, spec.vocab_size)
        elif place.kind != "norm" or last:
            reads.whole(name)

    # Tensors sanitize() turns into parameters: whole, wherever their layer is held.
    extra = []
    for entry in manifest.tensors:
        if entry.sliceable or not entry.length:
            continue
        if spec.mtp_bytes and is_heads_tensor(entry.name, spec.num_layers):
            if last:  # the MTP heads: whole on the last stage's ranks, which draft with them
                extra.append((entry.name, [(0, entry.length)]))
            continue
        held_in = locate(entry.name, table).layer
        if held_in is None or held_in in stage.layers:
            extra.append((entry.name, [(0, entry.length)]))
    return reads.boxes().union(Boxes.of(extra))
