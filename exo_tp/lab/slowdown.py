"""The work factor applied to a rank's shard: every matmul does s times the real work.

Each linear layer of the shard (and the vocab-parallel LM head) is wrapped: besides its own
product it multiplies the same input by (s - 1) whole copies of its weight slice plus a slice of
rows of one more copy (fractional s), each copy a distinct buffer, so the bytes read and the
FLOPs both scale by s, layer by layer. The extra outputs are folded into the real output as
``0 * extra[..., :1]``: MLX evaluates the whole graph an output depends on, so the extra
products run, and since every copy's first column equals the real output's first column, the
term is an exact zero (a non-finite extra would mean a non-finite real output already).

The factor is read on every call, so it can change while serving; copies are made (lazily, in
the serving thread) the first time a factor needs them. Nothing here runs unless the lab option
is on: `slow_down` is only called when the rank's environment sets a factor.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from exo_tp.lab.factor import FactorSource, source_from_env, split_factor
from exo_tp.shard.layers import VocabParallelEmbedding, VocabParallelHead, Wrapper
from exo_tp.shard.tree import flat_items, set_path

log = logging.getLogger(__name__)

_LINEARS = (nn.Linear, nn.QuantizedLinear)


def _copy_rows(module: nn.Module, rows: int) -> nn.Module:
    """A module like ``module`` whose parameters are fresh copies of its first ``rows`` output
    rows (every parameter of a linear or embedding has output rows as its first axis)."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    for key, value in module.items():
        clone[key] = value
    # `* 1` makes a new buffer (the source is still referenced, so it cannot be donated).
    clone.update(tree_map(lambda p: p[:rows] * 1, module.parameters()))
    mx.eval(clone.parameters())
    return clone


def _rows(module: nn.Module) -> int:
    return int(module["weight"].shape[0])


class _Copies:
    """The extra copies of one module for the current factor (rebuilt when it changes)."""

    def __init__(self, module: nn.Module):
        self._module = module
        self._factor = 1.0
        self.copies: list[nn.Module] = []

    def for_factor(self, factor: float) -> list[nn.Module]:
        if factor != self._factor:
            whole, fraction = split_factor(factor)
            rows = _rows(self._module)
            keep = [c for c in self.copies if _rows(c) == rows][:whole]
            while len(keep) < whole:
                keep.append(_copy_rows(self._module, rows))
            part = math.ceil(fraction * rows - 1e-9)
            if part > 0:
                keep.append(_copy_rows(self._module, part))
            self.copies, self._factor = keep, factor
        return self.copies


def _tie(out: mx.array, extras: list[mx.array]) -> mx.array:
    if not extras:
        return out
    first = extras[0][..., :1]
    for extra in extras[1:]:
        first = first + extra[..., :1]
    return out + (first * 0).astype(out.dtype)


class SlowLinear(Wrapper):
    """A linear layer doing ``factor`` times its work on the same input (its attributes read
    through: model code may read a linear's weight dtype)."""

    def __init__(self, inner: nn.Module, source: FactorSource):
        super().__init__(inner)
        self._source = source
        self._copies = _Copies(inner)

    @property
    def source(self) -> FactorSource:
        """Where this layer reads its factor (a probe wrapped alike follows the same one)."""
        return self._source

    def __call__(self, x: mx.array) -> mx.array:
        out = self.inner(x)
        factor = self._source.factor
        if factor == 1:
            return out
        return _tie(out, [c(x) for c in self._copies.for_factor(factor)])


class SlowHeadRows(nn.Module):
    """A vocab-parallel embedding used as the tied LM head: lookups unchanged, the head's
    matmul ``factor`` times the work."""

    def __init__(self, inner: nn.Module, source: FactorSource):
        super().__init__()
        self.inner = inner
        self._source = source
        self._copies = _Copies(inner)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.inner(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        out = self.inner.as_linear(x)
        factor = self._source.factor
        if factor == 1:
            return out
        return _tie(out, [c.as_linear(x) for c in self._copies.for_factor(factor)])


def _targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for path, module in flat_items(
        model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)
    ):
        if isinstance(module, _LINEARS):
            found.append((path, module))
    return found


def slow_down(model: nn.Module, source: FactorSource) -> int:
    """Wrap every matmul of this rank's shard; returns how many were wrapped."""
    wrapped = 0
    for path, module in _targets(model):
        set_path(model, path, SlowLinear(module, source))
        wrapped += 1
    for _, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding) and module._local_size:
            module.inner = SlowHeadRows(module.inner, source)
            wrapped += 1
        elif isinstance(module, VocabParallelHead):
            pass  # its inner linear was wrapped above
    return wrapped


def slow_down_from_env(model: nn.Module) -> FactorSource | None:
    """Apply the environment's work factor to the loaded shard (nothing when it sets none)."""
    source = source_from_env()
    if source is not None:
        count = slow_down(model, source)
        log.info("lab work factor %g on %d matmuls", source.factor, count)
    return source


def extra_weights(weights: list[tuple[mx.array, ...]], factor: float) -> list[tuple[mx.array, ...]]:
    """For the device bench: the weights a ``factor`` adds to one pass over ``weights``, so the
    bench's kernels do the same s-times work as the served matmuls and score s times lower.
    Whole passes take the working set's other matrices in turn (distinct bytes, beyond the
    caches like the real copies), the fraction a slice of rows of each."""
    whole, fraction = split_factor(factor)
    count = len(weights)
    extra = [weights[(j + i + 1) % count] for i in range(whole) for j in range(count)]
    if fraction > 0:
        for w in weights:
            rows = math.ceil(fraction * w[0].shape[0] - 1e-9)
            extra.append(tuple(p[:rows] for p in w))
    mx.eval(extra)
    return extra
