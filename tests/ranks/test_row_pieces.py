"""One-row float32 products in row pieces (exo_tp.shard.row_pieces): the same numbers as the
whole product within fp32 noise, only where they apply, and on in the ranks `exo-tp launch`
starts on OpenBLAS, whose greedy tokens still equal single-device mlx-lm's."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import Reference, launch, mlx_lm_reference

from exo_tp.process.blas import blas_library
from exo_tp.shard.row_pieces import (
    PIECE_BYTES,
    PiecedEmbedding,
    PiecedLinear,
    multiply_in_pieces,
    piece_rows,
)

PROMPT = "Name three colours."


def _float64(x: mx.array, w: mx.array, b: mx.array | None = None) -> np.ndarray:
    """The product in float64 by numpy: an independent reference for both MLX paths."""
    out = np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T
    return out if b is None else out + np.asarray(b, dtype=np.float64)


def _fp32_close(ours: mx.array, ref: np.ndarray) -> None:
    # One fp32 dot product over K = 576 rounds by ~1e-6 of its size; pieces sum each element
    # with another kernel, never across pieces.
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def _pieced(linear: nn.Linear) -> nn.Linear:
    assert multiply_in_pieces(linear) == 1
    assert type(linear) is PiecedLinear
    return linear


def test_pieces_are_small_and_cover_every_row() -> None:
    rows = piece_rows(mx.zeros((49152, 576)))
    assert rows is not None and rows * 576 * 4 <= PIECE_BYTES
    most = PIECE_BYTES // (576 * 4)
    assert -(-49152 // rows) == -(-49152 // most)  # as few pieces as fit
    assert piece_rows(mx.zeros((576, 576))) is None  # 1.3 MB: whole
    assert piece_rows(mx.zeros((1536, 576), dtype=mx.float16)) is None  # not BLAS's


def test_a_one_row_product_in_pieces_matches_float64() -> None:
    linear = nn.Linear(576, 1537, bias=True)  # an odd row count: a short last piece
    x = mx.random.normal((1, 1, 576))
    whole = linear(x)
    pieced = _pieced(linear)(x)
    assert pieced.shape == whole.shape == (1, 1, 1537)
    reference = _float64(x, linear.weight, linear.bias)
    _fp32_close(pieced, reference)
    _fp32_close(whole, reference)


def test_more_rows_keep_the_whole_product() -> None:
    linear = nn.Linear(576, 1536, bias=False)
    x = mx.random.normal((2, 3, 576))
    whole = linear(x)
    assert mx.array_equal(_pieced(linear)(x), whole).item()  # not pieced: the same kernel


def test_a_tied_head_goes_in_pieces_and_lookups_do_not_change() -> None:
    embedding = nn.Embedding(8192, 576)
    ids = mx.array([[3, 8191, 0]])
    rows, logits_of = embedding(ids), mx.random.normal((1, 1, 576))
    assert multiply_in_pieces(embedding) == 1 and type(embedding) is PiecedEmbedding
    assert mx.array_equal(embedding(ids), rows).item()
    _fp32_close(embedding.as_linear(logits_of), _float64(logits_of, embedding.weight))


def test_only_big_float_linears_change_class() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(576, 1536, bias=False)
            self.small = nn.Linear(64, 64)
            self.quantized = nn.QuantizedLinear(576, 1536, bias=False)

    block = Block()
    before = sorted(k for k, _ in nn.utils.tree_flatten(block.parameters()))
    assert multiply_in_pieces(block) == 1
    assert type(block.up) is PiecedLinear and type(block.small) is nn.Linear
    assert type(block.quantized) is nn.QuantizedLinear
    # Same parameters at the same paths: loading, adapters and the lab's copies see no change.
    assert sorted(k for k, _ in nn.utils.tree_flatten(block.parameters())) == before


@pytest.mark.skipif(blas_library(None) is None, reason="row pieces apply on OpenBLAS only")
def test_launch_multiplies_in_pieces_and_decodes_as_mlx_lm(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """One rank holds SmolLM2 whole: its FFN gate, up and down and its tied head go in pieces
    (90 + 1 weights); 16 greedy tokens equal single-device mlx-lm's (bundled BLAS, whole
    products)."""
    reference: Reference = mlx_lm_reference(default_models["smollm2-135m"], PROMPT, 16)
    ours = launch(tmp_path, "smollm2-135m", [1], PROMPT, 16, logits=False)
    assert "91 weights multiplied in row pieces" in ours.stderr, ours.stderr[-2000:]
    assert list(ours.report.tokens) == reference.tokens
    off = launch(
        tmp_path, "smollm2-135m", [1], PROMPT, 4, logits=False, env={"EXO_TP_ROW_PIECES": "0"}
    )
    assert "(0 weights multiplied in row pieces" in off.stderr
