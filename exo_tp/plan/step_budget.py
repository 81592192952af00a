"""How many tokens one batch step may carry (chunked prefill with a token budget; pure).

A step decodes one token of every running stream and prefills a chunk of the waiting prompts
(vLLM's chunked prefill). On the devices exo-tp runs on, a step costs about the sum of its
parts: the decode (weight reads, per-layer overheads, collectives) and the chunk (its FLOPs).
The budget sizes the chunk so that it costs about (PREFILL_GAP - 1) decode steps: the plan's
predicted seconds per decoded token times its predicted prefill tokens per second. A chunk's cost
grows with its position (it attends to everything cached before it), so the chunk is priced
there (``chunk_at``, by the model's ``attention_ratio``): running streams then wait about
PREFILL_GAP decode steps per token through the whole prefill of a long prompt, never a whole
512-token chunk, and the prompt advances by the same work every step.
On a GPU with fused steps (exo_tp.shard.fused_step) a small chunk rides along the decode's
weight reads and costs far less than its FLOPs here suggest: the budget is then conservative.
"""

from __future__ import annotations

import math

from exo_tp.plan.cost import rank_load
from exo_tp.plan.predict import Prediction
from exo_tp.plan.shard_plan import Span
from exo_tp.plan.spec import ModelSpec
from exo_tp.plan.tensor_parallel import plan_tensor_parallel

MIN_CHUNK = 16  # never fewer prompt tokens per step (a chunk's fixed costs dominate below)


PREFILL_GAP = 3.0  # a decoding stream's gap while a prompt prefills, at most this x alone


def step_token_budget(
    prediction: Prediction, prefill_step_size: int, gap: float = PREFILL_GAP
) -> int:
    """Prompt tokens per step (at position 0) whose prefill costs about ``gap`` - 1 decode
    steps, so that a running stream's gap is about ``gap`` times its gap alone (at most a
    chunk)."""
    if prediction.prefill_seconds <= 0:
        return prefill_step_size
    per_second = prediction.prompt_tokens / prediction.prefill_seconds
    tokens = (gap - 1.0) * prediction.decode_seconds * per_second
    return max(MIN_CHUNK, min(prefill_step_size, round(tokens)))


def attention_ratio(spec: ModelSpec) -> float:
    """What one cached position adds to a prompt token's prefill, relative to the token's
    own cost at position 0 (its attention scores and mixing over that position: the
    quadratic term of prefill_flops), so a chunk is priced at its position, not by its
    length alone."""
    whole = plan_tensor_parallel(spec, [1.0]).ranks[0]
    load = rank_load(spec, whole, Span(start=0, stop=spec.num_layers), True, True)
    return 4.0 * load.attention_width / load.flops_per_token if load.flops_per_token else 0.0


def chunk_at(budget: float, position: int, ratio: float) -> int:
    """Prompt tokens whose prefill from ``position`` on costs ``budget`` tokens at position 0:
    c (1 + ratio (position + c / 2)) = budget, solved for c."""
    if ratio <= 0:
        return int(budget)
    base = 1.0 + ratio * position
    return int((math.sqrt(base * base + 2.0 * ratio * budget) - base) / ratio)
