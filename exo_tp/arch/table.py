"""The schema of a per-architecture tensor-parallel table (pure data, no MLX).

A table describes one transformer block of an mlx-lm architecture, with paths relative to the
block:

- linears: which weights are split, along which axis, following which split dimension (packed
  projections list one dimension per packed part, e.g. q|k|v);
- branches: the sub-blocks (attention, MLP, MoE) whose output is a partial sum over ranks, each
  all-reduced exactly once at its output; a rank holding none of a branch runs a zero stand-in;
- replicated: modules inside branches that every rank holds whole (norms, routers, latent
  projections);
- counts: attributes holding head counts, set to the rank's local counts;
- norms: RMSNorms over the whole projected width of a head-split projection (MiniMax's and
  OLMo 3's q_norm/k_norm normalise all heads together): each rank holds the weight entries of
  its heads and completes the mean square with one all-reduce (exo_tp.shard.sharded_norm).

A rule whose module a block lacks is skipped, so dense and MoE blocks of one model (or optional
projections) share one table. A rule with ``where`` applies only in blocks holding that path:
layers of two kinds whose modules share names (Kimi K3's linear-attention and MLA layers both
have ``self_attn.o_proj``, split by different heads) each get their own rules. The loader
refuses a parameter inside a branch that no rule slices or declares replicated: a table that
misses a module fails loudly, never splits wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, model_validator

from exo_tp.arch.dims import HEAD_DIMS, AttentionHeadDim, CountDim, SplitDim
from exo_tp.frozen import Frozen

# How a weight is split (LinearRule).
Style = Literal["column", "row", "stacked"]


class Rule(Frozen):
    """A path inside a block, and where it applies (see the module doc)."""

    path: str
    # Applies only in blocks holding this path (a module of one layer kind); None: everywhere.
    where: str | None = None

    def applies(self, has: Callable[[str], bool]) -> bool:
        """Whether the rule applies in a block (``has``: whether the block holds a path)."""
        return has(self.path) and (self.where is None or has(self.where))


class LinearRule(Rule):
    """How one weight (a linear layer of any flavour, or a bare parameter) is split.

    - ``column``: output rows (weight axis -2, bias axis -1); experts' stacked weights
      (E, out, in) split every expert alike.
    - ``row``: input columns (weight axis -1); quantized weights are cut on group boundaries
      (never requantized). The bias is kept by one rank only, so the branch's all-reduce adds
      it exactly once.
    - ``stacked``: the leading axis of a per-head stack (MLA's (heads, out, in) weights,
      gpt-oss attention sinks (heads,)): one entry per head, or ``width`` entries (a
      depthwise conv's channels, a per-channel bias of a linear-attention head).
    """

    style: Style
    # Split dimension of each packed part along the split axis, in packed order.
    parts: tuple[SplitDim, ...] = Field(min_length=1)
    # Elements per head along the split axis (of head dims): a head width of the ModelSpec
    # ("head_dim", or a name in ModelSpec.head_widths such as "v_head_dim"). None: head_dim,
    # or one entry per head for a stacked weight.
    width: str | None = None
    # One width per packed part where the parts differ (Gated DeltaNet's q|k|v: key heads'
    # q and k rows, then their value heads' rows); overrides ``width``.
    widths: tuple[str, ...] = ()

    def per_head(self, head_width: Callable[[str], int]) -> int:
        """Elements per head along the split axis (``head_width``: ModelSpec.head_width), for
        a rule whose parts share one width."""
        widths = set(self.part_widths(head_width))
        if len(widths) != 1:
            raise ValueError(f"{self.path}: its packed parts have different head widths")
        return widths.pop()

    def part_widths(self, head_width: Callable[[str], int]) -> tuple[int, ...]:
        """Elements per head of each packed part along the split axis."""
        if self.widths:
            return tuple(head_width(w) for w in self.widths)
        if self.width is None:
            one = 1 if self.style == "stacked" else head_width("head_dim")
        else:
            one = head_width(self.width)
        return (one,) * len(self.parts)

    @model_validator(mode="after")
    def _stacked_by_heads(self) -> LinearRule:
        if self.style == "stacked" and any(p not in HEAD_DIMS for p in self.parts):
            raise ValueError(f"{self.path}: a stacked weight is split by heads only")
        if self.widths and len(self.widths) != len(self.parts):
            raise ValueError(f"{self.path}: one width per packed part")
        return self


class BranchRule(Rule):
    """A sub-block computing, on each rank, a partial sum from its slices of the split weights
    inside it.

    ``reduce``: its output is all-reduced once, here (attention, an MLP, a whole MoE block).
    Otherwise it is a piece of an enclosing branch (the routed experts or the shared experts
    of a MoE block) whose partial output joins that branch's single all-reduce. A rank that
    holds nothing of any split weight inside gets a zero stand-in of ``kind``: ``attention``
    (also keeps its KV cache in step), ``mlp`` (called with x) or ``experts`` (called with x
    and the routed expert indices) or ``recurrent`` (a linear-attention layer: keeps its
    recurrent-state cache in step).
    """

    kind: Literal["attention", "recurrent", "mlp", "experts"]
    reduce: bool = True
    # Attention that returns (output, (keys, values), offset) and takes shared_kv/offset
    # (Gemma 4: later layers attend with an earlier layer's keys and values). Only the output
    # is all-reduced; a stand-in hands on (or caches) a stand-in head's keys and values.
    shares_kv: bool = False


class CountRule(Rule):
    """An attribute holding a head count, set to the rank's local count (times ``width``
    elements per head, times ``times``: a projection's width, a depthwise conv's groups)."""

    dim: CountDim
    width: str | None = None
    times: int = Field(default=1, gt=0)


class NormRule(Rule):
    """An RMSNorm over the full width (all heads x head width) of a projection split by heads.

    Its weight is cut like the projection's output rows (``dim``, heads of ``width``); the
    mean square is a sum of squares over every rank's heads, each head counted once (a KV head
    replicated on several ranks is counted by its first holder only), all-reduced, then divided
    by the full width. A rank holding no heads of the enclosing attention still joins that
    all-reduce (its stand-in sends zeros); ``dim`` kv_heads marks the norm whose output is
    cached (keys), so the stand-in ties it to its cache as the real layer does.
    """

    dim: AttentionHeadDim
    width: str = "head_dim"


class SumRule(Rule):
    """A replicated module inside a reducing branch that acts on the whole sum of the partial
    values it is given (Kimi K3's norm of the routed experts' latent sum): its input is
    all-reduced first (``width``: the ModelSpec field holding that input's width; a stand-in
    of the enclosing branch joins with zeros). ``once``: the replicated module after it whose
    output is then whole on every rank, kept by the first rank holding the branch (zeros
    elsewhere) so that the branch's own all-reduce adds it once."""

    width: str
    once: str


