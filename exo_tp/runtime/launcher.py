"""`exo-tp launch`: a local cluster that serves one request.

The ranks (`exo_tp.runtime.local_ranks`) serve the one request this process sends; it prints
the text as it streams in, and stops the ranks. A rank that dies, or stalls, ends the launch
with one line naming it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.process.supervisor import Child
from exo_tp.runtime.local_ranks import LocalRanks
from exo_tp.runtime.rank_process import rank_memory
from exo_tp.wire.assignment import DType, ServingOptions
from exo_tp.wire.runtime import Done, FinishReason, GenerateRequest, RankMemory, RequestFailed

log = logging.getLogger(__name__)


class LaunchReport(Frozen):
    """What a launch returns, and `exo-tp launch --report-out` writes."""

    tokens: tuple[int, ...]  # the generated token ids
    text: str
    prompt_tokens: int
    generation_tps: float  # decode tokens/s, after the first token
    prompt_tps: float  # prompt tokens/s, until the first token
    finish_reason: FinishReason
    drafted_tokens: int = 0  # speculative decoding: drafted, and accepted by the model
    accepted_tokens: int = 0
    memory_by_rank: tuple[RankMemory, ...]


# One request, no prompt cache: how a one-shot launch serves.
ONE_REQUEST = ServingOptions(max_concurrency=1, prompt_cache_size=0)


def _generate(ranks: LocalRanks, request: GenerateRequest) -> tuple[list[int], list[str], Done]:
    """Follow the ranks and the conductor until the answer is done, printing its text."""
    tokens: list[int] = []
    text: list[str] = []
    ranks.wait_ready()
    ranks.send(request)
    while not isinstance(event := ranks.next_answer(), Done):
        if isinstance(event, RequestFailed):
            raise ExoTpError(f"generation failed: {event.message}")
        tokens.extend(event.tokens)
        text.append(event.text)
        sys.stdout.write(event.text)
        sys.stdout.flush()
    return tokens, text, event


def _report(done: Done, tokens: list[int], text: list[str], ranks: list[Child]) -> LaunchReport:
    decode = done.seconds - done.prompt_seconds
    return LaunchReport(
        tokens=tuple(tokens),
        text="".join(text),
        prompt_tokens=done.prompt_tokens,
        generation_tps=done.completion_tokens / decode if decode > 0 else 0.0,
        prompt_tps=done.prompt_tokens / done.prompt_seconds if done.prompt_seconds else 0.0,
        finish_reason=done.finish_reason,
        drafted_tokens=done.drafted_tokens,
        accepted_tokens=done.accepted_tokens,
        memory_by_rank=tuple(rank_memory(child) for child in ranks),
    )


def launch_local(
    model: str,
    plan: PipelinePlan,
    request: GenerateRequest,
    dtype: DType,
    report_out: str | None = None,
    join_timeout: float = 120.0,
    stall_timeout: float = 60.0,
    adapter_path: str | None = None,
    rank_env: Sequence[Mapping[str, str]] | None = None,
    serving: ServingOptions = ONE_REQUEST,
) -> LaunchReport:
    """Generate ``request`` on ``plan.size`` local ranks, printing the text to stdout; returns
    the report (also written to ``report_out``). Raises ExoTpError if a rank fails.
    ``rank_env``: variables added to each rank's environment (the lab's work factors)."""
    ranks = LocalRanks(
        model, plan, dtype, serving, adapter_path, rank_env, join_timeout, stall_timeout
    )
    try:
        tokens, text, done = _generate(ranks, request)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BaseException:
        ranks.close(graceful=False)
        raise
    ranks.close()
    report = _report(done, tokens, text, ranks.ranks)
    log.info(
        "prompt %d tokens at %.1f tok/s; generated %d tokens at %.2f tok/s",
        done.prompt_tokens,
        report.prompt_tps,
        done.completion_tokens,
        report.generation_tps,
    )
    if report_out:
        Path(report_out).write_text(report.model_dump_json())
    return report
