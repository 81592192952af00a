"""Several models resident at once, and replicas of the main one (on the leader).

The main group (its `Leader`) serves the model requests ask for, as a cluster with one model
does. A request naming another model that no group serves gets a group of its own, over every
node (groups share a node where its memory holds both), with its own leader, epochs and request
source: forming or re-planning one group never restarts another. Before it forms, the least
recently used unpinned models are let go until the new one fits the cluster's memory and at most
``--max-models`` are resident; a model that cannot fit even then is refused, naming the memory
it needs. ``--replicas N`` splits the nodes into N sets of about equal speed, and the main model
runs on each as its own group; the router (exo_tp.node.leader.router) sends each request to one.
An idle group whose keep-alive ended is let go like the main model (exo_tp.node.leader.keep_alive).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from exo_tp.node.cluster.control_messages import GroupView
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.formation import Leader
from exo_tp.node.leader.group_slots import (
    GroupSlot,
    Resident,
    group_id,
    to_evict,
)
from exo_tp.node.leader.replica_sets import replica_sets
from exo_tp.node.leader.router import Candidate, Router, choose
from exo_tp.plan.cluster import MEMORY_HEADROOM
from exo_tp.wire.ids import NodeId

log = logging.getLogger(__name__)

TICK_SECONDS = 0.5
PENDING: frozenset[NodeId] = frozenset()  # the main group's nodes until its replicas are placed


@dataclass(frozen=True)
class Loading:
    """The model's group forms now."""


@dataclass(frozen=True)
class TooLarge:
    """The model does not fit the cluster's memory even with every unpinned model let go."""

    needed: int  # its weights, bytes
    free: int  # what the cluster's memory holds beside the pinned models, bytes
    pinned: tuple[str, ...]  # the pinned models' names


Wanted = Loading | TooLarge

MakeLeader = Callable[[GroupSlot, Dispatcher, int], Leader]


def first_load(group: Leader) -> bool:
    """The group forms for the first time: its model is still loading (a group that served
    and re-plans is not: its requests wait for it, or fail with its reason)."""
    led = group.led
    never = group.state.previous is None and group.state.failures == 0
    return never and (led is None or led.state == "loading")


