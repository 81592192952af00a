"""What a rank is asked to do: the one job description of `exo-tp launch` and `exo-tp run`
(serialized to every rank process; no MLX here)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction
from exo_tp.wire.ids import Epoch, NodeId, Rank

# The key every link of the job authenticates with (hex): the cluster secret, or a per-job key
# for `exo-tp launch`. In the environment, never on a command line.
LINK_KEY_ENV = "EXO_TP_LINK_KEY"

DType = Literal["float32", "float16", "bfloat16", "auto"]
# Bytes of one activation (and KV cache) element in each; auto keeps float32 on a CPU.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 4}


# Drafts per step where a model drafts (a draft model, the checkpoint's MTP heads) and neither
# the node nor the request says: mlx-lm's default for its draft models.
MODEL_DRAFTS = 3


class ServingOptions(Frozen):
    """How the conductor batches (every rank of the epoch uses the same)."""

    max_concurrency: int = Field(default=8, ge=1, le=256)  # sequences in one decode batch
    prefill_step_size: int = Field(default=512, ge=16)  # prompt tokens per chunk between steps
    # Tokens one step may carry while streams decode: their decode tokens plus a chunk of the
    # waiting prompts (exo_tp.plan.step_budget). None: the leader sizes it from the plan's
    # prediction when it has one, else every chunk is prefill_step_size.
    step_token_budget: int | None = Field(default=None, ge=16)  # step_budget.MIN_CHUNK
    # The budget is in tokens at position 0; a chunk further on costs more (its attention to
    # the cached prefix): one cached position adds this much of a token's cost (set by the
    # leader with the budget: exo_tp.plan.step_budget.attention_ratio; 0: priced by length).
    chunk_attention_ratio: float = Field(default=0.0, ge=0.0)
    # While a prompt prefills, a decoding stream's gap is at most about this x its gap alone
    # (the budget's size; --prefill-gap).
    prefill_gap: float = Field(default=3.0, gt=1.0, le=100.0)
    # A step's decode rows and a prompt chunk in one forward pass (exo_tp.shard.fused_step;
    # one stage, a float KV cache, a family whose blocks fuse). auto: on GPUs only: on a CPU
    # a step costs the sum of its work either way, and one pass measured 7-8% slower on the
    # 2-core VM (docs/benchmarks.md, run 4).
    fused_steps: Literal["auto", "on", "off"] = "auto"
    # Joining prompts prefilled together in one step. 1: each joins alone, shortest first, so
    # its first token does not wait for the others' prefill (on CPUs a step's cost grows with
    # its tokens, so prefilling together saves nothing); more pays off where a batched prefill
    # costs little more than one prompt's (GPUs).
    prefill_batch_size: int = Field(default=1, ge=1, le=256)
    # A quantized KV cache (mlx-lm's QuantizedKVCache and names; None: float): bits, the group
    # along the head width, and the offset from which a sequence's cache is quantized.
    kv_bits: Literal[2, 3, 4, 5, 6, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    quantized_kv_start: int = Field(default=0, ge=0)
    # KV cache bytes a rank may fill (None: what its memory leaves after the weights); the
    # leader admits a request only while every running request's context fits in it.
    kv_cache_bytes: int | None = Field(default=None, ge=0)
    prompt_cache_size: int = Field(default=10, ge=0)  # entries kept (0: no prompt cache)
    prompt_cache_bytes: int | None = Field(default=None, ge=0)  # on the rank holding the most
    # Pipelines: split the batch into one micro-batch per stage, so every stage works at once.
    overlap: bool = True
    # Speculative decoding (exo_tp.runtime.speculative): draft tokens per step for requests
    # that do not say (0: off; None: MODEL_DRAFTS where a model drafts, a draft model or MTP
    # heads, else off), and the longest n-gram prompt lookup looks up to draft them.
    num_draft_tokens: int | None = Field(default=None, ge=0, le=32)
    prompt_lookup_ngram: int = Field(default=3, ge=1, le=16)
    # A draft model's folder on the conductor's machine (exo_tp.runtime.draft_model), drafting
    # in place of prompt lookup; checked against the model's tokenizer before any rank starts.
    draft_model: str | None = None
    # The checkpoint's own MTP heads drafting (exo_tp.runtime.mtp): on, off, or auto: on where
    # the checkpoint carries them and the last stage computes on GPUs (there a verify step of
    # a few positions costs about one decode step; on CPUs it costs several, and MTP's drafts
    # do not pay: docs/benchmarks.md).
    mtp: Literal["auto", "on", "off"] = "auto"
    # Several streams drafting (prompt lookup) and verified in one batched step
    # (exo_tp.runtime.batch_verify): auto where every rank of a one-stage plan computes on a
    # GPU; on a CPU B rows of K + 1 positions cost about B(K + 1) streams' step.
    batch_drafts: Literal["auto", "on", "off"] = "auto"
    # What the leader's planner optimises when it plans from measured profiles: one request's
    # time per token, every stream's tokens together, or auto by the queue when it plans.
    objective: Literal["latency", "throughput", "auto"] = "auto"

    def loads_draft(self) -> bool:
        """Whether the conductor loads the draft model: speculation needs a float KV cache
        (exo_tp.runtime.rank)."""
        return self.draft_model is not None and self.kv_bits is None


class Assignment(Frozen):
    """A rank's part in an epoch: which rank it is, how to reach the others, what to serve."""

    epoch: Epoch = Field(ge=0)
    model: str  # a prepared model name or a folder present on the rank's machine
    # The folder to load from when the node chose it (its files, or its shard store).
    model_dir: str = ""
    # The conductor's: the draft model's folder when its node chose it (its files, or the
    # store it received the draft into); "" resolves serving.draft_model on this machine.
    draft_dir: str = ""
    plan: PipelinePlan
    rank: Rank = Field(ge=0)  # global rank
    hostfile: tuple[str, ...]  # "ip:port" each global rank's ring socket listens on
    conductor: str  # "ip:port" the conductor (last stage's first rank) meets the others at
    requests_at: str  # "ip:port" of the request source the conductor joins
    hops: tuple[str, ...] = ()  # pipelines: "ip:port" of each global rank's incoming hop
    nodes: tuple[NodeId, ...] = ()  # node id per global rank
    dtype: DType = "float32"
    backend: Literal["ring", "jaccl"] = "ring"
    # jaccl only: ibverbs device from rank i to rank j (None on the diagonal)
    ibv_devices: tuple[tuple[str | None, ...], ...] | None = None
    prediction: Prediction | None = None  # the planner's cost model for this plan, if any
    serving: ServingOptions = ServingOptions()
    measure_links: bool = True  # time the stage's collectives once the group formed
    adapter_path: str | None = None  # an mlx-lm LoRA adapter folder applied to every shard
    speed_probe: bool = False  # time its shard's matmuls every few seconds (rebalancing)

    @property
    def stage_index(self) -> int:
        return self.plan.locate(self.rank)[0]

    @property
    def local_rank(self) -> int:
        """Rank inside its stage's MLX group."""
        return self.plan.locate(self.rank)[1]

    @property
    def lanes(self) -> int:
        """Micro-batches in flight at once: one per stage when overlapping, else one."""
        return len(self.plan.stages) if self.serving.overlap else 1

    @property
    def conductor_rank(self) -> int:
        return self.plan.stages[-1].ranks[0]
