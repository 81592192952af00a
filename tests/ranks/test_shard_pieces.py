"""Single-process checks of the slicing pieces (against numpy and MLX's own dequantize)."""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from exo_tp.shard.safetensors_slices import SafetensorsIndex


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.uint32])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_slice_reads_equal_in_memory_slices(tmp_path: Path, dtype: mx.Dtype, axis: int) -> None:
    full = (mx.random.normal((37, 29)) * 100).astype(dtype)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": full})
    index = SafetensorsIndex(tmp_path)
    ranges = [(3, 9), (0, 2), (3, 9), (20, 21)]  # repeats allowed (replicated KV heads)
    got = index.read("w", axis, ranges)
    want = mx.concatenate([mx.take(full, mx.arange(a, b), axis=axis) for a, b in ranges], axis)
    assert got.dtype == dtype
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(index.read("w"), full).item()
    assert index.read("w", axis, []).shape[axis % 2] == 0


@pytest.mark.parametrize(("group_size", "bits"), [(32, 4), (64, 4), (64, 8), (128, 4), (32, 3)])
def test_quantized_input_split_at_group_boundaries_is_bit_exact(group_size: int, bits: int) -> None:
    """Cutting packed weights at c*bits/32 and scales at c/g gives exactly the dense slice."""
    w = mx.random.normal((48, 8 * group_size))
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    dense = mx.dequantize(q, scales, biases, group_size=group_size, bits=bits)
    cuts = [0, 3 * group_size, 4 * group_size, 8 * group_size]
    for a, b in itertools.pairwise(cuts):
        part = mx.dequantize(
            q[:, a * bits // 32 : b * bits // 32],
            scales[:, a // group_size : b // group_size],
            biases[:, a // group_size : b // group_size],
            group_size=group_size,
            bits=bits,
        )
        assert mx.array_equal(part, dense[:, a:b]).item()


def test_single_rank_shard_is_the_whole_model(default_models: dict[str, Path]) -> None:
    from mlx_lm import load

    from exo_tp.plan import load_spec, plan_tensor_parallel
    from exo_tp.shard.apply import load_shard

    folder = default_models["smollm2-135m-q4"]
    reference, tokenizer = load(str(folder))
    reference.set_dtype(mx.float32)
    ours = load_shard(
        folder, plan_tensor_parallel(load_spec(folder), [1]), 0, mx.distributed.init(), mx.float32
    )
    ids = mx.array(tokenizer.encode("The capital of France is"))[None]
    assert np.array_equal(np.array(ours(ids)), np.array(reference(ids)))
