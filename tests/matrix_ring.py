"""One ring job per rank count for the architecture matrix: every case with N ranks runs, model
after model, inside the same N rank processes (tests/ring_harness.py starts them).

Starting `exo-tp launch` per case paid the imports (mlx-lm pulls in transformers: ~2 s of CPU a
process), the ring's set-up and the launcher for every case: most of a case's time for these
tiny models, and the matrix grows with every family. Here each rank loads its shard of each
case's checkpoint with the engine's own loader (`load_shard`, the plan the launcher makes for
those shares), runs the prompt and greedy decoding, and rank 0 writes the prompt's logits and
the tokens for the test to compare with single-device mlx-lm. The launcher's own path is tested
on the default model (tests/ranks/test_tp_exact.py) and through every serving test.

A case whose shard fails to load on any rank is skipped by every rank together (the ranks agree
by one all-reduce of a flag before the first collective of the forward pass), so one broken
family fails its own cases only, never the ring.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from exo_tp.frozen import Frozen
from exo_tp.plan import Span


class RingCase(Frozen):
    """One matrix case as the ring job reads it. ``staged``: also run it as two pipeline stages
    on the same ranks (see `_staged`), with ``stage_weights`` for the second stage."""

    id: str
    model: str
    weights: tuple[float, ...]
    prompt_ids: tuple[int, ...]
    tokens: int
    staged: bool = False
    stage_weights: tuple[float, ...] = ()


class RingCases(Frozen):
    cases: tuple[RingCase, ...]


class RingOutcome(Frozen):
    """What rank 0 saw of one case: its logits file and tokens, or why it could not run (and
    the same for the case run as two stages, where it was)."""

    id: str
    tokens: tuple[int, ...] = ()
    logits: str | None = None
    error: str | None = None
    staged: RingOutcome | None = None


class RingOutcomes(Frozen):
    outcomes: tuple[RingOutcome, ...]


def _everyone_loaded(group: mx.distributed.Group, loaded: bool) -> bool:
    """Whether every rank succeeded (one all-reduce of a flag)."""
    if group.size() == 1:
        return loaded
    held = mx.distributed.all_sum(mx.array([1.0 if loaded else 0.0]), group=group)
    return int(held.item()) == group.size()


def _load(group: mx.distributed.Group, case: RingCase, stages: int) -> list[Any] | str:
    """Every stage's shard (all stages on this same group), or the error that stopped any
    rank (every rank agrees, before the first collective)."""
    from exo_tp.plan.spec import load_spec
    from exo_tp.plan.tensor_parallel import plan_tensor_parallel
    from exo_tp.shard.apply import load_shard

    error, models = None, []
    try:
        spec = load_spec(Path(case.model))
        cut = spec.num_layers // 2
        spans = (
            [Span(start=0, stop=spec.num_layers)]
            if stages == 1
            else [Span(start=0, stop=cut), Span(start=cut, stop=spec.num_layers)]
        )
        shares = [case.weights, case.stage_weights or case.weights]
        for i, layers in enumerate(spans):
            plan = plan_tensor_parallel(spec, list(shares[i]))
            first, last = i == 0, i == len(spans) - 1
            model = load_shard(
                Path(case.model), plan, group.rank(), group, mx.float32, layers, first, last
            )
            models.append(model)
    except Exception:  # reported on the case, after every rank agreed to skip it
        error = traceback.format_exc(limit=-4)
    if not _everyone_loaded(group, error is None):
        return error or "another rank failed to load its shard"
    return models


def _staged_forward(group: mx.distributed.Group, models: list[Any], case: RingCase) -> Any:
    """What two pipeline stages compute: the first stage's layer stack (its final norm an
    identity, or DeepSeek V4.1's stage message), then the second stage's model fed, through its
    embedding's `HiddenFeed`, what the first stage's sender computed
    (exo_tp.runtime.pipeline.StageModel: the sender, exo_tp.plan.pipeline.hop_sender, sends its
    to every rank of the next stage; here one all-reduce hands it over, minus the hop between
    machines)."""
    from mlx_lm.models.cache import make_prompt_cache

    from exo_tp.arch import table_for
    from exo_tp.plan.pipeline import hop_sender
    from exo_tp.plan.spec import load_spec
    from exo_tp.plan.tensor_parallel import plan_tensor_parallel
    from exo_tp.shard.tree import get_path

    spec = load_spec(Path(case.model))
    table = table_for(spec.model_type)
    sender = hop_sender(plan_tensor_parallel(spec, list(case.weights)))
    inner = get_path(models[0], table.stack)
    feed = get_path(models[1], table.embedding)
    caches = [make_prompt_cache(m) for m in models]

    def forward(tokens: mx.array) -> mx.array:
        feed.feed(_from_rank(group, sender, inner(tokens, cache=caches[0])))
        return models[1](tokens, cache=caches[1])

    return forward


def _from_rank(group: mx.distributed.Group, sender: int, x: mx.array) -> mx.array:
    """Rank ``sender``'s ``x`` on every rank: the others add zeros (exact; bytes travel as
    float32), computed after their own ``x`` (whose forward pass runs the stage's collectives)."""
    from exo_tp.shard.collectives import zeros_after

    if group.size() == 1:
        return x
    mine = x.astype(mx.float32) if group.rank() == sender else zeros_after(x.shape, mx.float32, x)
    return mx.distributed.all_sum(mine, group=group).astype(x.dtype)


def _generate(group: mx.distributed.Group, forward: Any, case: RingCase, out: Path, name: str):
    logits = forward(mx.array(case.prompt_ids)[None]).astype(mx.float32)
    mx.eval(logits)  # on every rank: the forward pass is collective
    prompt_logits = np.array(logits[0])
    tokens = [int(mx.argmax(logits[0, -1]).item())]
    while len(tokens) < case.tokens:
        step = forward(mx.array([[tokens[-1]]]))
        tokens.append(int(mx.argmax(step[0, -1]).item()))
    path = out / f"{name}.npy"
    if group.rank() == 0:
        np.save(path, prompt_logits)
    return RingOutcome(id=name, tokens=tuple(tokens), logits=str(path))


def _agreed_generate(
    group: mx.distributed.Group, forward: Any, case: RingCase, out: Path, name: str
) -> RingOutcome:
    """`_generate`, or the error every rank agrees on (one raised before any collective of
    the forward pass on every rank alike, such as a model indexing a cache it lacks)."""
    outcome, error = None, None
    try:
        outcome = _generate(group, forward, case, out, name)
    except Exception:
        error = traceback.format_exc(limit=-4)
    if not _everyone_loaded(group, error is None):
        return RingOutcome(id=name, error=error or "another rank failed in the forward pass")
    assert outcome is not None
    return outcome


def _run(group: mx.distributed.Group, case: RingCase, out: Path) -> RingOutcome:
    from mlx_lm.models.cache import make_prompt_cache

    models = _load(group, case, 1)
    if isinstance(models, str):
        return RingOutcome(id=case.id, error=models)
    cache = make_prompt_cache(models[0])
    whole = _agreed_generate(group, lambda t: models[0](t, cache=cache), case, out, case.id)
    if not case.staged:
        return whole
    stages = _load(group, case, 2)
    if isinstance(stages, str):
        staged = RingOutcome(id=f"{case.id}-staged", error=stages)
    else:
        forward = _staged_forward(group, stages, case)
        staged = _agreed_generate(group, forward, case, out, f"{case.id}-staged")
    return whole.model_copy(update={"staged": staged})


def run_cases(group: mx.distributed.Group, cases_file: str, out_file: str) -> None:
    """Every case of ``cases_file`` in order on this rank; rank 0 writes ``out_file``."""
    cases = RingCases.model_validate_json(Path(cases_file).read_text())
    out = Path(out_file).parent
    outcomes = tuple(_run(group, case, out) for case in cases.cases)
    if group.rank() == 0:
        Path(out_file).write_text(RingOutcomes(outcomes=outcomes).model_dump_json())
