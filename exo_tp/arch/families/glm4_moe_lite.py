"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek V3 under other class names."""

from __future__ import annotations

from exo_tp.arch.families.deepseek import DEEPSEEK
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# glm4_moe_lite (GLM-4.7-Flash) is DeepSeek V3's MLA and MoE under other class names: the same
# split (per-head q_b/embed_q/unembed_out, o row-parallel over v_head_dim, latent projections and
# the latent KV cache replicated).
GLM4_MOE_LITE = replace(DEEPSEEK, model_types=("glm4_moe_lite",))

FAMILY = Family(tables=(GLM4_MOE_LITE,))
