"""What a supervisor reports about a child to its owner (in-process, from its threads)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.process.messages import ChildHeartbeat, ChildReady, ChildResult

Stall = Literal["frozen", "stuck"]
# exit: a non-zero exit code; signal: killed by one; error: the child reported why (then
# exited); stall: it runs but makes no progress (the owner decides whether to stop it)
FailReason = Literal["exit", "signal", "error", "stall"]


class Connected(Frozen):
    """The child reached its supervisor (its imports are done)."""

    kind: Literal["connected"] = "connected"
    child: str


class PhaseChanged(Frozen):
    kind: Literal["phase"] = "phase"
    child: str
    phase: str


class Ready(Frozen):
    kind: Literal["ready"] = "ready"
    child: str
    message: ChildReady  # the child's own, with what its link adds


class Heartbeat(Frozen):
    kind: Literal["heartbeat"] = "heartbeat"
    child: str
    message: ChildHeartbeat


class Finished(Frozen):
    """The child's result (it exits next)."""

    kind: Literal["result"] = "result"
    child: str
    message: ChildResult


class Failed(Frozen):
    kind: Literal["failed"] = "failed"
    child: str
    reason: FailReason
    message: str  # one readable line: "exited with code 3", "failed: <the child's words>"
    code: int | None = None  # exit code (exit, error)
    signal: int | None = None  # signal number (signal)
    stall: Stall | None = None  # (stall)


class Exited(Frozen):
    """The child exited with code 0 and reported no failure."""

    kind: Literal["exited"] = "exited"
    child: str


ProcessEvent = Annotated[
    Connected | PhaseChanged | Ready | Heartbeat | Finished | Failed | Exited,
    Field(discriminator="kind"),
]
