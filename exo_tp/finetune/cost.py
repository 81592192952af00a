"""What a LoRA fine-tuning step costs on a cluster, predicted (pure: spec and devices in).

A dense model is a chain of gather steps (embedding, then q, k, v, o, gate, up, down of every
layer, then the LM head), each a weight of ``rows`` x ``in`` cut by rows. Per training step:

- **compute** of rank r on its ``tokens_r``: forward ``2·params`` and backward (input gradients
  only: the base is frozen) ``2·params`` FLOPs per token, at the device's training FLOP/s;
  LoRA's own matmuls and attention scores are left out (about 1% at 512-token sequences);
- **gathers**: every step's weight once forward and once backward (not the embedding lookup),
  each an all-gather of the largest rank's rows (padded), priced by the ring model of
  `exo_tp.plan.cost` (``(n-1)(L/2 + bytes/B)``); the LoRA gradients one all-reduce;
- each gather is a barrier: a step lasts as long as the slowest rank's compute of it. With
  prefetch the next step's gather overlaps this step's compute (``max``), without it adds up;
- **memory** of rank r: its rows of every weight, two steps' gathered buffers in flight (each
  the padded all-gather plus the whole weight), activations kept for the backward (an
  approximation: ``act_bytes · (6h + 4·ffn + 2(q + 2kv))`` per token per layer: the inputs
  and outputs of every linear and the attention's q, k, v), and LoRA weights, gradients and
  two Adam moments in float32.

mlx-lm's data-parallel LoRA is priced the same way with every rank holding the whole base and
an equal share of each batch (mlx-lm splits batches evenly); it runs only on devices the whole
model fits on.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from exo_tp.arch.dims import Dim
from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan.cost import LinkCost, all_gather_seconds, all_sum_seconds, bytes_per_weight
from exo_tp.plan.finetune import batch_rows, split_rows
from exo_tp.plan.spec import ModelSpec

MEMORY_HEADROOM = 0.9  # a rank may use this fraction of its device's memory
LORA_STATE = 4  # float32 LoRA weights, gradients and two Adam moments: 4 copies


class Device(Frozen):
    name: str
    memory: int = Field(gt=0)  # bytes usable by one process
    flops: float = Field(gt=0)  # FLOP/s on training-shaped matmuls


class GatherStep(Frozen):
    name: str
    rows: int  # output rows (vocabulary rows of an embedding): the cut dimension
    inputs: int  # input width
    row_bytes: float  # bytes of one row as stored


class Workload(Frozen):
    """One training step: the global batch, and what LoRA adds."""

    tokens: int = Field(gt=0)  # over all ranks
    lora_params: int = Field(ge=0)
    act_bytes: int = 2  # activation dtype bytes (bfloat16 on a Mac GPU)
    float_bytes: int = 2  # float weights as stored (bfloat16)


class RankEstimate(Frozen):
    device: str
    memory_share: float
    tokens: int
    held_bytes: int
    peak_bytes: int
    fits: bool
    compute_seconds: float


class Estimate(Frozen):
    contender: str
    ranks: tuple[RankEstimate, ...]
    step_seconds: float
    gather_seconds: float  # all gathers of a step, end to end (hidden by prefetch or not)
    tokens_per_second: float
    fits: bool
    note: str = ""


def chain_steps(spec: ModelSpec, float_bytes: int = 2) -> tuple[GatherStep, ...]:
    """The sharded weights of a dense model, in the order a forward pass uses them."""
    if spec.num_experts:
        raise ExoTpError(f"{spec.model_type}: the fine-tuning cost model covers dense models")
    per = bytes_per_weight(spec, float_bytes)
    h, ffn = spec.hidden_size, spec.ffn_sizes[Dim.FFN]
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = [
        ("q_proj", q, h),
        ("k_proj", kv, h),
        ("v_proj", kv, h),
        ("o_proj", h, q),
        ("gate_proj", ffn, h),
        ("up_proj", ffn, h),
        ("down_proj", h, ffn),
    ]
    named = [("embed_tokens", spec.vocab_size, h)]
    named += [(f"layers.{i}.{n}", r, c) for i in range(spec.num_layers) for n, r, c in layer]
    named += [("lm_head", spec.vocab_size, h)]  # the tied embedding, or its own head
    return tuple(GatherStep(name=n, rows=r, inputs=c, row_bytes=c * per) for n, r, c in named)


def base_bytes(spec: ModelSpec, float_bytes: int = 2) -> float:
    steps = chain_steps(spec, float_bytes)
    if spec.tie_word_embeddings:
        steps = steps[:-1]
    return sum(s.rows * s.row_bytes for s in steps)


def activation_bytes_per_token(spec: ModelSpec, act_bytes: int) -> int:
    h, ffn = spec.hidden_size, spec.ffn_sizes[Dim.FFN]
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return act_bytes * spec.num_layers * (6 * h + 4 * ffn + 2 * (q + 2 * kv))


def _compute(steps: Sequence[GatherStep], tokens: int, device: Device) -> list[float]:
    """Seconds of each step's forward (the backward of it costs the same) on ``tokens``; the
    first step, the embedding lookup, is no matmul."""
    return [0.0] + [2.0 * s.rows * s.inputs * tokens / device.flops for s in steps[1:]]


def estimate_sharded(
    spec: ModelSpec,
    devices: Sequence[Device],
    memory_weights: Sequence[float],
    speed_weights: Sequence[float],
    work: Workload,
    link: LinkCost,
    prefetch: bool,
    contender: str = "exo-tp sharded",
) -> Estimate:
    """exo-tp: rows of every weight by memory weight, batch rows by speed weight."""
    n = len(devices)
    steps = chain_steps(spec, work.float_bytes)
    tokens = [s.size for s in batch_rows(work.tokens, speed_weights)]
    splits = [split_rows(s.rows, memory_weights) for s in steps]
    compute = [_compute(steps, t, d) for t, d in zip(tokens, devices, strict=True)]
    gathers = [
        all_gather_seconds(n, sp.padded * st.row_bytes, link)
        for sp, st in zip(splits, steps, strict=True)
    ]
    slowest = [max(c[k] for c in compute) for k in range(len(steps))]
    forward = _overlap(slowest, gathers, prefetch)
    # the backward walks the chain the other way, and not down to the embedding lookup
    backward = _overlap(slowest[:0:-1], gathers[:0:-1], prefetch)
    lora = all_sum_seconds(n, 4 * work.lora_params, link)  # float32 LoRA gradients
    step = forward + backward + lora
    held_steps = steps[:-1] if spec.tie_word_embeddings else steps
    in_flight = 2 * max(
        ((n * sp.padded + st.rows) * st.row_bytes) for sp, st in zip(splits, steps, strict=True)
    )
    acts = activation_bytes_per_token(spec, work.act_bytes)
    ranks = []
    for r, device in enumerate(devices):
        held = sum(sp.sizes[r] * st.row_bytes for sp, st in zip(splits, held_steps, strict=False))
        peak = held + in_flight + tokens[r] * acts + LORA_STATE * 4 * work.lora_params
        ranks.append(
            RankEstimate(
                device=device.name,
                memory_share=memory_weights[r] / sum(memory_weights),
                tokens=tokens[r],
                held_bytes=round(held),
                peak_bytes=round(peak),
                fits=peak <= MEMORY_HEADROOM * device.memory,
                compute_seconds=2 * sum(compute[r]),
            )
        )
    return Estimate(
        contender=contender,
        ranks=tuple(ranks),
        step_seconds=step,
        gather_seconds=2 * sum(gathers) - gathers[0],
        tokens_per_second=work.tokens / step,
        fits=all(r.fits for r in ranks),
    )


def estimate_replicas(
    spec: ModelSpec,
    devices: Sequence[Device],
    work: Workload,
    link: LinkCost,
    contender: str = "mlx-lm data parallel",
) -> Estimate:
    """mlx-lm's data-parallel LoRA on the devices the whole model fits on (one: single
    device), each with an equal share of every batch."""
    whole = base_bytes(spec, work.float_bytes)
    acts = activation_bytes_per_token(spec, work.act_bytes)
    lora = LORA_STATE * 4 * work.lora_params

    def peak(tokens: int) -> float:
        return whole + tokens * acts + lora

    # Keep the fastest devices that fit an equal share (more ranks: smaller shares).
    ordered = sorted(devices, key=lambda d: -d.flops)
    for count in range(len(ordered), 0, -1):
        chosen = ordered[:count]
        share = -(-work.tokens // count)
        if all(peak(share) <= MEMORY_HEADROOM * d.memory for d in chosen):
            break
    else:
        return Estimate(
            contender=contender,
            ranks=(),
            step_seconds=float("inf"),
            gather_seconds=0.0,
            tokens_per_second=0.0,
            fits=False,
            note="the whole model fits on no device",
        )
    n = len(chosen)
    steps = chain_steps(spec, work.float_bytes)
    compute = [2 * sum(_compute(steps, share, d)) for d in chosen]
    step = max(compute) + all_sum_seconds(n, 4 * work.lora_params, link)
    left_out = [d.name for d in devices if d not in chosen]
    ranks = tuple(
        RankEstimate(
            device=d.name,
            memory_share=1.0,
            tokens=share,
            held_bytes=round(whole),
            peak_bytes=round(peak(share)),
            fits=True,
            compute_seconds=c,
        )
        for d, c in zip(chosen, compute, strict=True)
    )
    return Estimate(
        contender=contender,
        ranks=ranks,
        step_seconds=step,
        gather_seconds=0.0,
        tokens_per_second=work.tokens / step,
        fits=True,
        note=f"leaves out {', '.join(left_out)} (the whole model does not fit)" if left_out else "",
    )


def _overlap(compute: Sequence[float], gathers: Sequence[float], prefetch: bool) -> float:
    """Steps in sequence; with prefetch step k+1's gather runs during step k's compute."""
    if not prefetch:
        return sum(compute) + sum(gathers)
    # the first gather is exposed; then each step lasts max(its compute, the next gather)
    nxt = [*gathers[1:], 0.0]
    return gathers[0] + sum(max(c, g) for c, g in zip(compute, nxt, strict=True))