class GroupedOutputRule(Frozen):
    """A low-rank output projection over groups of consecutive query heads (DeepSeek V4.1's
    o_a/o_b): ``inner`` is a stack of one (rank, heads per group x head_dim) projection per
    group (block diagonal: a group reads only its own heads), ``outer`` a linear over every
    group's rank-wide output. Heads, not whole groups, stay the split unit (uneven shares keep
    their resolution, and more ranks than groups still hold heads), so a group may straddle
    ranks: a rank holds the inner entries and outer columns of every group its heads touch,
    and feeds the inner stack its heads' outputs with the other heads of those groups as zeros.
    Both projections are linear, so its result is its heads' part of the output, a partial sum
    like any row-parallel output. ``groups``: the attribute counting the groups the attention
    reshapes its output into (set to 1: the rank's heads go in as one piece); ``ids``: the
    group indices it passes with them (unused by the rank's stack, which knows its groups)."""

    inner: str
    outer: str
    groups: str
    ids: str


class FusedBlock(Frozen):
    """A block that computes ``h = x + attention(attention_norm(x))``, then
    ``h + mlp(mlp_norm(h))``, both branches reducing (mlx-lm's llama, Qwen 2 and Qwen 3
    blocks). A step's decode rows and a prompt chunk may then run through it in one pass: the
    norms, the MLP and both all-reduces on the rows joined, each attention on its own rows and
    cache (exo_tp.shard.fused_step)."""

    attention: str = "self_attn"
    mlp: str = "mlp"
    attention_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"


