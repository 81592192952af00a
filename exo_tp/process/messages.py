"""What a supervised child tells its supervisor, over the framing of `exo_tp.transport.channel`.

The supervisor understands five kinds of message, named here as base classes: a child's own
link (`exo_tp.wire.runtime.RankEvent` for a serving rank) subclasses them to add what its
owner needs (a rank's links and memory), and the supervisor reads them by their base class. A
child with nothing to add uses the plain union `CHILD_EVENTS`. Nothing flows the other way: the
supervisor closing the link means "stop".
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from exo_tp.frozen import Frozen

# ---- what the supervisor reads (by base class) ------------------------------------------


class ChildHello(Frozen):
    """The first message: which child this is (the token the supervisor gave it)."""

    child: str


class ChildPhase(Frozen):
    """What a child that is not ready yet is doing (e.g. "loading")."""

    phase: str


class ChildReady(Frozen):
    """The child does what it was started for (a rank serves, a node answers its API)."""


class ChildHeartbeat(Frozen):
    """Sent every second from a thread by a child with a stall timeout: a frozen process sends
    none; one stuck waiting keeps sending them with ``steps`` no longer growing while ``busy``."""

    steps: int = 0
    busy: bool = False


class ChildFailed(Frozen):
    """Why the child is about to exit unsuccessfully, in one readable line."""

    message: str


class ChildResult(Frozen):
    """What a child that runs to completion found (its owner's subclass says what)."""


# ---- the plain union: children with nothing to add ---------------------------------------


class Hello(ChildHello):
    kind: Literal["hello"] = "hello"


class Ready(ChildReady):
    kind: Literal["ready"] = "ready"


class Failed(ChildFailed):
    kind: Literal["failed"] = "failed"


PlainEvent = Annotated[Hello | Ready | Failed, Field(discriminator="kind")]
CHILD_EVENTS: TypeAdapter[Hello | Ready | Failed] = TypeAdapter(PlainEvent)
