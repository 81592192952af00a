"""The quantized KV cache's flags, with mlx-lm's names and defaults (`exo-tp run` and
`exo-tp launch`), and the one check both make before any rank starts."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from exo_tp.cli.args import non_negative_int
from exo_tp.errors import ExoTpError
from exo_tp.plan.kv_width import KV_BITS, KV_GROUP_SIZES, kv_quantization_problem

if TYPE_CHECKING:
    from exo_tp.plan.spec import ModelSpec


def add_kv_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        help="quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache; each rank "
        "quantizes its own heads; default: float)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=64,
        help="group size of the quantized KV cache, along the head width (default 64)",
    )
    p.add_argument(
        "--quantized-kv-start",
        type=non_negative_int,
        default=0,
        help="with --kv-bits: a sequence's cache is quantized once it holds this many tokens "
        "(default 0: after its first prefill chunk, as mlx-lm does)",
    )


def add_kv_memory_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--kv-cache-bytes",
        type=non_negative_int,
        help="KV cache bytes a rank may fill (default: what its memory leaves after its "
        "weights); a request whose context (prompt + max_tokens) cannot fit gets a 400, one "
        "that fits only once running requests finish a 429",
    )


def check_kv(spec: ModelSpec, args: argparse.Namespace) -> None:
    """One readable line when this model cannot keep the KV cache asked for."""
    problem = kv_quantization_problem(spec, args.kv_bits, args.kv_group_size)
    if problem:
        raise ExoTpError(problem)
