"""Property tests of the pure planner: no MLX, checked against the plan's own promises."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_tp.errors import PlanError
from exo_tp.plan import ModelSpec, Quantization, plan_tensor_parallel
from exo_tp.plan.apportion import largest_remainder
from exo_tp.plan.tensor_parallel import FLOAT_FFN_ALIGN, VOCAB_ALIGN


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    kv = draw(st.integers(1, 8))
    group = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([16, 32, 64, 80, 96, 128]))
    quant = draw(st.sampled_from([None, (32, 4), (64, 4), (128, 4), (64, 8)]))
    ffn = draw(st.integers(1, 200)) * (quant[0] if quant else 8)
    return ModelSpec(
        model_type="llama",
        hidden_size=draw(st.sampled_from([64, 576, 1024])),
        num_layers=draw(st.integers(1, 4)),
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_sizes={"ffn": ffn},
        vocab_size=draw(st.integers(1, 70000)),
        tie_word_embeddings=draw(st.booleans()),
        quantization=Quantization(group_size=quant[0], bits=quant[1]) if quant else None,
    )


weights_lists = st.lists(
    st.one_of(st.floats(0.01, 100.0), st.just(0.0)), min_size=1, max_size=12
).filter(lambda w: sum(w) > 0)


def _owners(spans: list[range], total: int) -> list[int]:
    owned = [0] * total
    for span in spans:
        for i in span:
            owned[i] += 1
    return owned


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_every_row_owned_exactly_once(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    assert plan.size == len(weights)
    q = [range(r.heads.q_heads.start, r.heads.q_heads.stop) for r in plan.ranks]
    assert _owners(q, spec.num_heads) == [1] * spec.num_heads
    ffn = [range(r.ffn["ffn"].start, r.ffn["ffn"].stop) for r in plan.ranks]
    assert _owners(ffn, spec.ffn_sizes["ffn"]) == [1] * spec.ffn_sizes["ffn"]
    vocab = [range(r.vocab.start, r.vocab.stop) for r in plan.ranks]
    assert _owners(vocab, spec.vocab_size) == [1] * spec.vocab_size


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_heads_keep_their_kv_head(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    g = spec.group_size
    for r in plan.ranks:
        heads = r.heads
        if heads.q_heads.size == 0:
            assert heads.kv_heads == ()
            continue
        # Local GQA: local q head i uses local KV slot i // repeats; it must be its own KV head.
        assert heads.q_heads.size % len(heads.kv_heads) == 0
        for i, q in enumerate(range(heads.q_heads.start, heads.q_heads.stop)):
            assert heads.kv_heads[i // heads.repeats] == q // g
    if len(weights) <= spec.num_kv_heads:
        # Whole GQA groups: no KV head is held twice anywhere.
        held = [kv for r in plan.ranks for kv in r.heads.kv_heads]
        assert sorted(held) == sorted(set(held))


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_input_splits_land_on_quantization_groups(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    align = spec.quantization.group_size if spec.quantization else 1
    for r in plan.ranks:
        # o_proj's input columns are q heads x head_dim; down_proj's are FFN rows.
        for cut in (r.heads.q_heads.start * spec.head_dim, r.heads.q_heads.stop * spec.head_dim):
            assert cut % align == 0 or cut == spec.num_heads * spec.head_dim
        for cut in (r.ffn["ffn"].start, r.ffn["ffn"].stop):
            assert cut % align == 0 or cut == spec.ffn_sizes["ffn"]
            if spec.quantization is None:
                assert cut % FLOAT_FFN_ALIGN == 0 or cut == spec.ffn_sizes["ffn"]
        assert r.vocab.start % VOCAB_ALIGN == 0 or r.vocab.start == spec.vocab_size


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_shares_track_weights_within_one_unit(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    total = sum(weights)
    units = {
        "heads": (plan.head_unit, spec.num_heads, [r.heads.q_heads.size for r in plan.ranks]),
        "ffn": (plan.ffn_unit, spec.ffn_sizes["ffn"], [r.ffn["ffn"].size for r in plan.ranks]),
        "vocab": (plan.vocab_unit, spec.vocab_size, [r.vocab.size for r in plan.ranks]),
    }
    for name, (unit, size, got) in units.items():
        n_units = math.ceil(size / unit)
        for r, w in enumerate(weights):
            ideal = n_units * w / total
            held = math.ceil(got[r] / unit)
            assert abs(held - ideal) < 1 + 1e-9, (name, r, held, ideal)


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_padded_collectives_have_equal_shapes(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    logits = plan.collective("logits")
    assert logits.sizes == tuple(r.vocab.size for r in plan.ranks)
    assert logits.padded == max(logits.sizes)
    # After padding every rank sends exactly `padded` columns.
    assert all(size + (logits.padded - size) == logits.padded for size in logits.sizes)
    for name in ("attention_out", "ffn_out", "embedding"):
        c = plan.collective(name)
        assert set(c.sizes) == {spec.hidden_size} and c.padded == spec.hidden_size


@settings(max_examples=100, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_plan_round_trips_through_json(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    assert type(plan).model_validate_json(plan.model_dump_json()) == plan


def test_smollm2_cases_others_refuse() -> None:
    spec = ModelSpec(model_type="llama", hidden_size=576, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, ffn_sizes={"ffn": 1536}, vocab_size=49152,
                     tie_word_embeddings=True,
                     quantization=Quantization(group_size=32, bits=4))
    two = plan_tensor_parallel(spec, [1, 1])
    assert [r.heads.q_heads.size for r in two.ranks] == [6, 3]
    four = plan_tensor_parallel(spec, [1, 1, 1, 1])
    assert four.attention_unit == "q_head"
    assert sum(r.heads.q_heads.size for r in four.ranks) == 9
    five = plan_tensor_parallel(spec, [1] * 5)  # 1536 rows in 48 groups of 32 over 5 ranks
    assert [r.ffn["ffn"].size for r in five.ranks] == [320, 320, 320, 288, 288]


def test_largest_remainder_is_exact_for_integral_quotas() -> None:
    assert largest_remainder(10, [5, 3, 2]) == (5, 3, 2)
    assert largest_remainder(3, [5, 3, 2]) == (1, 1, 1)
    assert largest_remainder(1, [1, 3]) == (0, 1)


@pytest.mark.parametrize("weights", [[], [0, 0], [1, -1], [1, float("nan")]])
def test_bad_weights_say_why(weights: list[float]) -> None:
    spec = ModelSpec(model_type="llama", hidden_size=64, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, ffn_sizes={"ffn": 64}, vocab_size=100,
                     tie_word_embeddings=True)
    with pytest.raises(PlanError) as info:
        plan_tensor_parallel(spec, weights)
    assert "\n" not in str(info.value)


def test_planner_imports_no_mlx() -> None:
    code = ("import sys, exo_tp.plan, exo_tp.arch, exo_tp.plan.render; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
