"""Property tests of the pure planner: no MLX, checked against the plan's own promises."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_tp.arch import supported_model_types, table_for
from exo_tp.errors import PlanError, UnsupportedArchitectureError
from exo_tp.plan import ModelSpec, Quantization, plan_tensor_parallel, spec_from_config
from exo_tp.plan.apportion import largest_remainder
from exo_tp.plan.slices import RankSelector
from exo_tp.plan.spec import LatentAttention, LinearAttention, linear_head_widths
from exo_tp.plan.tensor_parallel import FLOAT_FFN_ALIGN, VOCAB_ALIGN

# MLA families: their tables split o_proj by heads of v_head_dim.
MLA_TYPES = tuple(
    t
    for t in supported_model_types()
    if any(rule.width == "v_head_dim" for rule in table_for(t).linears)
)
OTHER_TYPES = tuple(t for t in supported_model_types() if t not in MLA_TYPES)
# Families with recurrent linear-attention layers, split by heads of their own.
LINEAR_TYPES = tuple(
    t
    for t in supported_model_types()
    if any("linear_heads" in rule.parts for rule in table_for(t).linears)
)
GATED_DELTANET_TYPES = tuple(
    t for t in LINEAR_TYPES if any(rule.width == "gated_q" for rule in table_for(t).linears)
)


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    """Any supported architecture: GQA or MLA attention, dense or MoE FFNs (routed experts,
    shared experts), float or affine-quantized at 4/8 bits and group 32/64/128."""
    mla = draw(st.booleans())
    kv = draw(st.integers(1, 8))
    group = 1 if mla else draw(st.integers(1, 8))  # MLA: every head has its own K and V
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 80, 96, 128, 192]))
    quant = draw(st.sampled_from([None, *((g, b) for g in (32, 64, 128) for b in (4, 8))]))
    step = quant[0] if quant else 8
    # MLA: the attention output (o_proj's input) per head is v_head_dim wide.
    head_widths = (
        {
            "v_head_dim": draw(st.sampled_from([16, 32, 48, 64, 128])),
            "kv_b_head_dim": draw(st.sampled_from([48, 96, 256])),
        }
        if mla
        else {}
    )
    ffn_sizes = {"ffn": draw(st.integers(1, 200)) * step}
    for kind in ("expert_ffn", "shared_expert_ffn"):
        if draw(st.booleans()):
            ffn_sizes[kind] = draw(st.integers(1, 50)) * step
    model_type = draw(st.sampled_from(MLA_TYPES if mla else OTHER_TYPES))
    layers = draw(st.integers(1, 4))
    linear = None
    if model_type in LINEAR_TYPES:  # linear-attention layers beside the attention ones
        # Gated DeltaNet (its attention's q_proj also holds a gate): value heads under each key
        gated = model_type in GATED_DELTANET_TYPES
        linear = LinearAttention(
            layers=tuple(draw(st.sets(st.integers(0, layers - 1)))),
            num_heads=draw(st.integers(1, 12)),
            head_dim=draw(st.sampled_from([16, 64, 96, 128])),
            conv_kernel=4,
            value_heads=draw(st.integers(1, 4)) if gated else 0,
            value_head_dim=draw(st.sampled_from([32, 64, 128])) if gated else 0,
        )
        head_widths = {**head_widths, **linear_head_widths(linear)}
        if gated:
            head_widths["gated_q"] = 2 * head_dim
        # Nemotron-H's Mamba-2 groups: B and C of 16 channels each, 2 heads (one dt each)
        mamba = {"mamba_state": 16, "mamba_heads": 2, "mamba_conv": linear.head_dim + 32}
        head_widths = {**head_widths, **mamba}
    return ModelSpec(
        model_type=model_type,
        hidden_size=draw(st.sampled_from([64, 576, 1024])),
        num_layers=layers,
        linear_attention=linear,
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=head_dim,
        head_widths=head_widths,
        ffn_sizes=ffn_sizes,
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
    for kind, size in spec.ffn_sizes.items():  # dense, every expert alike, shared experts
        ffn = [range(r.ffn[kind].start, r.ffn[kind].stop) for r in plan.ranks]
        assert _owners(ffn, size) == [1] * size, kind
    vocab = [range(r.vocab.start, r.vocab.stop) for r in plan.ranks]
    assert _owners(vocab, spec.vocab_size) == [1] * spec.vocab_size
    if spec.linear_attention is not None:
        total = spec.linear_attention.num_heads
        linear = [range(r.linear_heads.start, r.linear_heads.stop) for r in plan.ranks]
        assert _owners(linear, total) == [1] * total


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
        # down_proj's input columns are FFN rows (o_proj's: test_no_split_cuts_a_group).
        for kind, size in spec.ffn_sizes.items():
            for cut in (r.ffn[kind].start, r.ffn[kind].stop):
                assert cut % align == 0 or cut == size
                if spec.quantization is None:
                    assert cut % FLOAT_FFN_ALIGN == 0 or cut == size
        assert r.vocab.start % VOCAB_ALIGN == 0 or r.vocab.start == spec.vocab_size


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_no_split_cuts_a_group(spec: ModelSpec, weights: list[float]) -> None:
    """Every input-dimension (row-parallel) slice the loader takes by the architecture's
    table lands on quantization groups: no split ever needs requantization."""
    plan = plan_tensor_parallel(spec, weights)
    align = spec.input_align
    for rule in (r for r in table_for(spec.model_type).linears if r.style == "row"):
        dims = ("q_heads", "kv_heads", *spec.ffn_sizes)
        if spec.linear_attention is not None:
            dims += ("linear_heads",)
        if any(p not in dims for p in rule.parts):
            continue  # an FFN kind this spec lacks: the module does not exist
        for rank in range(plan.size):
            ranges, total = RankSelector(plan, rank).rule(rule)
            for cut in (c for r in ranges for c in r):
                assert cut % align == 0 or cut == total, (spec.model_type, rule.path)


@settings(max_examples=300, deadline=None)
@given(spec=specs(), weights=weights_lists)
def test_shares_track_weights_within_one_unit(spec: ModelSpec, weights: list[float]) -> None:
    plan = plan_tensor_parallel(spec, weights)
    total = sum(weights)
    units = {
        "heads": (plan.head_unit, spec.num_heads, [r.heads.q_heads.size for r in plan.ranks]),
        **{
            kind: (plan.ffn_unit, size, [r.ffn[kind].size for r in plan.ranks])
            for kind, size in spec.ffn_sizes.items()
        },
        "vocab": (plan.vocab_unit, spec.vocab_size, [r.vocab.size for r in plan.ranks]),
    }
    if spec.linear_attention is not None:
        sizes = [r.linear_heads.size for r in plan.ranks]
        units["linear"] = (plan.linear_head_unit, spec.linear_attention.num_heads, sizes)
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
    spec = ModelSpec(
        model_type="llama",
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        ffn_sizes={"ffn": 1536},
        vocab_size=49152,
        tie_word_embeddings=True,
        quantization=Quantization(group_size=32, bits=4),
    )
    two = plan_tensor_parallel(spec, [1, 1])
    assert [r.heads.q_heads.size for r in two.ranks] == [6, 3]
    four = plan_tensor_parallel(spec, [1, 1, 1, 1])
    assert four.attention_unit == "q_head"
    assert sum(r.heads.q_heads.size for r in four.ranks) == 9
    five = plan_tensor_parallel(spec, [1] * 5)  # 1536 rows in 48 groups of 32 over 5 ranks
    assert [r.ffn["ffn"].size for r in five.ranks] == [320, 320, 320, 288, 288]


def test_group_128_with_head_dim_64_takes_two_head_units() -> None:
    spec = ModelSpec(
        model_type="llama",
        hidden_size=384,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3,
        head_dim=64,
        ffn_sizes={"ffn": 384},
        vocab_size=49152,
        tie_word_embeddings=True,
        quantization=Quantization(group_size=128, bits=4),
    )
    assert plan_tensor_parallel(spec, [1, 1, 1]).head_unit == 2  # one GQA group: 128 columns
    five = plan_tensor_parallel(spec, [1] * 5)  # more ranks than KV heads: q-head units
    assert five.attention_unit == "q_head" and five.head_unit == 2
    assert [r.heads.q_heads.size for r in five.ranks] == [2, 2, 2, 0, 0]


def test_mla_config_reads_per_head_widths() -> None:
    spec = spec_from_config(
        dict(
            model_type="deepseek_v3",
            hidden_size=128,
            num_hidden_layers=2,
            intermediate_size=200,
            num_attention_heads=6,
            num_key_value_heads=2,
            q_lora_rank=48,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=24,
            n_shared_experts=2,
            moe_intermediate_size=104,
            vocab_size=1000,
            quantization={
                "group_size": 32,
                "bits": 4,
                "model.layers.1.mlp.gate": {"group_size": 64, "bits": 8},
            },
        )
    )
    assert spec.num_kv_heads == 6  # MLA: no GQA, whatever num_key_value_heads says
    assert spec.head_dim == 48
    assert spec.head_widths == {"kv_b_head_dim": 56, "v_head_dim": 24}
    # what the cost model prices: latent projections and a latent KV cache (V3 absorbs kv_b)
    assert spec.latent_attention == LatentAttention(q_lora_rank=48, kv_lora_rank=64, rope_dim=16)
    assert spec.ffn_sizes == {"ffn": 200, "expert_ffn": 104, "shared_expert_ffn": 208}
    assert spec.input_align == 64  # the router's override counts too
    assert not spec.tie_word_embeddings  # deepseek never ties


def test_legacy_mxfp4_checkpoints_split_on_groups_of_32() -> None:
    spec = spec_from_config(
        dict(
            model_type="gpt_oss",
            hidden_size=2880,
            num_hidden_layers=2,
            intermediate_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=1000,
            quantization_config={"quant_method": "mxfp4"},
        )
    )
    assert spec.input_align == 32
    plan = plan_tensor_parallel(spec, [3, 2, 2])
    assert all(r.ffn["ffn"].start % 32 == 0 for r in plan.ranks)


def test_kimi_k25_int4_as_shipped_splits_on_groups_of_32() -> None:
    """Kimi K2.5 ships int4 experts as compressed-tensors ("pack-quantized"), its
    quantization_config under text_config: mlx-lm loads them as affine 4-bit in groups of 32."""
    text = dict(
        model_type="kimi_k2",
        hidden_size=7168,
        num_hidden_layers=2,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        vocab_size=163840,
        quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"},
    )
    spec = spec_from_config(dict(model_type="kimi_k25", text_config=text))
    assert spec.quantization == Quantization(group_size=32, bits=4)
    assert (spec.num_experts, spec.experts_per_token, spec.dense_layers) == (384, 8, 1)
    plan = plan_tensor_parallel(spec, [3, 2, 2])
    assert all(r.ffn["expert_ffn"].start % 32 == 0 for r in plan.ranks)


def test_step3p5_sliding_layers_hold_the_same_fraction_of_more_heads() -> None:
    """Step 3.5 Flash: 64 query heads in full-attention layers, 96 in sliding ones, 8 KV heads
    in both. Every rank's span in a sliding layer is its span scaled by 3/2: whole heads, its
    o_proj cut on a quantization group, the same KV heads."""
    layers = 45
    spec = spec_from_config(
        dict(
            model_type="step3p5",
            hidden_size=4096,
            num_hidden_layers=layers,
            num_attention_heads=64,
            num_attention_groups=8,
            head_dim=128,
            attention_other_setting={"num_attention_heads": 96, "num_attention_groups": 8},
            layer_types=["full_attention", "sliding_attention", "sliding_attention"] * 15,
            use_head_wise_attn_gate=True,
            intermediate_size=11264,
            moe_num_experts=288,
            moe_top_k=8,
            moe_intermediate_size=1280,
            share_expert_dim=1280,
            moe_layers_enum=",".join(str(i) for i in range(3, layers)),
            vocab_size=128896,
            quantization={"group_size": 64, "bits": 4},
        )
    )
    assert (spec.num_heads, spec.num_kv_heads, spec.head_widths) == (64, 8, {"head_gate": 1})
    (other,) = spec.variants
    assert other.num_heads == 96 and other.layers == tuple(i for i in range(layers) if i % 3)
    assert (spec.num_experts, spec.experts_per_token, spec.dense_layers) == (288, 8, 3)
    assert spec.ffn_sizes == {"ffn": 11264, "expert_ffn": 1280, "shared_expert_ffn": 1280}
    for weights in ([3, 2, 2], [1] * 11, [5, 0, 1, 1]):
        plan = plan_tensor_parallel(spec, weights)
        for layer, heads in ((0, 64), (1, 96)):
            shards = [RankSelector(plan, r).layer(layer).shard.heads for r in range(plan.size)]
            spans = [h.q_heads for h in shards]
            assert spans[0].start == 0 and spans[-1].stop == heads
            assert all(a.stop == b.start for a, b in zip(spans, spans[1:], strict=False))
            assert all(s.start * 128 % 64 == 0 for s in spans)
            full = [RankSelector(plan, r).shard.heads.kv_heads for r in range(plan.size)]
            assert [h.kv_heads for h in shards] == full


def test_unsupported_architecture_names_itself_and_the_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        spec_from_config({"model_type": "no_such_lm", "hidden_size": 64, "num_hidden_layers": 2})
    message = str(info.value)
    assert "'no_such_lm'" in message and "\n" not in message
    assert all(t in message for t in supported_model_types())
    assert len(supported_model_types()) >= 10


def test_largest_remainder_is_exact_for_integral_quotas() -> None:
    assert largest_remainder(10, [5, 3, 2]) == (5, 3, 2)
    assert largest_remainder(3, [5, 3, 2]) == (1, 1, 1)
    assert largest_remainder(1, [1, 3]) == (0, 1)


@pytest.mark.parametrize("weights", [[], [0, 0], [1, -1], [1, float("nan")]])
def test_bad_weights_say_why(weights: list[float]) -> None:
    spec = ModelSpec(
        model_type="llama",
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_sizes={"ffn": 64},
        vocab_size=100,
        tie_word_embeddings=True,
    )
    with pytest.raises(PlanError) as info:
        plan_tensor_parallel(spec, weights)
    assert "\n" not in str(info.value)


def test_planner_imports_no_mlx() -> None:
    code = (
        "import sys, exo_tp.plan, exo_tp.arch, exo_tp.plan.render; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_stage_message_goes_from_its_first_rank_holding_heads() -> None:
    """DeepSeek V4.1's stage output carries state its attention makes (compressed KV,
    selections), which a rank without heads skips: the first rank holding heads sends it;
    other families' stages send from their first rank."""
    from arch_configs import tiny_config

    from exo_tp.plan.pipeline import hop_sender

    for arch, sender in (("deepseek_v41", 1), ("deepseek_v32", 0)):
        spec = spec_from_config(tiny_config(arch))
        assert hop_sender(plan_tensor_parallel(spec, [0.0, 1.0, 1.0])) == sender, arch
