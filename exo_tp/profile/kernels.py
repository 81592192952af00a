"""Matrix-vector (decode) and matrix-matrix (prefill) throughput of the products the engine runs.

Each product is what an `nn.Linear` / `nn.QuantizedLinear` layer does: ``x @ W.T`` with W stored
(N, K) as in a checkpoint. Float weights compute with activations of their own dtype; quantized
weights (MLX affine, 4-bit, group 32 or 64) with float32 activations, scales and biases, as the
engine runs them on CPU.

Decode-shaped products stream over a working set of distinct matrices (at least
``DECODE_WORKING_SET`` bytes, beyond per-core caches and Apple chips' system cache) so the
weights come from memory, as when a model's layers are read once per token (on the 2-core x86
box, 61 MB and 510 MB working sets give the same float32 matvec speed, 8 MB twice as fast);
prefill-shaped products are compute-bound and reuse one matrix. Weight values are random:
their speed does not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx

from exo_tp.plan.devices import MatmulScore
from exo_tp.profile.timing import mean_seconds
from exo_tp.shard.row_pieces import piece_rows, pieces_wanted, product
from exo_tp.wire.profiles import ENGINE_DTYPE

# (K, N) of real layers: SmolLM2-135M attention in/FFN up (576 -> 1536) and FFN down, a 1B-class
# FFN (2048 <-> 8192) and an 8B-class attention projection (4096 x 4096).
DECODE_SHAPES: tuple[tuple[int, int], ...] = (
    (576, 1536),
    (1536, 576),
    (2048, 8192),
    (8192, 2048),
    (4096, 4096),
)
PREFILL_TOKENS = 128
PREFILL_SHAPES: tuple[tuple[int, int], ...] = ((576, 1536), (1536, 576), (2048, 2048))
DTYPES = ("float32", "bfloat16", "float16", "q4g32", "q4g64")
DECODE_WORKING_SET = 64 * 2**20

_FLOAT = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_QUANT = {"q4g32": (4, 32), "q4g64": (4, 64)}


@dataclass(frozen=True)
class KernelCase:
    kind: Literal["matvec", "matmul"]
    dtype: str
    m: int
    k: int
    n: int

    @property
    def label(self) -> str:
        return f"{self.kind} {self.dtype} {self.m}x{self.k}.{self.k}x{self.n}"


def kernel_cases(quick: bool = False) -> list[KernelCase]:
    """Every dtype's decode products; the prefill products of every dtype, or on a quick run
    only of ``ENGINE_DTYPE``: the planner reads prefill speed in that dtype alone, and the
    other dtypes' 128-token products (CPU builds have no fast half-precision or quantized
    matmul) took ~4 of a quick run's ~13 s on the 2-core x86 box."""
    prefill = (ENGINE_DTYPE,) if quick else DTYPES
    return [KernelCase("matvec", d, 1, k, n) for d in DTYPES for k, n in DECODE_SHAPES] + [
        KernelCase("matmul", d, PREFILL_TOKENS, k, n) for d in prefill for k, n in PREFILL_SHAPES
    ]


Weight = tuple[mx.array, ...]  # (w,) or (packed, scales, biases)


class WeightSource:
    """Random values every benchmark matrix is carved from (contiguous views), generated once:
    decode working sets are large, and generating them per kernel would dominate a quick run."""

    def __init__(self, shapes: tuple[tuple[int, int], ...] = ()) -> None:
        """``shapes``: (k, n) of products beyond the bench's own it will be asked for."""
        largest = max(k * n for k, n in DECODE_SHAPES + PREFILL_SHAPES + shapes)
        # Enough float32 words for any working set below even at 2 bytes per element.
        self.words = mx.random.uniform(-1, 1, (DECODE_WORKING_SET // 2 + largest,))
        mx.eval(self.words)
        self._cast: tuple[str, mx.array] = ("float32", self.words)

    def _as(self, dtype: str) -> mx.array:
        if self._cast[0] != dtype:  # keep one cast at a time (memory); a recast takes ~40 ms
            self._cast = (dtype, self.words.astype(_FLOAT[dtype]))
            mx.eval(self._cast[1])
        return self._cast[1]

    def weights(self, dtype: str, k: int, n: int, count: int) -> list[Weight]:
        if dtype in _FLOAT:
            flat, size = self._as(dtype), n * k
            return [(flat[i * size : (i + 1) * size].reshape(n, k),) for i in range(count)]
        bits, group = _QUANT[dtype]
        # Packed words reuse the random float bits (any bit pattern is a valid 4-bit weight).
        packed_size, scale_size = n * k * bits // 32, n * k // group
        words, bits32, at = self.words, self.words.view(mx.uint32), 0
        out: list[Weight] = []
        for _ in range(count):
            packed = bits32[at : at + packed_size].reshape(n, -1)
            at += packed_size
            scales = words[at : at + scale_size].reshape(n, -1) * 0.01
            biases = words[at + scale_size : at + 2 * scale_size].reshape(n, -1) * 0.01
            at += 2 * scale_size
            out.append((packed, scales, biases))
        return out


def weight_bytes(dtype: str, k: int, n: int) -> int:
    """Bytes of one (N, K) weight as stored: scales and biases (float32) included."""
    if dtype in _FLOAT:
        return n * k * _FLOAT[dtype].size
    bits, group = _QUANT[dtype]
    return n * k * bits // 8 + 2 * (n * k // group) * 4


def _product(dtype: str) -> Callable[[mx.array, Weight], mx.array]:
    if dtype in _FLOAT:
        # As a rank multiplies: one-row float32 products in row pieces where it does so.
        pieces = pieces_wanted()
        return lambda x, w: product(x, w[0], piece_rows(w[0]) if pieces else None)
    bits, group = _QUANT[dtype]

    def quantized(x: mx.array, w: Weight) -> mx.array:
        packed, scales, biases = w
        return mx.quantized_matmul(
            x, packed, scales, biases, transpose=True, group_size=group, bits=bits
        )

    return quantized


def measure_kernel(
    case: KernelCase, source: WeightSource, min_seconds: float, work_factor: float = 1.0
) -> MatmulScore:
    """Mean time of one product of ``case`` over at least ``min_seconds`` of wall time.

    ``work_factor`` (the lab's emulated slow device, exo_tp.lab): each product does that many
    times the work, as the served matmuls do, so the device scores that many times lower."""
    one = weight_bytes(case.dtype, case.k, case.n)
    decode = case.kind == "matvec"
    count = math.ceil(DECODE_WORKING_SET / one) if decode else 1
    weights = source.weights(case.dtype, case.k, case.n, count)
    x = mx.random.uniform(-1, 1, (case.m, case.k)).astype(_FLOAT.get(case.dtype, mx.float32))
    mx.eval(weights, x)  # scales/biases are computed views: materialise them before timing
    multiply = _product(case.dtype)
    every = weights
    if work_factor != 1:
        from exo_tp.lab.slowdown import extra_weights

        every = weights + extra_weights(weights, work_factor)
    # A prefill product is long and compute-bound: no warm-up, one timed product is enough.
    pass_seconds = mean_seconds(
        lambda: mx.eval([multiply(x, w) for w in every]),
        min_seconds,
        min_steps=2 if decode else 1,
        warm_up=decode,
    )
    seconds = pass_seconds / count
    return MatmulScore(
        kind=case.kind,
        dtype=case.dtype,
        m=case.m,
        k=case.k,
        n=case.n,
        seconds=seconds,
        flops=2 * case.m * case.k * case.n / seconds,
        weight_bytes_per_second=one / seconds,
        weight_bytes=one,
        working_set_bytes=one * count,
    )
