"""Frozen base layers holding one rank's rows, gathered whole just in time for each use.

They stand in for mlx-lm's own `nn.Linear`, `nn.QuantizedLinear`, `nn.Embedding` and
`nn.QuantizedEmbedding` (the base of a `LoRALinear`, or a layer LoRA does not touch) and
compute exactly what those compute, on the gathered weights. A linear is an
`mx.custom_function` whose vjp gathers the weights again instead of keeping them from the
forward pass; the weights get no gradient (they are frozen), the input does.

A linear cut by input columns (`exo_tp.finetune.columns`) holds its parts transposed, its
columns as rows, so the same row gather joins them; the gathered parts are transposed back
(bit-exact: a copy) and its bias, held whole, is added to them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn

from exo_tp.finetune.gather import GatherChain, Parts

PARTS = ("weight", "scales", "biases", "bias")


@dataclass(frozen=True)
class Layout:
    """How a layer is cut: each gathered part's rows per rank and whole shape (as gathered:
    transposed for a column cut)."""

    sizes: dict[str, tuple[int, ...]]
    shapes: dict[str, tuple[int, ...]]
    columns: bool = False  # parts held transposed (a row-parallel linear cut by columns)


@dataclass(frozen=True)
class Quantization:
    """How a quantized base layer is packed (as mlx-lm's QuantizedLinear holds it)."""

    group_size: int
    bits: int
    mode: str = "affine"


def quantization_of(module: nn.Module) -> Quantization | None:
    if "scales" not in module:
        return None
    return Quantization(module.group_size, module.bits, getattr(module, "mode", "affine"))


class ShardedBase(nn.Module):
    """This rank's rows of every part of a base layer (weight, quantization scales and biases,
    bias), all cut at the same rows so a quantized row stays whole; or, cut by columns, its
    columns of the weight and its scales and biases, and the whole bias (``replicated``)."""

    def __init__(
        self,
        parts: Parts,
        layout: Layout,
        chain: GatherChain,
        quantization: Quantization | None,
        replicated: Parts | None = None,
    ):
        super().__init__()
        replicated = replicated or {}
        for name in PARTS:
            if name in parts:
                self[name] = parts[name]
            elif name in replicated:
                self[name] = replicated[name]
        # Plain attributes (not arrays, lists or dicts), so not part of the parameter tree.
        self._layout = layout
        self._chain = chain
        self._quantization = quantization  # None: float
        self.freeze()

    def shards(self) -> Parts:
        layout: Layout = self._layout
        return {name: self[name] for name in PARTS if name in layout.sizes}

    def cut(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        layout: Layout = self._layout
        return layout.sizes, layout.shapes

    def assemble(self, gathered: Parts) -> Parts:
        """The layer's parts as mlx-lm holds them, from the gathered shards."""
        layout: Layout = self._layout
        if not layout.columns:
            return gathered
        whole = {name: mx.contiguous(part.T) for name, part in gathered.items()}
        whole.update({n: self[n] for n in PARTS if n in self and n not in layout.sizes})
        return whole

    def _linear(self, x: mx.array, full: Parts) -> mx.array:
        """What mlx-lm's (quantized) linear computes with these weights."""
        q = self._quantization
        if q is None:
            if "bias" in full:
                return mx.addmm(full["bias"], x, full["weight"].T)
            return x @ full["weight"].T
        y = mx.quantized_matmul(
            x,
            full["weight"],
            scales=full["scales"],
            biases=full.get("biases"),
            transpose=True,
            **asdict(q),
        )
        return y + full["bias"] if "bias" in full else y

    def _linear_input_grad(self, cotangent: mx.array, full: Parts) -> mx.array:
        q = self._quantization
        if q is None:
            return cotangent @ full["weight"]
        return mx.quantized_matmul(
            cotangent,
            full["weight"],
            scales=full["scales"],
            biases=full.get("biases"),
            transpose=False,
            **asdict(q),
        )

    def _gathered_linear(self, x: mx.array) -> mx.array:
        chain: GatherChain = self._chain
        k, full = chain.forward(self, x, differentiable=True)
        names = list(self.shards())
        # Handed over, not captured: MLX keeps the function alive with the graph, and a
        # captured dict would keep the gathered weights alive until the backward pass.
        handover = [full]
        del full

        @mx.custom_function
        def linear(x: mx.array, *shards: mx.array) -> mx.array:
            return self._linear(x, handover.pop())

        @linear.vjp
        def linear_vjp(
            primals: tuple[mx.array, ...], cotangent: mx.array, output: mx.array
        ) -> tuple[mx.array, ...]:
            x, *shards = primals
            again = chain.backward(k, self, dict(zip(names, shards, strict=True)), cotangent)
            return (self._linear_input_grad(cotangent, again), *(mx.zeros_like(s) for s in shards))

        # mlx's stub types custom_function's call as object: it returns linear's array
        return linear(x, *(self[n] for n in names))  # type: ignore[return-value]


class ShardedLinear(ShardedBase):
    def __call__(self, x: mx.array) -> mx.array:
        return self._gathered_linear(x)


class ShardedEmbedding(ShardedBase):
    """An embedding table by vocabulary rows; a lookup starts a forward pass of the chain."""

    def __call__(self, ids: mx.array) -> mx.array:
        chain: GatherChain = self._chain
        chain.begin()
        _, full = chain.forward(self, ids, differentiable=False)
        q = self._quantization
        if q is None:
            return full["weight"][ids]
        biases = full.get("biases")
        return mx.dequantize(
            full["weight"][ids],
            scales=full["scales"][ids],
            biases=biases[ids] if biases is not None else None,
            **asdict(q),
        )

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied LM head."""
        return self._gathered_linear(x)