class ArchTable(Frozen):
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    linears: tuple[LinearRule, ...]
    branches: tuple[BranchRule, ...]
    replicated: tuple[str, ...] = ()
    counts: tuple[CountRule, ...]
    norms: tuple[NormRule, ...] = ()
    sums: tuple[SumRule, ...] = ()
    grouped_outputs: tuple[GroupedOutputRule, ...] = ()
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"  # used only when the model has one (untied embeddings)
    norm: str = "model.norm"  # final norm: only the last pipeline stage applies it
    # Other token-indexed tables (Gemma 4's per-layer input embeddings): vocab-split like the
    # embedding, lookups all-reduced, where they have the model's vocabulary; else whole.
    vocab_tables: tuple[str, ...] = ()
    # A model whose tied head multiplies by the embedding's weight itself (Seed-OSS:
    # ``h @ embed_tokens.weight.T``) where the embedding is vocab-parallel: this attribute of
    # the model is set False and its lm_head computes the tied logits through the
    # vocab-parallel embedding instead.
    untie_attr: str | None = None
    # mlx-lm's default when config.json omits tie_word_embeddings
    tie_default: bool = True
    # False where mlx-lm derives head_dim as hidden_size // heads whatever config.json says
    reads_head_dim: bool = True
    # Pipeline stages (a layer range per stage) are known to work: the model's forward pass
    # embeds its tokens and runs its layers with nothing in between (a later stage's embedding
    # is a HiddenFeed handing over the previous stage's hidden state) and nothing depends on
    # a layer's global index (masks' cache indices follow the slice: exo_tp.shard.apply).
    # Not so where the embedding is scaled (Gemma) or read per layer (Gemma 4).
    stages: bool = False
    # The attention computes its scores per KV group, (B, KV heads, repeats, L, S) (mlx-lm's
    # gemma2), where mlx-lm's batched mask (B, 1, L, S) does not broadcast: the mask gets the
    # group axis (exo_tp.shard.layers.GroupedScoresMask), or two prompts of different lengths
    # in one batch fail.
    grouped_scores: bool = False
    # The model's caches cannot be batched by mlx-lm (DeepSeek V4.1's LayerCache: no merge, and
    # one start position for the whole batch): the runtime's batch runs it one sequence at a
    # time (exo_tp.shard.sequences).
    batch_by_sequence: bool = False
    # Its layers hand on more than one hidden state (DeepSeek V4.1: hyper-connection streams,
    # their mix and a forward pass's shared state): a pipeline stage passes them as one message
    # (exo_tp.shard.streams).
    stage_state: bool = False
    # The block's shape where it lets decode rows and a prompt chunk share one forward pass
    # (FusedBlock); None: a step runs them as mlx-lm does, in two.
    fused: FusedBlock | None = None
    # Settings objects a block's modules share with the whole model (LFM2's short conv reads
    # its channel count from the model's ModelArgs): each block gets its own copy before
    # counts set a field of it, so one layer's local count never reaches another's.
    copied: tuple[str, ...] = ()
    # False: no tensor-parallel split is known (exo_tp.arch.generic's stages-only table for an
    # mlx-lm model without a table): every stage is one rank holding whole layers.
    split: bool = True
    # Why the model gets the mode it gets (the generic table's one readable reason).
    why: str = ""

    @property
    def mode(self) -> str:
        """How the model can run: split inside its layers, in whole-layer stages, or whole."""
        if self.split:
            return "tensor-parallel"
        return "pipeline stages only" if self.stages else "whole on one node"

    @property
    def stack(self) -> str:
        """Path of the module holding the layers (and the embedding): the model's forward pass
        without its head, which a pipeline stage before the last runs."""
        return self.layers.rpartition(".")[0]

    @model_validator(mode="after")
    def _every_split_is_reduced_once(self) -> ArchTable:
        reducing = [b.path for b in self.branches if b.reduce]
        for branch in self.branches:
            outer = [p for p in reducing if p != branch.path and is_under(branch.path, p)]
            if branch.reduce and outer:
                raise ValueError(f"branch {branch.path} inside {outer[0]} would reduce twice")
            if not branch.reduce and not outer:
                raise ValueError(f"branch {branch.path} is inside no reducing branch")
        paths = [r.path for r in (*self.linears, *self.norms)]
        paths += [p for g in self.grouped_outputs for p in (g.inner, g.outer)]
        for path in paths:
            if not any(is_under(path, p) for p in reducing):
                raise ValueError(f"{path} is inside no reducing branch")
        attention = [b.path for b in self.branches if b.kind == "attention"]
        if self.fused and not {self.fused.attention, self.fused.mlp} <= set(reducing):
            raise ValueError("a fused block's attention and MLP must be reducing branches")
        for norm in self.norms:
            # its stand-in must join the norm's all-reduce: only attention stand-ins do
            if not any(is_under(norm.path, p) for p in attention):
                raise ValueError(f"{norm.path} is inside no attention branch")
        for rule in self.sums:
            for path in (rule.path, rule.once):
                if not any(is_under(path, r) for r in self.replicated):
                    raise ValueError(f"{path} sums or is summed whole: it must be replicated")
            if not any(is_under(rule.path, p) for p in reducing):
                raise ValueError(f"{rule.path} is inside no reducing branch")
        return self


def is_under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or lies inside it."""
    return path == prefix or path.startswith(f"{prefix}.")