class ResidentGroups:
    def __init__(
        self,
        main: Leader,
        make_leader: MakeLeader,
        make_dispatcher: Callable[[], Dispatcher],
        max_models: int,
        replicas: int,
    ):
        self.main = main
        self._make_leader, self._make_dispatcher = make_leader, make_dispatcher
        self.max_models, self.replicas = max_models, replicas
        self.extras: dict[str, Leader] = {}  # group id -> its leader (not the main one)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._changing = asyncio.Lock()  # one group added or let go at a time
        self._background: set[asyncio.Task[None]] = set()  # loads a request started
        self.router = Router()
        # the main model's replicas: placed for this model and these nodes
        self._placed: tuple[str, frozenset[NodeId]] | None = None
        if replicas != 1:  # the main group waits for its nodes (no group over all first)
            main.slot = main.slot.model_copy(update={"nodes": PENDING})
        # every group as the latest tick saw it: what this node's status carries (a status
        # is built without reading the statuses, which offers and names do)
        self.views: tuple[GroupView, ...] = ()

    # ---- what is resident ------------------------------------------------------------------

    def leaders(self) -> list[Leader]:
        return [self.main, *self.extras.values()]

    def key_of(self, leader: Leader) -> str | None:
        """The model a group serves (or forms for)."""
        if leader.slot.key is not None:
            return leader.slot.key
        led = leader.led
        return led.model if led is not None and leader.state.unloaded is None else None

    def groups_of(self, key: str) -> list[Leader]:
        """Every group serving ``key`` (the main one first)."""
        return [g for g in self.leaders() if self.key_of(g) == key]

    def _bytes(self, key: str) -> int:
        offers = self.main.models.offers(drafts=False).get(key, [])
        return max((o.total_bytes for _, o in offers), default=0)

    def _memory(self) -> int:
        """Bytes the alive members' memory holds for models (the planner's headroom)."""
        alive = self.main.peers.alive()
        return int(sum(m.memory_available for m in alive) * MEMORY_HEADROOM)

    def resident(self) -> list[Resident]:
        """Every model held, its replicas together."""
        pinned = self.main.pinned()
        held: dict[str, Resident] = {}
        for leader in self.leaders():
            key = self.key_of(leader)
            if key is None:
                continue
            last = leader.dispatcher.last_active
            before = held.get(key)
            held[key] = Resident(
                key=key,
                pinned=key in pinned,
                last_active=max(last, before.last_active) if before else last,
                bytes=self._bytes(key) + (before.bytes if before else 0),
            )
        return list(held.values())

    def _ready(self, key: str) -> tuple[list[Leader], list[Leader]]:
        """``key``'s groups, and those of them that serve now."""
        groups = self.groups_of(key)
        return groups, [g for g in groups if g.led is not None and g.led.state == "ready"]

    def first(self, key: str) -> Leader | None:
        """A ready group of ``key`` (the main one first), else any (its dispatcher says why
        it does not serve)."""
        groups, ready = self._ready(key)
        return next(iter(ready or groups), None)

    def route(self, key: str, tokens: Sequence[int]) -> Leader | None:
        """The group that runs a request for ``key``: the router's pick among the ready ones
        (exo_tp.node.leader.router); where at most one is ready, `first`."""
        _, ready = self._ready(key)
        if len(ready) <= 1:
            return self.first(key)
        by_name = {f"{g.group}@{g.led.number}": g for g in ready if g.led is not None}
        chosen = choose(
            [
                Candidate(
                    group=name,
                    load=g.dispatcher.in_flight + g.dispatcher.waiting,
                    capacity=g.dispatcher.max_concurrency,
                    shared=self.router.shared(name, tokens),
                )
                for name, g in by_name.items()
            ]
        )
        self.router.ran(chosen.group, tokens)
        return by_name[chosen.group]

    # ---- a request names a model no group serves ----------------------------------------------

    def want(self, key: str, name: str, needed: int | None = None) -> Wanted:
        """Load ``key`` (``name`` as the request named it; ``needed``: its weights' bytes where
        the offers do not say yet) beside the models resident, letting the least recently used
        unpinned ones go first if it must; TooLarge if it cannot fit."""
        held = [r for r in self.resident() if r.key != key]
        needed = needed or self._bytes(key)
        memory = self._memory()
        free = memory - sum(r.bytes for r in held) if memory else needed
        evict = to_evict(held, needed, free, self.max_models)
        if evict is None:
            pinned = tuple(r for r in held if r.pinned)
            names = tuple(self._name(r.key) for r in pinned)
            return TooLarge(needed, memory - sum(r.bytes for r in pinned), names)
        self.background(self._load(key, name, evict))
        return Loading()

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` beside the request that asked for it (kept: a task nobody holds may be
        collected before it ends)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _name(self, key: str) -> str:
        return self.main.models.name_of(key, self.main.models.offers())

    async def _load(self, key: str, name: str, evict: tuple[str, ...]) -> None:
        try:
            await self._load_now(key, name, evict)
        except Exception:  # a bug: the next request for it tries again; the log says what
            log.exception("loading %s failed", name)

    async def _load_now(self, key: str, name: str, evict: tuple[str, ...]) -> None:
        async with self._changing:
            if self.groups_of(key):  # another request loaded it meanwhile
                return
            for old in evict:
                log.info("letting %s go for %s (least recently used)", self._name(old), name)
                await self._let_go(old, f"the model was unloaded to make room for '{name}'")
            if self.key_of(self.main) is None:  # the main group serves nothing: it takes it
                self.main.load(key, name)
                return
            await self._add(GroupSlot(id=group_id(key), key=key))

    async def _add(self, slot: GroupSlot) -> None:
        dispatcher = self._make_dispatcher()
        port = await dispatcher.start()
        leader = self._make_leader(slot, dispatcher, port)
        self.extras[slot.id] = leader
        self._tasks[slot.id] = asyncio.create_task(leader.run_forever(), name=f"group {slot.id}")
        log.info("group %s: serving %s", slot.id, self._name(slot.key or ""))

    async def _let_go(self, key: str, reason: str) -> None:
        """Let every group of ``key`` go (the main one stays, serving nothing)."""
        for leader in self.groups_of(key):
            if leader is self.main:
                await leader.unload(reason)
            else:
                await self._remove(leader.group, reason)

    async def _remove(self, group: str, reason: str) -> None:
        leader, task = self.extras.pop(group, None), self._tasks.pop(group, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if leader is not None:
            await leader.unload(reason)
            leader.dispatcher.stop()

    async def unload(self, key: str, reason: str) -> None:
        async with self._changing:
            await self._let_go(key, reason)

    # ---- the loop: idle groups, replicas --------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                async with self._changing:
                    await self._tick()
            except Exception:  # a bug: the groups must not stop being kept over it
                log.exception("resident groups round failed")

    def views_now(self) -> tuple[GroupView, ...]:
        """Every group with an epoch: its model, ranks, load, pinned, idle time, keep-alive."""
        models = self.main.models
        offers, pinned, now = models.offers(), self.main.pinned(), time.monotonic()
        views = []
        for leader in self.leaders():
            led, key = leader.led, self.key_of(leader)
            if led is None or key is None:
                continue
            d = leader.dispatcher
            busy = bool(d.in_flight or d.waiting)
            views.append(
                GroupView(
                    group=leader.group,
                    model=models.name_of(key, offers),
                    key=key,
                    replica=leader.slot.replica,
                    epoch=led.number,
                    state=led.state,
                    ranks=led.nodes,
                    pinned=key in pinned,
                    in_flight=d.in_flight,
                    waiting=d.waiting,
                    idle_seconds=None if busy else round(now - d.last_active, 1),
                    expires_in=leader.keep_alive_view(key).expires_in,
                )
            )
        return tuple(views)

    async def _tick(self) -> None:
        self.views = self.views_now() if self.main.leads() else ()
        if not self.main.leads() or self.main.paused is not None:
            for group in list(self.extras):  # another node leads, or a job holds the cluster
                await self._remove(group, "this node no longer leads the cluster")
            return
        for group, leader in list(self.extras.items()):
            if leader.state.unloaded is not None:  # its keep-alive ended, or a client asked
                await self._remove(group, leader.state.unloaded)
        await self._replicas()

    async def _replicas(self) -> None:
        """Keep the main model's replicas over disjoint sets of nodes (exo_tp.node.leader.
        replica_sets), placed once the membership settled and before the main group forms.
        The sets are chosen again only when the model changes or a node joins that none
        holds; a node that leaves shrinks its replica, which re-plans alone."""
        if self.replicas == 1:
            return
        main, state, now = self.main, self.main.state, time.monotonic()
        nodes = [n for n in state.cluster.ids() if state.quarantine.get(n, 0.0) <= now]
        key = self.key_of(main) or main.models.target(nodes, None, state.wanted)
        if self._placed is not None and key != self._placed[0]:
            self._placed = None
            main.slot = main.slot.model_copy(update={"nodes": PENDING})
            for group in [g for g, leader in self.extras.items() if leader.slot.replica]:
                await self._remove(group, "the main model changed")
        config = main.config
        settled = 0 < config.members <= len(nodes) or now - state.cluster.joined_at >= config.settle
        if key is None or not nodes or not settled:
            return
        if self._placed and self._placed[0] == key and set(nodes) <= self._placed[1]:
            return
        sets = await replica_sets(self.main, key, nodes, self.replicas)
        self._placed = (key, frozenset(nodes))
        log.info("replicas of %s over %s", self._name(key), [sorted(s) for s in sets])
        self.main.slot = self.main.slot.model_copy(
            update={"nodes": sets[0] if len(sets) > 1 else None}
        )
        for group in [g for g, leader in self.extras.items() if leader.slot.replica]:
            await self._remove(group, "the replicas are placed again")
        for replica, nodes_of in enumerate(sets[1:], start=1):
            slot = GroupSlot(id=group_id(key, replica), key=key, nodes=nodes_of, replica=replica)
            await self._add(slot)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for leader in self.extras.values():
            leader.dispatcher.stop()
