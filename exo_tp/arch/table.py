"""The schema of a per-architecture tensor-parallel table (pure data, no MLX).

A table says, for the modules inside one transformer block, which linear layers are
column-parallel (outputs split) or row-parallel (inputs split, then one all-reduce), which split
dimension each follows (packed projections list one dimension per packed part), which
sub-blocks vanish on a rank that holds none of their dimension, and which attributes hold head
counts that become local counts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.plan.spec import Frozen

# Split dimensions a rule may follow: query heads, KV heads (as held per rank, possibly
# replicated), the vocabulary, or an FFN kind named in ModelSpec.ffn_sizes ("ffn", "expert_ffn").
HEAD_DIMS = ("q_heads", "kv_heads")


class LinearRule(Frozen):
    path: str  # module path inside a block, e.g. "self_attn.q_proj"
    style: Literal["column", "row"]
    # Split dimension of each packed part along the split axis, in packed order.
    parts: tuple[str, ...] = Field(min_length=1)


class BranchRule(Frozen):
    """A sub-block whose output is a row-parallel sum; replaced by zeros where ``dim`` is empty."""

    path: str
    dim: str


class CountRule(Frozen):
    """An attribute holding a head count, set to the rank's local count."""

    path: str
    dim: Literal["q_heads", "kv_heads"]


class ArchTable(Frozen):
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    linears: tuple[LinearRule, ...]
    branches: tuple[BranchRule, ...]
    counts: tuple[CountRule, ...]
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"  # used only when embeddings are not tied
    norm: str = "model.norm"  # final norm: only the last pipeline stage applies it
