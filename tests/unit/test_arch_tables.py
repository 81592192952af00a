"""The architecture tables: well-formed, naming real mlx-lm models, and refusing what they miss."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from arch_configs import ARCHS, tiny_config
from pydantic import ValidationError
from tiny_models import write_tiny_model

from exo_tp.arch import (
    ArchTable,
    BranchRule,
    LinearRule,
    NormRule,
    supported_model_types,
    table_for,
)
from exo_tp.arch.families.qwen3_moe import QWEN3_MOE
from exo_tp.errors import ExoTpError


def test_every_supported_type_is_an_mlx_lm_model_with_a_tiny_test_config() -> None:
    from mlx_lm.utils import MODEL_REMAPPING

    for model_type in supported_model_types():
        importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
        assert model_type in ARCHS, f"{model_type} has no tiny config in tests/arch_configs.py"


def test_a_misspelt_or_misplaced_split_dimension_fails_when_built() -> None:
    from exo_tp.arch import CountRule, Dim
    from exo_tp.plan.spec import ModelSpec, spec_from_config

    with pytest.raises(ValidationError, match="fnn"):
        LinearRule(path="mlp.down_proj", style="row", parts=("fnn",))
    with pytest.raises(ValidationError, match="no counted dimension"):
        CountRule(path="self_attn.n_heads", dim=Dim.FFN)
    spec = spec_from_config(tiny_config("qwen3_moe"))
    with pytest.raises(ValidationError, match="no feed-forward kind"):
        ModelSpec.model_validate({**spec.model_dump(), "ffn_sizes": {"q_heads": 64}})
    # the members are their old strings: plans and manifests keep their bytes
    assert Dim.EXPERT_FFN == "expert_ffn" and f"{Dim.KV_HEADS}" == "kv_heads"
    assert '"ffn_sizes":{"ffn":200,"expert_ffn":104}' in spec.model_dump_json()


def test_a_split_outside_every_reducing_branch_is_refused() -> None:
    with pytest.raises(ValidationError, match="inside no reducing branch"):
        ArchTable(
            model_types=("x",),
            linears=(LinearRule(path="mlp.down_proj", style="row", parts=("ffn",)),),
            branches=(BranchRule(path="self_attn", kind="attention"),),
            counts=(),
        )
    with pytest.raises(ValidationError, match="reduce twice"):
        ArchTable(
            model_types=("x",),
            linears=(),
            counts=(),
            branches=(
                BranchRule(path="mlp", kind="mlp"),
                BranchRule(path="mlp.experts", kind="experts"),
            ),
        )


@pytest.mark.parametrize(
    ("table", "missing"),
    [
        # the router left out of the table: it would be taken for an unsplit weight
        (
            QWEN3_MOE.model_copy(update={"replicated": ("self_attn.q_norm", "self_attn.k_norm")}),
            "mlp.gate",
        ),
        # the experts' down projection left out: its partial sums would be wrong
        (
            QWEN3_MOE.model_copy(
                update={
                    "linears": tuple(
                        r for r in QWEN3_MOE.linears if r.path != "mlp.switch_mlp.down_proj"
                    )
                }
            ),
            "mlp.switch_mlp.down_proj",
        ),
    ],
)
def test_a_module_the_table_misses_is_an_error_not_a_wrong_split(
    tmp_path: Path, default_models: dict[str, Path], table: ArchTable, missing: str
) -> None:
    from exo_tp.plan import load_spec, plan_tensor_parallel
    from exo_tp.plan.slices import RankSelector
    from exo_tp.shard.blocks import BlockSharder
    from exo_tp.shard.slicing import load_lazily

    folder = write_tiny_model(
        tmp_path / "m", tiny_config("qwen3_moe"), default_models["smollm2-135m"]
    )
    plan = plan_tensor_parallel(load_spec(folder), [1])
    model, _, slicer = load_lazily(folder)
    sharder = BlockSharder(
        table,
        slicer,
        [RankSelector(plan, 0)],
        0,
        plan.spec.hidden_size,
        mx.distributed.init(),
    )
    with pytest.raises(ExoTpError, match=missing.replace(".", r"\.")) as info:
        sharder.shard(model.model.layers[1], "model.layers.1")  # the MoE layer
    assert "table" in str(info.value)
    assert table_for("qwen3_moe") is QWEN3_MOE  # the real table is untouched


@pytest.mark.parametrize(
    "arch",
    [
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe",
        "glm4_moe_lite",
        "mistral4",
        "kimi_k25",
        "deepseek_v32",
        "step3p5",
        "deepseek_v41",
        "kimi_k3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
    ],
)
def test_the_planner_prices_what_mlx_lm_holds(arch: str) -> None:
    """One rank's held bytes as the cost model counts them are the model's parameter bytes
    (norms aside: within 0.1%), MLA's latent projections, per-head stacks and DSA's indexer
    included, Step 3.5's layers of another head count and DeepSeek V4.1's grouped output,
    compressors, indexers and hyper-connection mixers; MLA's latent KV cache (and the
    indexer's key cache) is the same on every rank that holds heads, whatever its share."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from exo_tp.plan import Span, plan_tensor_parallel, spec_from_config
    from exo_tp.plan.cost import rank_load

    config = tiny_config(arch)
    spec = spec_from_config(config)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    held = sum(v.size for _, v in tree_flatten(model.parameters())) * 4  # float32
    layers = Span(start=0, stop=spec.num_layers)
    whole = rank_load(spec, plan_tensor_parallel(spec, [1]).ranks[0], layers, True, True)
    assert abs(whole.held_bytes / held - 1) < 1e-3
    mla = spec.latent_attention
    if mla is None or not mla.latent_cache:
        return
    # Kimi K3's linear-attention layers keep no KV cache (their state: the test below)
    attention = spec.num_layers - len(spec.linear_attention.layers if spec.linear_attention else ())
    per_token = attention * (mla.kv_lora_rank + mla.rope_dim + 2 * mla.index_head_dim) * 4
    for shard in plan_tensor_parallel(spec, [0.6, 0.3, 0.1]).ranks:
        load = rank_load(spec, shard, layers, True, True)
        assert load.kv_bytes_per_token == (per_token if shard.heads.q_heads.size else 0)


