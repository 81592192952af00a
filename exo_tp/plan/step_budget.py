"""How many tokens one batch step may carry (chunked prefill with a token budget; pure).

A step decodes one token of every running stream and prefills a chunk of the waiting prompts
(vLLM's chunked prefill). On the devices exo-tp runs on, a step costs about the sum of its
parts: the decode (weight reads, per-layer overheads, collectives) and the chunk (its FLOPs).
The budget sizes the chunk so that it costs about one decode step: the plan's predicted
seconds per decoded token times its predicted prefill tokens per second. Running streams then
wait about two decode steps per token while a long prompt is read, never a whole 512-token
chunk, and the prompt still advances by a decode step's worth of work every step.
On a GPU with fused steps (exo_tp.shard.fused_step) a small chunk rides along the decode's
weight reads and costs far less than its FLOPs here suggest: the budget is then conservative.
"""

from __future__ import annotations

from exo_tp.plan.predict import Prediction

MIN_CHUNK = 16  # never fewer prompt tokens per step (per-call overheads would dominate)


def step_token_budget(prediction: Prediction, prefill_step_size: int) -> int:
    """Prompt tokens per step whose prefill costs about one decode step (at most a chunk)."""
    if prediction.prefill_seconds <= 0:
        return prefill_step_size
    per_second = prediction.prompt_tokens / prediction.prefill_seconds
    return max(MIN_CHUNK, min(prefill_step_size, round(prediction.decode_seconds * per_second)))
