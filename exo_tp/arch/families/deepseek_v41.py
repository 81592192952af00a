"""DeepSeek V4.1: compressed attention with a grouped low-rank output, hyper-connections."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, MLP, col, glu, stacked
from exo_tp.arch.family import Config, Family, SpecFields
from exo_tp.arch.model_spec import CompressedAttention, LayerVariant
from exo_tp.arch.table import ArchTable, BranchRule, CountRule, GroupedOutputRule

# DeepSeek V4.1: queries through a replicated q_a latent and per-head q_b rows (split with their
# heads, as are the per-head attention sinks), one key/value latent shared by every head (MQA:
# kv_proj, its norm and its window cache replicated, like MLA's latent), the KV compressor and
# the DSA-style indexer replicated for the reasons DEEPSEEK_DSA gives (every rank needs the
# single-device top-k selection, and later layers read the compressed KV, index keys and
# selections a source layer leaves in the forward pass's shared state); the grouped low-rank
# output (o_a per group of heads, o_b over the groups) split by heads (GroupedOutputRule). The
# MoE block: a replicated sqrt-softplus router, routed experts under experts.switch_mlp and one
# shared expert, split by rows, one all-reduce. The hyper-connection mixers (attn_hc, ffn_hc)
# and the layer norms act on the full residual streams outside the branches: replicated.
# Its caches cannot be batched by mlx-lm: batches run one sequence at a time. Pipeline stages
# hand on its streams and shared state in one message per step (exo_tp.shard.streams).
DEEPSEEK_V41 = ArchTable(
    model_types=("deepseek_v41",),
    linears=(
        col("self_attn.q_b_proj", Dim.Q_HEADS),
        stacked("self_attn.sinks"),
        *glu("mlp.experts.switch_mlp", Dim.EXPERT_FFN),
        *glu("mlp.shared_experts", Dim.SHARED_EXPERT_FFN),
    ),
    branches=(
        ATTENTION,
        MLP,
        BranchRule(path="mlp.experts.switch_mlp", kind="experts", reduce=False),
        BranchRule(path="mlp.shared_experts", kind="mlp", reduce=False),
    ),
    replicated=(
        "self_attn.q_a_proj",
        "self_attn.q_a_norm",
        "self_attn.kv_proj",
        "self_attn.kv_norm",
        "self_attn.compressor",
        "self_attn.indexer",
        "mlp.gate",
    ),
    grouped_outputs=(
        GroupedOutputRule(
            inner="self_attn.o_a_proj",
            outer="self_attn.o_b_proj",
            groups="self_attn.o_groups",
            ids="self_attn._group_ids",
        ),
    ),
    counts=(CountRule(path="self_attn.num_heads", dim=Dim.Q_HEADS),),
    tie_default=False,
    batch_by_sequence=True,
    stages=True,
    stage_state=True,
)


def _layer_variants(c: Config) -> tuple[LayerVariant, ...]:
    """The layers holding a compressor (kv_source, with a gate where it pools several tokens)
    or an indexer (index_source, with key projections where it is a kv_source too), grouped
    by what they hold and the tokens per compressed entry they cache."""
    ratios = [int(r) for r in c.get("compress_ratios") or ()]
    kv, index = set(c.get("kv_source_layer_ids") or ()), set(c.get("index_source_layer_ids") or ())
    kinds: dict[tuple[tuple[str, ...], int], list[int]] = {}
    for i in range(int(c["num_hidden_layers"])):
        ratio = ratios[i] if i < len(ratios) else 0
        parts = [
            *(["compressor"] if i in kv else []),
            *(["compressor_gate"] if i in kv and ratio > 1 else []),
            *(["indexer"] if i in index else []),
            *(["index_keys"] if i in index and i in kv else []),
        ]
        cached = ratio if ratio and i in kv else 0  # the layers that add compressed entries
        if parts or cached:
            kinds.setdefault((tuple(parts), cached), []).append(i)
    return tuple(
        LayerVariant(layers=tuple(layers), parts=parts, compress_ratio=ratio)
        for (parts, ratio), layers in kinds.items()
    )


def fields(c: Config) -> SpecFields:
    """Its attention's sizes, its layer variants, its hyper-connection streams, and its one
    shared expert (mlx-lm builds exactly one, of moe_intermediate_size, whatever config.json
    says)."""
    variants = _layer_variants(c)
    attention = CompressedAttention(
        q_lora_rank=int(c.get("q_lora_rank", 1280)),
        o_groups=int(c.get("o_groups", 8)),
        o_lora_rank=int(c.get("o_lora_rank", 1024)),
        index_heads=int(c.get("index_n_heads", 32)),
        index_head_dim=int(c.get("index_head_dim", 128)),
    )
    return {
        "variants": variants,
        "compressed_attention": attention,
        "hc_mult": int(c.get("hc_mult", 4)),
        "extra_ffn": {Dim.SHARED_EXPERT_FFN: int(c["moe_intermediate_size"])},
    }


FAMILY = Family(tables=(DEEPSEEK_V41,), fields=fields)
