"""Shard one transformer block by its architecture table."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch import (
    ArchTable,
    BranchRule,
    GroupedOutputRule,
    LinearRule,
    NormRule,
    SumRule,
)
from exo_tp.arch.dims import HEAD_DIMS, Dim
from exo_tp.arch.table import is_under
from exo_tp.errors import ExoTpError
from exo_tp.plan.slices import RankSelector
from exo_tp.shard.layers import (
    GroupedHeads,
    GroupedScoresMask,
    KeptByOne,
    PartialSum,
    SumFirst,
    ZeroAttention,
    ZeroExperts,
    ZeroMLP,
    ZeroRecurrent,
    ZeroSharingAttention,
)
from exo_tp.shard.sharded_norm import ShardedRMSNorm, counted_mask
from exo_tp.shard.slicing import ShardError, WeightSlicer, sliced_keys
from exo_tp.shard.tree import flat_items, get_path, has_path, set_path


class BlockSharder:
    """Applies one rank's share of the plan to each block: slices, stand-ins, all-reduces."""

    def __init__(
        self,
        table: ArchTable,
        slicer: WeightSlicer,
        ranks: Sequence[RankSelector],
        rank: int,
        width: int,
        group: mx.distributed.Group,
    ):
        self.table = table
        self.slicer = slicer
        self._all = list(ranks)
        self._rank = rank
        self.ranks = self._all  # every rank's selector: a row-parallel bias goes to one holder
        self.mine = ranks[rank]
        self.width = width
        self.group = group

    def shard(self, layer: nn.Module, prefix: str, index: int | None = None) -> None:
        """Shard block ``index`` (by default the number ending ``prefix``) in place."""
        index = int(prefix.rpartition(".")[2]) if index is None else index
        # this layer's sizes (ModelSpec.variants: wider heads, other KV heads, wider FFN)
        self.ranks = [s.layer(index) for s in self._all]
        self.mine = self.ranks[self._rank]

        def has(path: str) -> bool:
            return has_path(layer, path)

        rules = [r for r in self.table.linears if r.applies(has)]
        for rule in rules:
            self._check_dims(rule, prefix)
        branches = [b for b in self.table.branches if b.applies(has)]
        for branch in branches:
            if branch.reduce:
                self._check_covered(layer, prefix, branch, rules)
        empty = [
            b
            for b in branches
            if not any(self.mine.holds(r) for r in rules if is_under(r.path, b.path))
        ]
        # Outermost empty branches get stand-ins; everything inside them is dropped.
        stand_ins = [
            b for b in empty if not any(o is not b and is_under(b.path, o.path) for o in empty)
        ]
        gone = [b.path for b in stand_ins]

        for rule in rules:
            if not any(is_under(rule.path, path) for path in gone):
                self._slice(layer, prefix, rule)
        for grouped in self.table.grouped_outputs:
            if has_path(layer, grouped.inner) and not any(
                is_under(grouped.inner, path) for path in gone
            ):
                self._grouped_output(layer, prefix, grouped)
        norms = [n for n in self.table.norms if n.applies(has)]
        for norm in norms:
            if not any(is_under(norm.path, path) for path in gone):
                set_path(layer, norm.path, self._sharded_norm(layer, prefix, norm))
        for path in self.table.copied:
            if has(path):
                set_path(layer, path, copy.copy(get_path(layer, path)))
        for count in self.table.counts:
            if count.where is not None and not has(count.where):
                continue
            if not any(is_under(count.path, path) for path in gone):
                if not has_path(layer, count.path):
                    raise ExoTpError(f"{prefix}.{count.path}: no such head count attribute")
                per_head = self.mine.spec.head_width(count.width) if count.width else 1
                set_path(layer, count.path, self.mine.count(count.dim) * per_head * count.times)
        sums = [r for r in self.table.sums if r.applies(has)]
        for summed in sums:
            if not any(is_under(summed.path, path) for path in gone):
                self._sum_first(layer, summed, rules, branches)
        for branch in stand_ins:
            joins = tuple(n.dim for n in norms if is_under(n.path, branch.path))
            widths = tuple(
                getattr(self.mine.spec, r.width) for r in sums if is_under(r.path, branch.path)
            )
            stand_in = self._stand_in(branch, joins, widths)
            _keep_settings(stand_in, get_path(layer, branch.path))
            set_path(layer, branch.path, stand_in)
        for branch in branches:
            if branch.reduce:
                inner = get_path(layer, branch.path)
                if branch.kind == "attention" and self.table.grouped_scores:
                    inner = GroupedScoresMask(inner)
                set_path(layer, branch.path, PartialSum(inner, self.width, self.group))

    def _check_dims(self, rule: LinearRule, prefix: str) -> None:
        spec = self.mine.spec
        for dim in rule.parts:
            known = dim in HEAD_DIMS and (dim != Dim.LINEAR_HEADS or spec.linear_attention)
            if not known and dim not in spec.ffn_sizes:
                raise ExoTpError(
                    f"{prefix}.{rule.path} is split by {dim!r}, "
                    f"but config.json gives no size for it"
                )

    def _check_covered(
        self, layer: nn.Module, prefix: str, branch: BranchRule, rules: Sequence[LinearRule]
    ) -> None:
        """Every parameter of a branch is split by a rule or declared replicated.

        Otherwise a projection the table does not know would be used whole on every rank and
        summed N times: refuse instead of computing something wrong.
        """
        known = [r.path for r in rules] + [n.path for n in self.table.norms]
        known += [p for g in self.table.grouped_outputs for p in (g.inner, g.outer)]
        known += list(self.table.replicated)
        if not any(is_under(r.path, branch.path) for r in rules):
            raise ExoTpError(
                f"{prefix}.{branch.path}: the {self.table.model_types[0]} table "
                f"splits nothing inside it"
            )
        params = flat_items(get_path(layer, branch.path).parameters())
        for name, _ in params:
            path = f"{branch.path}.{name}"
            if not any(is_under(path, k) for k in known):
                raise ExoTpError(
                    f"{prefix}.{path}: the tensor-parallel table for "
                    f"{self.table.model_types[0]} does not say how to split it"
                )

    def _slice(self, layer: nn.Module, prefix: str, rule: LinearRule) -> None:
        name = f"{prefix}.{rule.path}"
        ranges, expected = self.mine.rule(rule)
        if not ranges:  # zero-size weights break MLX kernels: a branch must stand in
            raise ShardError(f"{name}: empty on this rank but no enclosing branch stands in")
        if rule.style == "stacked":
            parent, _, key = rule.path.rpartition(".")
            owner = get_path(layer, parent) if parent else layer
            self.slicer.slice_leading(name, owner, key, ranges, expected)
            return
        module = get_path(layer, rule.path)
        if rule.style == "column":
            self.slicer.slice_rows(name, module, ranges, expected)
            return
        holder = next(s for s in self.ranks if s.holds(rule))
        self.slicer.slice_columns(name, module, ranges, expected, keep_bias=holder is self.mine)

    def _grouped_output(self, layer: nn.Module, prefix: str, rule: GroupedOutputRule) -> None:
        """The inner entries and outer columns of the groups this rank's heads touch (see
        GroupedOutputRule; at most two groups' entries beyond its own heads)."""
        heads = self.mine.shard.heads.q_heads
        inner = get_path(layer, rule.inner)
        groups, rank_width = inner["weight"].shape[:2]
        per_group = self.mine.spec.num_heads // groups
        touched = self.mine.touched_groups(groups)
        name = f"{prefix}.{rule.inner}"
        for key in sliced_keys(name, inner):
            inner[key] = self.slicer.take(
                f"{name}.{key}", inner[key], 0, [(touched.start, touched.stop)]
            )
        # Every rank touching a group holds its outer columns and multiplies its own heads'
        # part of that group: the branch's all-reduce adds the parts.
        holder = next(s for s in self.ranks if s.shard.heads.q_heads.size)
        columns = [(touched.start * rank_width, touched.stop * rank_width)]
        outer = get_path(layer, rule.outer)
        name = f"{prefix}.{rule.outer}"
        self.slicer.slice_columns(
            name, outer, columns, groups * rank_width, keep_bias=holder is self.mine
        )
        start = heads.start - touched.start * per_group  # its first head's place in its group
        grouped = GroupedHeads(inner, start, per_group, touched.size, self.mine.spec.head_dim)
        set_path(layer, rule.inner, grouped)
        set_path(layer, rule.groups, 1)
        set_path(layer, rule.ids, mx.zeros((1, 1), dtype=mx.uint32))

    def _sharded_norm(self, layer: nn.Module, prefix: str, rule: NormRule) -> ShardedRMSNorm:
        """This rank's entries of a full-width norm, counting each head once (see NormRule)."""
        name = f"{prefix}.{rule.path}"
        norm = get_path(layer, rule.path)
        width = self.mine.spec.head_width(rule.width)
        ranges, full = self.mine.packed((rule.dim,), width)
        _check_norm(name, norm, full)
        weight = self.slicer.take(f"{name}.weight", norm["weight"], -1, ranges)
        counted = None
        if rule.dim == Dim.KV_HEADS:  # replicated KV heads: only the first holder counts them
            me = self.ranks.index(self.mine)
            earlier = {k for s in self.ranks[:me] for k in s.shard.heads.kv_heads}
            counted = counted_mask(self.mine.shard.heads.kv_heads, earlier, width)
        return ShardedRMSNorm(weight, norm.eps, full, counted, self.group)

    def _sum_first(
        self,
        layer: nn.Module,
        rule: SumRule,
        rules: Sequence[LinearRule],
        branches: Sequence[BranchRule],
    ) -> None:
        """Wrap a SumRule's module (its input all-reduced first) and the module after it
        (kept by the first rank holding the enclosing branch, see ArchTable.sums)."""
        width = getattr(self.mine.spec, rule.width)
        set_path(layer, rule.path, SumFirst(get_path(layer, rule.path), width, self.group))
        outer = next(b for b in branches if b.reduce and is_under(rule.path, b.path))
        inside = [r for r in rules if is_under(r.path, outer.path)]
        holder = next(s for s in self.ranks if any(s.holds(r) for r in inside))
        once = get_path(layer, rule.once)
        set_path(layer, rule.once, KeptByOne(once, self.width, keep=holder is self.mine))

    def _stand_in(
        self, branch: BranchRule, joins: tuple[Dim, ...] = (), sums: tuple[int, ...] = ()
    ) -> nn.Module:
        if branch.kind == "attention" and branch.shares_kv:
            return ZeroSharingAttention(self.width, self.mine.spec.head_dim)
        if branch.kind == "attention":
            return ZeroAttention(self.width, self.mine.spec.head_dim, joins, self.group)
        if branch.kind == "recurrent":
            return ZeroRecurrent(self.width)
        if branch.kind == "experts":
            return ZeroExperts(self.width)
        return ZeroMLP(self.width, sums, self.group)


def _check_norm(name: str, norm: nn.Module, full: int) -> None:
    weight = norm.get("weight") if isinstance(norm, nn.Module) else None
    if not isinstance(weight, mx.array) or weight.shape != (full,) or not hasattr(norm, "eps"):
        shape = None if weight is None else tuple(weight.shape)
        raise ExoTpError(f"{name}: expected an RMSNorm of width {full}, found {shape}")


def _keep_settings(stand_in: nn.Module, original: nn.Module) -> None:
    """Plain settings of the replaced sub-block (EXAONE 4's model reads ``self_attn.is_local``
    to pick each layer's mask) stay readable on its stand-in; its weights do not."""
    for key, value in vars(original).items():
        if key.startswith("_") or key in vars(stand_in):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            setattr(stand_in, key, value)
