"""One ring job per rank count for the architecture matrix: every case with N ranks runs, model
after model, inside the same N rank processes (tests/ring_harness.py starts them).

Starting `exo-tp launch` per case paid the imports (mlx-lm pulls in transformers: ~2 s of CPU a
process), the ring's set-up and the launcher for every case: most of a case's time for these
tiny models, and the matrix grows with every family. Here each rank loads its shard of each
case's checkpoint with the engine's own loader (`load_shard`, the plan the launcher makes for
those shares), runs the prompt and greedy decoding, and rank 0 writes the prompt's logits and
the tokens for the test to compare with single-device mlx-lm. The launcher's own path is tested
on the default model (tests/test_tp_exact.py) and through every serving test.

A case whose shard fails to load on any rank is skipped by every rank together (the ranks agree
by one all-reduce of a flag before the first collective of the forward pass), so one broken
family fails its own cases only, never the ring.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np

from exo_tp.frozen import Frozen


class RingCase(Frozen):
    """One matrix case as the ring job reads it."""

    id: str
    model: str
    weights: tuple[float, ...]
    prompt_ids: tuple[int, ...]
    tokens: int


class RingCases(Frozen):
    cases: tuple[RingCase, ...]


class RingOutcome(Frozen):
    """What rank 0 saw of one case: its logits file and tokens, or why it could not run."""

    id: str
    tokens: tuple[int, ...] = ()
    logits: str | None = None
    error: str | None = None


class RingOutcomes(Frozen):
    outcomes: tuple[RingOutcome, ...]


def _everyone_loaded(group: mx.distributed.Group, loaded: bool) -> bool:
    if group.size() == 1:
        return loaded
    held = mx.distributed.all_sum(mx.array([1.0 if loaded else 0.0]), group=group)
    return int(held.item()) == group.size()


def _run(group: mx.distributed.Group, case: RingCase, out: Path) -> RingOutcome:
    from mlx_lm.models.cache import make_prompt_cache

    from exo_tp.plan.spec import load_spec
    from exo_tp.plan.tensor_parallel import plan_tensor_parallel
    from exo_tp.shard.apply import load_shard

    error = None
    try:
        plan = plan_tensor_parallel(load_spec(Path(case.model)), list(case.weights))
        model = load_shard(Path(case.model), plan, group.rank(), group, mx.float32)
    except Exception:  # reported on the case, after every rank agreed to skip it
        error = traceback.format_exc(limit=-4)
    if not _everyone_loaded(group, error is None):
        return RingOutcome(id=case.id, error=error or "another rank failed to load its shard")
    cache = make_prompt_cache(model)
    logits = model(mx.array(case.prompt_ids)[None], cache=cache).astype(mx.float32)
    mx.eval(logits)  # on every rank: the forward pass is collective
    prompt_logits = np.array(logits[0])
    tokens = [int(mx.argmax(logits[0, -1]).item())]
    while len(tokens) < case.tokens:
        step = model(mx.array([[tokens[-1]]]), cache=cache)
        tokens.append(int(mx.argmax(step[0, -1]).item()))
    path = out / f"{case.id}.npy"
    if group.rank() == 0:
        np.save(path, prompt_logits)
    return RingOutcome(id=case.id, tokens=tuple(tokens), logits=str(path))


def run_cases(group: mx.distributed.Group, cases_file: str, out_file: str) -> None:
    """Every case of ``cases_file`` in order on this rank; rank 0 writes ``out_file``."""
    cases = RingCases.model_validate_json(Path(cases_file).read_text())
    out = Path(out_file).parent
    outcomes = tuple(_run(group, case, out) for case in cases.cases)
    if group.rank() == 0:
        Path(out_file).write_text(RingOutcomes(outcomes=outcomes).model_dump_json())
