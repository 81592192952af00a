"""When the served model is let go for being idle (pure): Ollama's ``keep_alive`` and the
node's ``--keep-alive``.

A model stays loaded while requests run and for its keep-alive once the last one ended: the
latest request's ``keep_alive`` if it gave one (0: unload as soon as nothing runs; negative:
for ever), else ``--keep-alive`` for a model loaded on demand, and for ever for a pinned one
(named with ``--model`` when the cluster started, which the cluster serves unasked). Once let
go, no epoch forms until a request names a model again; that request gets the 503 of a model
loading and the cluster loads it.
"""

from __future__ import annotations

from exo_tp.frozen import Frozen
from exo_tp.node.leader.state import LeaderState


def keep_seconds(state: LeaderState, pinned: frozenset[str], default: float | None) -> float | None:
    """Seconds the served model stays loaded once idle (None: for ever)."""
    led = state.epoch
    if led is None:
        return None
    keep = state.keep_for
    if keep is None:
        keep = None if led.model in pinned else default
    return None if keep is None or keep < 0 else keep


def expires_at(state: LeaderState, pinned: frozenset[str], default: float | None) -> float | None:
    """Monotonic time the served model is let go at if nothing runs by then (None: never)."""
    keep = keep_seconds(state, pinned, default)
    led = state.epoch
    if keep is None or led is None or led.state != "ready":
        return None
    return state.busy_at + keep


def unload_due(
    state: LeaderState, pinned: frozenset[str], default: float | None, now: float
) -> str | None:
    """Why the served model goes now (None: it stays)."""
    at = expires_at(state, pinned, default)
    if at is None or state.cluster.in_flight or state.cluster.waiting or now < at:
        return None
    keep = keep_seconds(state, pinned, default)
    return f"the model was unloaded after {keep:g} s idle (keep_alive): a request loads it again"


class KeepAliveView(Frozen):
    """What /v1/cluster shows of the served model's keep-alive."""

    pinned: bool  # it stays unless a request says otherwise
    idle_seconds: float | None  # since its last request ended (None while one runs)
    expires_in: float | None  # until it is let go if nothing runs (None: never)


def keep_alive_view(
    state: LeaderState,
    key: str,
    pinned: frozenset[str],
    default: float | None,
    last_active: float,
    busy: bool,
    now: float,
) -> KeepAliveView:
    """``key``'s keep-alive now, counting the dispatcher's latest request (``last_active``),
    which the leader's next round will see."""
    fresh = state.model_copy(update={"busy_at": max(state.busy_at, last_active)})
    at = expires_at(fresh, pinned, default)
    return KeepAliveView(
        pinned=key in pinned,
        idle_seconds=None if busy else round(now - fresh.busy_at, 1),
        expires_in=None if at is None else max(0.0, at - now),
    )
