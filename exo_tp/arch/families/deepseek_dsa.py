"""DeepSeek V3.2 and GLM-5 (glm_moe_dsa): DeepSeek V3 plus DeepSeek Sparse Attention."""

from __future__ import annotations

from exo_tp.arch.families.deepseek import DEEPSEEK
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# DeepSeek V3.2 and GLM-5 (glm_moe_dsa): DeepSeek V3's MLA and MoE plus DeepSeek Sparse
# Attention's indexer, which picks the top index_topk keys per query from its own small
# projections (wq_b over the replicated q_a latent, wk, k_norm, weights_proj). The indexer is
# replicated, not split: every rank needs the same full selection for its heads, and a split
# indexer would have to all-reduce a (queries x keys) score tensor per layer and could then pick
# different keys than one device does (a sum in another order can reorder near-ties). Replicated,
# each rank computes exactly the single-device selection, with no extra collective; it costs
# every rank the indexer's weights (small next to the experts) and its key cache (one
# index_head_dim vector per token, the second cache of each layer's CacheList).
DEEPSEEK_DSA = replace(
    DEEPSEEK,
    model_types=("deepseek_v32", "glm_moe_dsa"),
    replicated=(*DEEPSEEK.replicated, "self_attn.indexer"),
)

FAMILY = Family(tables=(DEEPSEEK_DSA,))
