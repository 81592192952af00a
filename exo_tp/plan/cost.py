"""Predicted decode time and memory of a shard plan (pure: plan + scores in, seconds out).

Decode reads every weight of a rank's shard once per token, so a rank's compute time is

    compute_r = decode_bytes_r * seconds_per_byte_r

with ``seconds_per_byte_r`` the rank's decode score (`exo_tp.plan.devices`) for the model's
weight format. Then every rank joins the same collectives (``plan.collectives``: two all_sums per
layer, the embedding all_sum, the padded logits all_gather), priced by a ring model fitted to the
2-rank link measurements of `exo-tp bench` (L: all_sum latency of 4 KB, B: all_sum payload rate
of 8 MB). A ring step moving s bytes costs L/2 + s/B (a 2-rank all_sum is two such steps of b/2):

    all_sum of b bytes over n ranks:        2(n-1) steps of b/n  =  (n-1) L + 2(n-1)/n * b/B
    all_gather of p bytes from each rank:   (n-1) steps of p     =  (n-1) (L/2 + p/B)

Predicted seconds per token = max_r compute_r + the collectives (ranks wait for the slowest).

What is counted: attention (q, k, v, o), each FFN kind of the spec as one gated MLP (gate, up,
down), the vocab-parallel LM head (the tied embedding is that same matrix), norms. Weights are
held in the engine's float dtype (float32: 4 bytes) unless quantized: then ``bits/8`` bytes per
weight plus a float scale and bias per group. Not counted: attention over the KV cache, the
rank-0 token broadcast, per-op overhead, MoE routing (expert counts are not in the spec).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import Field, computed_field

from exo_tp.plan.devices import ENGINE_DTYPE, LinkProfile, quant_key
from exo_tp.plan.shard_plan import RankShard, ShardPlan
from exo_tp.plan.spec import Frozen, ModelSpec

FLOAT_BYTES = 4  # float32, the engine's compute dtype for float weights and activations


class LinkCost(Frozen):
    latency: float = Field(gt=0)  # seconds of a 2-rank all_sum of a small (4 KB) message
    bandwidth: float = Field(gt=0)  # payload bytes/s of a large (8 MB) 2-rank all_sum
    measured: bool


# Assumed when no link was measured: a switched LAN, ~200 us per small all_sum, 1 GB/s.
DEFAULT_LINK = LinkCost(latency=200e-6, bandwidth=1e9, measured=False)


def weight_format(spec: ModelSpec) -> str:
    """Kernel dtype name the model's linear weights run as: "float32" or e.g. "q4g32"."""
    q = spec.quantization
    return quant_key(q.bits, q.group_size) if q else ENGINE_DTYPE


def bytes_per_weight(spec: ModelSpec, float_bytes: int = FLOAT_BYTES) -> float:
    q = spec.quantization
    return q.bits / 8 + 2 * float_bytes / q.group_size if q else float(float_bytes)


def layer_weights(spec: ModelSpec, shard: RankShard) -> int:
    """Matrix weights (not bytes) of one transformer layer held by ``shard``."""
    h, q_width = spec.hidden_size, shard.heads.q_heads.size * spec.head_dim
    kv_width = len(shard.heads.kv_heads) * spec.head_dim  # replicated KV heads count each time
    attention = h * (2 * q_width + 2 * kv_width)  # q_proj, o_proj; k_proj, v_proj
    ffn = sum(3 * h * span.size for span in shard.ffn.values())  # gate, up, down
    return attention + ffn


class ShardBytes(Frozen):
    rank: int
    memory: int  # bytes of weights the rank holds
    decode: int  # bytes of weights the rank reads per decoded token


def shard_bytes(plan: ShardPlan, float_bytes: int = FLOAT_BYTES) -> tuple[ShardBytes, ...]:
    spec = plan.spec
    per_weight = bytes_per_weight(spec, float_bytes)
    norms = (2 * spec.num_layers + 1) * spec.hidden_size * float_bytes  # replicated
    out = []
    for shard in plan.ranks:
        layers = spec.num_layers * layer_weights(spec, shard) * per_weight
        vocab = shard.vocab.size * spec.hidden_size * per_weight  # head shard (or tied embedding)
        copies = 1 if spec.tie_word_embeddings else 2  # an untied embedding is held, barely read
        out.append(ShardBytes(rank=shard.rank, memory=round(layers + copies * vocab + norms),
                              decode=round(layers + vocab + norms)))
    return tuple(out)


def all_sum_seconds(ranks: int, nbytes: float, link: LinkCost) -> float:
    if ranks < 2:
        return 0.0
    return (ranks - 1) * link.latency + 2 * (ranks - 1) / ranks * nbytes / link.bandwidth


def all_gather_seconds(ranks: int, nbytes_per_rank: float, link: LinkCost) -> float:
    if ranks < 2:
        return 0.0
    return (ranks - 1) * (link.latency / 2 + nbytes_per_rank / link.bandwidth)


def collective_seconds(plan: ShardPlan, link: LinkCost, float_bytes: int = FLOAT_BYTES) -> float:
    """Seconds per decoded token spent in the plan's collectives (one token: padded x 4 bytes)."""
    total = 0.0
    for c in plan.collectives:
        times = c.per_layer * plan.spec.num_layers if c.per_layer else 1
        payload = c.padded * float_bytes
        one = (all_sum_seconds(plan.size, payload, link) if c.op == "all_sum"
               else all_gather_seconds(plan.size, payload, link))
        total += times * one
    return total


class RankCost(Frozen):
    rank: int
    memory_bytes: int
    decode_bytes: int
    seconds_per_byte: float
    compute_seconds: float


class DecodePrediction(Frozen):
    ranks: tuple[RankCost, ...]
    collective_seconds: float
    link: LinkCost

    @computed_field  # type: ignore[prop-decorator]
    @property
    def seconds(self) -> float:
        """Predicted seconds per decoded token."""
        return max(r.compute_seconds for r in self.ranks) + self.collective_seconds

    @property
    def slowest_rank(self) -> int:
        return max(self.ranks, key=lambda r: r.compute_seconds).rank


def predict_decode(plan: ShardPlan, seconds_per_byte: Sequence[float],
                   link: LinkCost = DEFAULT_LINK, float_bytes: int = FLOAT_BYTES,
                   ) -> DecodePrediction:
    """Seconds per token of ``plan`` with rank r reading at ``seconds_per_byte[r]``."""
    if len(seconds_per_byte) != plan.size:
        raise ValueError(f"{len(seconds_per_byte)} decode scores for {plan.size} ranks")
    ranks = tuple(
        RankCost(rank=b.rank, memory_bytes=b.memory, decode_bytes=b.decode, seconds_per_byte=s,
                 compute_seconds=b.decode * s)
        for b, s in zip(shard_bytes(plan, float_bytes), seconds_per_byte, strict=True)
    )
    return DecodePrediction(ranks=ranks, collective_seconds=collective_seconds(plan, link,
                                                                               float_bytes),
                            link=link)


def worst_link(links: Iterable[LinkProfile]) -> LinkCost | None:
    """The slowest measured up link (largest latency, smallest bandwidth); None if none."""
    up = [x for x in links if x.up and x.all_sum_latency and x.all_sum_bandwidth]
    if not up:
        return None
    return LinkCost(latency=max(x.all_sum_latency or 0 for x in up),
                    bandwidth=min(x.all_sum_bandwidth or 0 for x in up), measured=True)
