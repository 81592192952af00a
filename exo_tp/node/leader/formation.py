"""Leadership and cluster formation. Every node runs the same loop; it acts only while it leads
(the alive member with the smallest id).

Formation:
1. the eligible membership (alive, not quarantined) has been stable for ``settle`` seconds and
   every member's last status names this node as leader (so two nodes never assign ranks at
   once);
2. choose the model (exo_tp.node.leader.cluster_model: one a request asked for through
   `ModelRequests`, the one served, a default) and prepare it here (config and tokenizer,
   fetched from a holder if this node has no files);
3. gather the facts (members' share weights, what each holds of the model's weights) and place
   the model once (exo_tp.node.leader.placement: plan, rank order, transfers, prediction);
4. ask every chosen member for fresh ports, send each its Assignment of a new, higher epoch and
   its weight order; each node fetches its shard if it must, then replaces its worker;
5. once every worker is ready and the conductor joined the dispatcher, requests flow.
A member that stops answering, a worker that exits or stalls, the conductor's link dropping, or a
membership change, or a request for another model starts a new epoch; meanwhile requests get a
503. Failing epochs back off (1, 2, 4 ... 30 s). A member whose worker froze is left out for a
while (quarantine). The load timeout counts from the last fetch still moving bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from exo_tp.errors import ExoTpError, PlanError
from exo_tp.node.cluster.config import NodeConfig
from exo_tp.node.cluster.control import ControlClient, ControlRefused
from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.cluster.peers import Peers
from exo_tp.node.leader.assignments import Where, assignments_of, kv_tokens
from exo_tp.node.leader.backend_choice import BackendChoice, choose_backend
from exo_tp.node.leader.cluster_model import ClusterModel
from exo_tp.node.leader.decide import LOAD_TIMEOUT, next_step, round_of, track
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.epochs import EpochNumbers
from exo_tp.node.leader.group_slots import MAIN_SLOT, GroupSlot
from exo_tp.node.leader.keep_alive import KeepAliveView, keep_alive_view, unload_due
from exo_tp.node.leader.members import gather_members, less_other_groups
from exo_tp.node.leader.model_requests import ModelRequests
from exo_tp.node.leader.observe import client_reason, cluster_seen
from exo_tp.node.leader.placement import Members, Placement, place, serving_draft
from exo_tp.node.leader.rebalance import LiveBalance
from exo_tp.node.leader.rebalance_round import consider_rebalance
from exo_tp.node.leader.state import (
    AssignmentsSent,
    ConductorLost,
    Detach,
    EpochFailed,
    EpochPlanned,
    EpochReady,
    EpochStarted,
    ForgetBalance,
    KeepAliveAsked,
    LeaderEvent,
    LeadershipLost,
    LeaderState,
    LedEpoch,
    LetGo,
    ModelAsked,
    Observed,
    Paused,
    Release,
    Replanning,
    Resume,
    Resumed,
    Unloaded,
    effects,
    eligible,
    reduce,
)
from exo_tp.plan import ModelSpec
from exo_tp.plan.kv_width import kv_quantization_problem
from exo_tp.plan.rebalance import RebalancePolicy
from exo_tp.plan.render import describe
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.profiles import ProfileSummary

log = logging.getLogger(__name__)


class Leader:
    def __init__(
        self,
        config: NodeConfig,
        models: ClusterModel,
        peers: Peers,
        control: ControlClient,
        dispatcher: Dispatcher,
        requests_port: int,
        epochs: EpochNumbers,
        requests: ModelRequests,
        group: GroupSlot = MAIN_SLOT,
    ):
        self.config, self.models, self.peers = config, models, peers
        self._requests = requests
        self._control, self._dispatcher = control, dispatcher
        self._requests_port = requests_port
        self._epochs = epochs
        # Which group this leader forms: the main one serves the model requests ask for; any
        # other serves its one model (another resident model, or a replica) over its nodes.
        self.slot = group
        # Everything the leader decides from, changed only by `_apply` (exo_tp.node.leader.state)
        self.state = LeaderState()
        dispatcher.on_conductor_lost = self._conductor_lost
        # One round of the loop (which may form an epoch across many awaits) or one pause at a
        # time: a pause that let go of the epoch mid-round would leave the round forming over
        # ranks the job is about to take.
        self._round = asyncio.Lock()
        self.balance = LiveBalance(
            RebalancePolicy(threshold=config.rebalance_threshold), config.rebalance
        )

    @property
    def group(self) -> str:
        return self.slot.id

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def me(self) -> NodeId:
        return self.config.node_id

    def leads(self) -> bool:
        return self.peers.leader_id() == self.me

    @property
    def led(self) -> LedEpoch | None:
        """The epoch this node formed (and leads), if any."""
        return self.state.epoch

    @property
    def paused(self) -> str | None:
        """Why no epoch forms: a fine-tuning job holds the cluster (exo_tp.node.finetune.jobs)."""
        return self.state.paused

    def forming(self) -> bool:
        """This node leads an epoch whose workers are not all ready yet."""
        return self.leads() and self.state.forming()

    # ---- the one place where state changes and their effects happen ------------------------

    def _apply(self, *events: LeaderEvent) -> list[Release]:
        """Apply ``events`` in order and carry out what each change asks of the node; the
        releases (a network call each) are returned for the caller to await."""
        releases: list[Release] = []
        for event in events:
            before, self.state = self.state, reduce(self.state, event)
            led = self.state.epoch
            if isinstance(event, EpochFailed) and led is not None and before.epoch is not led:
                log.warning("epoch %d failed: %s", led.number, event.reason)
            for effect in effects(before, self.state, event):
                if isinstance(effect, Detach):
                    self._dispatcher.detach(effect.reason)
                elif isinstance(effect, Replanning):
                    self._dispatcher.detach("the cluster is re-planning")
                    self._dispatcher.expected_epoch = effect.epoch
                elif isinstance(effect, Resume):
                    self._dispatcher.resume()
                elif isinstance(effect, ForgetBalance):
                    self.balance.draining_since = None
                else:
                    releases.append(effect)
        return releases

    async def _release_all(self, releases: list[Release]) -> None:
        peers = [(self.peers.get(n), r.epoch) for r in releases for n in r.nodes]
        await asyncio.gather(*(self._release(p, epoch) for p, epoch in peers if p))

    # ---- a fine-tuning job holds the cluster -----------------------------------------------

    async def pause(self, reason: str) -> None:
        """Stop serving and let every serving rank go; no epoch forms until `resume`. Waits
        for a formation round in progress to end first (it then releases that epoch)."""
        self._apply(Paused(reason=reason))
        async with self._round:
            await self._release_all(self._apply(LetGo(reason=reason)))

    def resume(self) -> None:
        """Serve again: the next round forms a new epoch."""
        self._apply(Resumed())

    def load(self, key: str, name: str) -> None:
        """Serve ``key`` next (the main group: a request asked for it)."""
        self._requests.load(key, name)

    # ---- keep-alive: a model let go when idle (exo_tp.node.leader.keep_alive) ---------------

    def pinned(self) -> frozenset[str]:
        """The models that stay loaded unless a request says otherwise: this node's --model
        ones and the one the cluster serves unasked."""
        keys = {self.models.key_of(name) for name in self.config.models}
        if self.slot.key is None:
            keys.add(self.models.target(self.state.cluster.ids(), None, None))
        return frozenset(k for k in keys if k is not None)

    def keep_alive(self, seconds: float) -> None:
        """A request asked the served model to stay loaded ``seconds`` once idle."""
        self._apply(KeepAliveAsked(seconds=seconds, at=time.monotonic()))

    def keep_alive_view(self, key: str) -> KeepAliveView:
        """``key``'s keep-alive as /v1/cluster and /api/ps show it."""
        d, now = self._dispatcher, time.monotonic()
        busy = bool(d.in_flight or d.waiting)
        default = self.config.keep_alive
        return keep_alive_view(self.state, key, self.pinned(), default, d.last_active, busy, now)

    async def unload(self, reason: str) -> None:
        """Let the served model go now; no epoch forms until a request names a model."""
        async with self._round:
            await self._release_all(self._apply(Unloaded(reason=reason)))

    # ---- the loop --------------------------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                async with self._round:
                    await self._lead_once()
                continue
            except (
                aiohttp.ClientError,
                TimeoutError,
                ControlRefused,
                OSError,
                ExoTpError,
            ) as error:
                log.warning("formation round failed: %s", error)
                reason = client_reason(error, self.peers.alive())
            except Exception as error:  # a bug: the cluster must not stop forming over it
                log.exception("formation round failed")
                reason = f"{type(error).__name__}: {error}"
            self._fail("formation failed: " + reason)
            await asyncio.sleep(1.0)

    def _observe(self) -> None:
        """The round's view of the cluster into the state: the membership and statuses from
        the peers' poll (this group's workers), the load from the dispatcher."""
        seen = cluster_seen(self.peers, self._dispatcher, self.group)
        self._apply(Observed(seen=seen, at=time.monotonic()))

    async def _lead_once(self) -> None:
        if not self.leads():
            self._apply(LeadershipLost())
            return
        if self.paused is not None:
            return
        if self.slot.key is None and (asked := self._requests.latest()) is not None:
            self._apply(ModelAsked(key=asked.key, adapter_job=asked.adapter_job))
        self._observe()
        now, state = time.monotonic(), self.state
        if (why := unload_due(state, self.pinned(), self.config.keep_alive, now)) is not None:
            log.info("%s", why)
            await self._release_all(self._apply(Unloaded(reason=why)))
            return
        if state.unloaded is not None:  # until a request names a model
            self._dispatcher.detach(state.unloaded)
            return
        nodes = eligible(state, state.cluster.ids(), now)
        led, wanted = state.epoch, state.wanted
        model = self.slot.key or self.models.target(nodes, led.model if led else None, wanted)
        adapter = state.wanted_adapter if model == wanted else None
        config = self.config
        allowed = self.slot.nodes
        seen = round_of(state, self.me, model, adapter, config.settle, config.members, now, allowed)
        nodes = seen.nodes
        step = next_step(state, seen, now)
        members = [m for m in state.cluster.members if m.node_id in nodes]
        if step == "track" and led is not None:
            self._track(led)
            if self.state.epoch is not None and self.state.epoch.state == "ready" and model:
                await self._rebalance(self.state.epoch, members, model)
        elif step == "no_model":
            self._dispatcher.detach("no member has a model: start a node with --model")
        elif step == "form" and model is not None:
            if seen.unmeasured:  # links_ready: waited long enough for them
                log.warning(
                    "links not measured after %.0f s, planned as the default link: %s",
                    now - state.cluster.changed_at - config.settle,
                    ", ".join(f"{a}-{b}" for a, b in seen.unmeasured),
                )
            await self._form(members, model, seen.adapter_job)

    def _fail(self, reason: str) -> None:
        self._apply(EpochFailed(reason=reason, at=time.monotonic()))

    def _conductor_lost(self, epoch: Epoch) -> None:
        """The conductor's link dropped: a rank died or stalled. Its node's status names it
        within a poll or two (`_track` fails the epoch then, naming node, rank and what
        happened); only if none does within CONDUCTOR_GRACE the conductor itself is named."""
        self._apply(ConductorLost(epoch=epoch, at=time.monotonic()))

    def _track(self, led: LedEpoch) -> None:
        """Follow an epoch's workers (exo_tp.node.leader.decide.track)."""
        statuses: dict[NodeId, NodeStatus | None] = {
            n: s.for_group(self.group) if (s := self.peers.status(n)) else None for n in led.nodes
        }
        now = time.monotonic()
        tracked = track(led, statuses, now, self.config.stall_timeout)
        self._apply(*tracked.events)
        if tracked.ready and self._dispatcher.attach(led.number):
            self._apply(EpochReady())
            log.info("epoch %d ready: %d ranks", led.number, len(led.nodes))
        elif tracked.overdue:
            self._fail(f"workers not ready after {LOAD_TIMEOUT:.0f}s")

    # ---- planning and forming --------------------------------------------------------------

    def members_for(
        self, spec: ModelSpec, eligible: list[Announcement], own_profile: ProfileSummary | None
    ) -> Members:
        """The eligible members as placement sees them (exo_tp.node.leader.members)."""
        return gather_members(
            spec, eligible, own_profile, self.peers, self.balance, self.config.stages
        )

    def _next_number(self) -> Epoch:
        """Higher than any epoch this node, any group it leads or a peer has seen."""
        seen = max((s.epoch for s in self.peers.statuses.values()), default=0)
        return self._epochs.claim(max(self.led.number if self.led else 0, seen))

    async def _form(
        self, eligible: list[Announcement], key: str, adapter_job: str | None = None
    ) -> None:
        number = self._next_number()
        eligible = less_other_groups(eligible, self.peers, self.group)
        eligible_ids = tuple(sorted(m.node_id for m in eligible))
        now = time.monotonic()
        started = EpochStarted(
            number=number, members=eligible_ids, model=key, adapter_job=adapter_job, at=now
        )
        self._apply(started)
        try:
            model = await self.models.prepare(key, eligible_ids, self.slot.key is None)
            me = self.peers.status(self.me)
            facts = self.members_for(model.spec, eligible, me.profile if me else None)
            holdings = await self.models.holdings(model, eligible)
            queue = self._dispatcher.in_flight + self._dispatcher.waiting
            objective = self.config.serving.objective
            draft = serving_draft(self.config.serving)
            placement = await asyncio.to_thread(
                place, model.spec, facts, holdings, objective, queue, draft
            )
        except (ExoTpError, aiohttp.ClientError, TimeoutError) as error:
            self._fail(f"cannot prepare {self.models.name_of(key, self.models.offers())}: {error}")
            return
        serving = self.config.serving
        problem = kv_quantization_problem(model.spec, serving.kv_bits, serving.kv_group_size)
        if problem:  # before any rank loads: the epoch fails with the reason, readable
            self._fail(problem)
            return
        for note in placement.notes:
            log.info("%s", note)
        orders = self.models.orders(model, placement)
        nodes = placement.rank_order
        self._apply(EpochPlanned(nodes=nodes, plan=placement.plan, prediction=placement.prediction))
        self._dispatcher.kv_tokens = kv_tokens(placement, eligible, self.config)
        statuses = {n: self.peers.status(n) for n in nodes}
        try:
            backend = choose_backend(
                self.config.backend,
                nodes,
                {n: s.backends if s else ("ring",) for n, s in statuses.items()},
                {n: s.rdma if s else {} for n, s in statuses.items()},
            )
        except PlanError as error:
            self._fail(str(error))
            return
        log.info(
            "forming epoch %d over %s: %s; %s",
            number,
            list(nodes),
            describe(placement.plan),
            backend.reason,
        )
        by_id = {m.node_id: m for m in eligible}
        members = [by_id[n] for n in nodes]
        conductor = members[placement.plan.stages[-1].ranks[0]]
        try:
            draft_order = (
                await self.models.draft_order(serving.draft_model, conductor)
                if serving.draft_model is not None and serving.loads_draft()
                else None
            )
        except (ExoTpError, aiohttp.ClientError, TimeoutError) as error:
            self._fail(f"cannot send the draft model {serving.draft_model}: {error}")
            return
        assignments = await self._assignments(number, model.name, placement, members, backend)
        for member, assignment in zip(members, assignments, strict=True):
            await self._control.assign(
                member,
                assignment,
                self.me,
                orders[member.node_id],
                adapter_job,
                draft_order if member is conductor else None,
                self.group,
            )
        await self._release_all(self._apply(AssignmentsSent(at=time.monotonic())))

    async def _assignments(
        self,
        number: Epoch,
        model: str,
        placement: Placement,
        members: list[Announcement],
        backend: BackendChoice,
    ) -> list[Assignment]:
        """Each member's Assignment of epoch ``number`` (with fresh ports from each)."""
        ports = await asyncio.gather(*(self._control.ports(m, number) for m in members))
        where = Where(
            members=tuple(members),
            ports=tuple(ports),
            requests_at=f"{self.config.host}:{self._requests_port}",
        )
        return assignments_of(number, model, placement, where, backend, self.config)

    async def _rebalance(self, led: LedEpoch, members: list[Announcement], model: str) -> None:
        """Follow the ranks' live speeds; when they drifted for long enough, hold new requests,
        let those in flight finish, and re-plan the shares (exo_tp.node.leader.rebalance)."""
        if self.balance.draining_since is None:
            if consider_rebalance(self, led, members):
                self._dispatcher.hold()
            return
        if self.balance.drained(self._dispatcher.in_flight):
            await self._form(members, model, led.adapter_job)

    @property
    def queue(self) -> int:
        """Requests running or waiting now."""
        return self._dispatcher.in_flight + self._dispatcher.waiting

    async def _release(self, peer: Announcement, epoch: Epoch) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ControlRefused, OSError):
            await self._control.release(peer, epoch, self.group)