def _whole_model(arch: str) -> tuple[Any, Any, Any, Any]:
    """The tiny ``arch`` as mlx-lm builds it, its spec, all its layers and one rank's load of
    them as the cost model prices it."""
    from mlx_lm.utils import _get_classes

    from exo_tp.plan import Span, plan_tensor_parallel, spec_from_config
    from exo_tp.plan.cost import rank_load

    config = tiny_config(arch)
    spec = spec_from_config(config)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    layers = Span(start=0, stop=spec.num_layers)
    whole = rank_load(spec, plan_tensor_parallel(spec, [1]).ranks[0], layers, True, True)
    return spec, model, layers, whole


def _assert_state_and_kv_as_mlx_lm_holds(model: Any, whole: Any) -> None:
    """After a short and a longer prompt, mlx-lm's recurrent caches hold the priced state
    bytes (whatever the length) and its KV caches the priced bytes per token."""
    from mlx_lm.models.cache import ArraysCache

    for length in (3, 11):
        cache = model.make_cache()
        mx.eval(model(mx.zeros((1, length), dtype=mx.int32), cache=cache))
        state = sum(c.nbytes for c in cache if isinstance(c, ArraysCache))
        # (a KVCache allocates in steps: its first offset entries are what it holds)
        kv = sum(
            a[..., : c.offset, :].nbytes
            for c in cache
            if not isinstance(c, ArraysCache)
            for a in (c.keys, c.values)
        )
        assert whole.state_bytes == state
        assert whole.kv_bytes_per_token * length == kv


def _assert_state_split_with_one_rank_holding_none(spec: Any, layers: Any, whole: Any) -> None:
    from exo_tp.plan import plan_tensor_parallel
    from exo_tp.plan.cost import rank_load

    shards = plan_tensor_parallel(spec, [0.5, 0.3, 0.2, 0.1]).ranks
    assert [s.linear_heads.size for s in shards] == [1, 1, 1, 0]
    loads = [rank_load(spec, s, layers, True, True) for s in shards]
    assert sum(x.state_bytes for x in loads) == whole.state_bytes
    assert loads[-1].state_bytes == 0


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_5"])
def test_recurrent_state_is_priced_as_mlx_lm_holds_it(arch: str) -> None:
    """Kimi K3's and Qwen 3.5's linear-attention layers (KDA, Gated DeltaNet: a key head's
    value heads each keep a value x key state) keep a recurrent state per stream that does not
    grow with the context: the cost model's state bytes are what mlx-lm's caches hold after a
    short and a longer prompt, split by heads over uneven ranks (one holding none), and its KV
    bytes per token only the attention layers' cache."""
    spec, model, layers, whole = _whole_model(arch)
    _assert_state_and_kv_as_mlx_lm_holds(model, whole)
    assert spec.linear_attention is not None
    _assert_state_split_with_one_rank_holding_none(spec, layers, whole)


def test_a_sigmoid_router_keeps_its_float32_correction_bias_in_a_16_bit_shard(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """mlx-lm's cast_predicate holds: a bfloat16 shard of glm4_moe casts every floating weight
    but the router's e_score_correction_bias, so routing does not depend on the compute dtype."""
    from mlx.utils import tree_flatten

    from exo_tp.plan import load_spec, plan_tensor_parallel
    from exo_tp.shard.apply import load_shard

    folder = write_tiny_model(
        tmp_path / "m", tiny_config("glm4_moe"), default_models["smollm2-135m"]
    )
    plan = plan_tensor_parallel(load_spec(folder), [1])
    model = load_shard(folder, plan, 0, mx.distributed.init(), dtype=mx.bfloat16)
    dtypes = {name: value.dtype for name, value in tree_flatten(model.parameters())}
    biases = [name for name in dtypes if "e_score_correction_bias" in name]
    assert biases and all(dtypes[name] == mx.float32 for name in biases)
    assert all(dtype == mx.bfloat16 for name, dtype in dtypes.items() if name not in biases)


def test_a_full_width_norm_outside_an_attention_branch_is_refused() -> None:
    """A sharded norm's all-reduce is joined by attention stand-ins only."""
    with pytest.raises(ValidationError, match="inside no attention branch"):
        ArchTable(
            model_types=("x",),
            linears=(LinearRule(path="mlp.down_proj", style="row", parts=("ffn",)),),
            branches=(BranchRule(path="mlp", kind="mlp"),),
            norms=(NormRule(path="mlp.norm", dim="q_heads"),),
            counts=(),
        )


def test_a_whole_sum_of_a_module_that_is_not_replicated_is_refused() -> None:
    """A module acting on an all-reduced sum (and the one kept once after it) must be whole on
    every rank: a split one would be summed over ranks again."""
    from exo_tp.arch import SumRule

    with pytest.raises(ValidationError, match="must be replicated"):
        ArchTable(
            model_types=("x",),
            linears=(LinearRule(path="mlp.down_proj", style="row", parts=("ffn",)),),
            branches=(BranchRule(path="mlp", kind="mlp"),),
            replicated=("mlp.norm",),
            sums=(SumRule(path="mlp.norm", width="moe_latent", once="mlp.up"),),
            counts=(),
        )


def test_a_replicated_kv_head_is_counted_once_in_a_full_width_norm() -> None:
    from exo_tp.shard.sharded_norm import counted_mask

    # KV head 1 is held twice here (after head 0) and head 0 already by an earlier rank
    mask = counted_mask((0, 1, 1), earlier={0}, width=2)
    assert mask is not None and mask.tolist() == [0, 0, 1, 1, 0, 0]
    assert counted_mask((2, 3), earlier={0, 1}, width=4) is None  # all first holders


def test_gemma4_layers_keep_their_own_head_widths_kv_heads_and_ffn() -> None:
    """Global layers' wider heads and fewer KV heads, KV-shared layers' double-wide MLP: each
    layer's view of one plan, on the same query heads."""
    from exo_tp.plan import plan_tensor_parallel, spec_from_config
    from exo_tp.plan.tensor_parallel import layer_plan

    text = tiny_config("gemma4_text")
    spec = spec_from_config(text)
    assert spec.layer(0) is spec and spec.layer(1).head_dim == 128
    assert spec.layer(2).ffn_sizes["ffn"] == 2 * text["intermediate_size"]
    assert not spec.layer(3).has_kv and spec.layer(3).head_dim == 128
    moe = spec_from_config(tiny_config("gemma4"))  # K = V global layer: 1 KV head (sliding: 3)
    assert moe.layer(1).num_kv_heads == 1 and moe.num_kv_heads == 3
    assert moe.dense_mlp_with_experts and moe.experts_per_token == 2
    plan = plan_tensor_parallel(moe, [2, 1, 1])
    global_layer = layer_plan(plan, 1)
    for mine, there in zip(plan.ranks, global_layer.ranks, strict=True):
        assert mine.heads.q_heads == there.heads.q_heads
        assert set(there.heads.kv_heads) == {0}  # every rank's heads attend with KV head 0


def test_nemotron_h_is_priced_as_mlx_lm_holds_it() -> None:
    """Nemotron-H, one mixer per layer by its pattern: the cost model's held bytes are the
    model's parameters (its one norm per layer aside), its Mamba-2 layers' per-stream state is
    what mlx-lm's caches hold after a short and a longer prompt (split by groups over uneven
    ranks, one holding none), and only its attention layer keeps KV per token."""
    from mlx.utils import tree_flatten

    spec, model, layers, whole = _whole_model("nemotron_h")
    held = sum(v.size for _, v in tree_flatten(model.parameters())) * 4
    extra_norms = spec.num_layers * spec.hidden_size * 4  # priced as two norms per layer
    assert abs((whole.held_bytes - extra_norms) / held - 1) < 1e-3
    _assert_state_and_kv_as_mlx_lm_holds(model, whole)
    _assert_state_split_with_one_rank_holding_none(spec, layers, whole)


def test_lfm2_short_conv_state_is_priced_as_mlx_lm_holds_it() -> None:
    """LFM2's short-conv layers keep their last kernel - 1 inputs per stream, split by
    channels; the cost model's held bytes are the model's parameters."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache

    from exo_tp.plan import plan_tensor_parallel
    from exo_tp.plan.cost import rank_load

    spec, model, layers, whole = _whole_model("lfm2")
    held = sum(v.size for _, v in tree_flatten(model.parameters())) * 4
    assert abs(whole.held_bytes / held - 1) < 1e-2  # conv biases and q/k norms aside
    cache = model.make_cache()
    mx.eval(model(mx.zeros((1, 7), dtype=mx.int32), cache=cache))
    assert whole.state_bytes == sum(c.nbytes for c in cache if isinstance(c, ArraysCache))
    loads = [
        rank_load(spec, s, layers, True, True)
        for s in plan_tensor_parallel(spec, [0.5, 0.3, 0.2]).ranks
    ]
    assert sum(x.state_bytes for x in loads) == whole.state_bytes
