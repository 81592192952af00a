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
from collections.abc import Callable

import aiohttp

from exo_tp.errors import ExoTpError, PlanError
from exo_tp.node.config import NodeConfig
from exo_tp.node.control import ControlClient, ControlRefused
from exo_tp.node.control_messages import NodeStatus
from exo_tp.node.leader.assignments import Where, assignments_of
from exo_tp.node.leader.backend_choice import BackendChoice, choose_backend
from exo_tp.node.leader.cluster_model import ClusterModel
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.led_epoch import LedEpoch, rank_name
from exo_tp.node.leader.links import LINK_WAIT, measured_links, unmeasured_pairs
from exo_tp.node.leader.members import gather_members, node_weights
from exo_tp.node.leader.model_requests import ModelRequests
from exo_tp.node.leader.placement import Members, Placement, place, plan_of, serving_draft
from exo_tp.node.leader.rebalance import LiveBalance
from exo_tp.node.peers import POLL_SECONDS, Peers
from exo_tp.plan import ModelSpec
from exo_tp.plan.cluster import MEMORY_HEADROOM
from exo_tp.plan.kv_width import kv_quantization_problem, kv_token_capacity
from exo_tp.plan.rebalance import RebalancePolicy, replan_gain
from exo_tp.plan.render import describe
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.assignment import DTYPE_BYTES, Assignment
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.profiles import ProfileSummary

log = logging.getLogger(__name__)

LOAD_TIMEOUT = 240.0
QUARANTINE_MIN = 60.0
CONDUCTOR_GRACE = 4.0  # seconds to learn which rank broke the conductor's link, from statuses


class Leader:
    def __init__(
        self,
        config: NodeConfig,
        models: ClusterModel,
        peers: Peers,
        control: ControlClient,
        dispatcher: Dispatcher,
        requests_port: int,
        highest_epoch: Callable[[], int],
        requests: ModelRequests,
    ):
        self.config, self.models, self.peers = config, models, peers
        self._requests = requests
        self._wanted: str | None = None  # the model key a request asked for last
        self._wanted_adapter: str | None = None  # and the fine-tuning job's adapter it named
        self._control, self._dispatcher = control, dispatcher
        self._requests_port = requests_port
        self._highest_epoch = highest_epoch
        self.led: LedEpoch | None = None
        self._retry_at = 0.0  # no new epoch before this (after failures)
        self._failures = 0
        self._quarantine: dict[NodeId, float] = {}  # node id -> until (monotonic)
        dispatcher.on_conductor_lost = self._conductor_lost
        # A fine-tuning job holds the cluster (exo_tp.node.finetune.jobs): no epoch forms.
        self.paused: str | None = None
        # One round of the loop (which may form an epoch across many awaits) or one pause at a
        # time: a pause that let go of the epoch mid-round would leave the round forming over
        # ranks the job is about to take.
        self._round = asyncio.Lock()
        self.balance = LiveBalance(
            RebalancePolicy(threshold=config.rebalance_threshold), config.rebalance
        )

    @property
    def me(self) -> NodeId:
        return self.config.node_id

    def leads(self) -> bool:
        return self.peers.leader_id() == self.me

    def forming(self) -> bool:
        """This node leads an epoch whose workers are not all ready yet."""
        led = self.led
        return self.leads() and led is not None and led.state == "loading"

    # ---- a fine-tuning job holds the cluster -----------------------------------------------

    async def pause(self, reason: str) -> None:
        """Stop serving and let every serving rank go; no epoch forms until `resume`. Waits
        for a formation round in progress to end first (it then releases that epoch)."""
        self.paused = reason
        async with self._round:
            self._dispatcher.detach(reason)
            self._dispatcher.resume()
            led, self.led = self.led, None
            if led is not None:
                peers = [self.peers.get(n) for n in set(led.nodes)]
                await asyncio.gather(*(self._release(p, led.number) for p in peers if p))

    def resume(self) -> None:
        """Serve again: the next round forms a new epoch."""
        self.paused = None

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
                reason = self._client_reason(error)
            except Exception as error:  # a bug: the cluster must not stop forming over it
                log.exception("formation round failed")
                reason = f"{type(error).__name__}: {error}"
            self._fail("formation failed: " + reason)
            await asyncio.sleep(1.0)

    def _client_reason(self, error: BaseException) -> str:
        """What clients are told of a failed round: a peer that did not answer is named by its
        node id, never by the internal address in the error (the log keeps that)."""
        if isinstance(error, aiohttp.ClientConnectorError):
            for member in self.peers.alive():
                if (member.host, member.control_port) == (error.host, error.port):
                    return f"node {member.node_id} did not answer"
            return "a member did not answer"
        if isinstance(error, aiohttp.ClientError | TimeoutError | OSError):
            return f"a member did not answer ({type(error).__name__})"
        return str(error) or type(error).__name__

    def _eligible(self) -> list[Announcement]:
        now = time.monotonic()
        self._quarantine = {n: t for n, t in self._quarantine.items() if t > now}
        return [m for m in self.peers.alive() if m.node_id not in self._quarantine]

    async def _lead_once(self) -> None:
        if not self.leads():
            if self.led is not None:
                self._dispatcher.detach("leadership moved")
                self.led = None
            return
        if self.paused is not None:
            return
        if (asked := self._requests.latest()) is not None:
            self._wanted, self._wanted_adapter = asked.key, asked.adapter_job
        members = self._eligible()
        nodes = tuple(sorted(m.node_id for m in members))
        led = self.led
        model = self.models.target(nodes, led.model if led else None, self._wanted)
        adapter = self._wanted_adapter if model == self._wanted else None
        same = (
            led is not None
            and led.members == nodes
            and led.model == model
            and led.adapter_job == adapter
        )
        if same and led.state != "failed":
            self._track(led)
            if led.state == "ready" and model is not None:
                await self._rebalance(led, members, model)
            return
        complete = 0 < self.config.members <= len(nodes)
        if not complete and time.monotonic() - self.peers.joined_at < self.config.settle:
            return
        if same and time.monotonic() < self._retry_at:
            return
        if not members or not self._agreed(members):
            return
        if model is None:
            self._dispatcher.detach("no member has a model: start a node with --model")
            return
        if not self._links_ready(nodes):
            return
        await self._form(members, model, adapter)

    def _links_ready(self, nodes: tuple[NodeId, ...]) -> bool:
        """Every pair's link measured (the members probe each other as they join), or
        LINK_WAIT past the settle: the pairs still missing are then planned with the default
        link, and the log says which."""
        missing = unmeasured_pairs(measured_links(self.peers, nodes), nodes)
        if not missing:
            return True
        waited = time.monotonic() - self.peers.changed_at - self.config.settle
        if waited < LINK_WAIT:
            return False
        log.warning(
            "links not measured after %.0f s, planned as the default link: %s",
            waited,
            ", ".join(f"{a}-{b}" for a, b in missing),
        )
        return True

    def _agreed(self, members: list[Announcement]) -> bool:
        for member in members:
            status = self.peers.status(member.node_id, max_age=3 * POLL_SECONDS)
            if status is None or status.leader != self.me:
                return False
        return True

    def _fail(self, reason: str) -> None:
        led = self.led
        if led is not None and led.state != "failed":
            log.warning("epoch %d failed: %s", led.number, reason)
            led.state, led.reason = "failed", reason
            # back off 1, 2, 4 ... 30 s so a persistent problem does not spin
            self._retry_at = time.monotonic() + min(30.0, 2.0**self._failures)
            self._failures += 1
        self._dispatcher.detach(reason)
        self.balance.draining_since = None
        self._dispatcher.resume()  # requests held for a planned re-plan get the 503 now

    def _conductor_lost(self, epoch: Epoch) -> None:
        """The conductor's link dropped: a rank died or stalled. Its node's status names it
        within a poll or two (`_track` fails the epoch then, naming node, rank and what
        happened); only if none does within CONDUCTOR_GRACE the conductor itself is named."""
        led = self.led
        if led is not None and led.number == epoch and led.conductor_lost is None:
            led.conductor_lost = time.monotonic()

    def _track(self, led: LedEpoch) -> None:
        """Follow an epoch's workers: ready once all are, failed when one exits or stalls, or
        when a node could not fetch its shard."""
        statuses: dict[NodeId, NodeStatus | None] = {n: self.peers.status(n) for n in led.nodes}
        failures: list[tuple[int, str]] = []  # (how telling, reason): the culprit first
        for node_id, status in statuses.items():
            fetch = status.weights.fetch if status else None
            if fetch is not None and fetch.epoch == led.number:
                if fetch.state == "failed":
                    self._fail(f"{node_id} could not fetch its weights: {fetch.error}")
                    return
                if fetch.state == "fetching":  # the load timeout starts once bytes stop moving
                    led.started = time.monotonic()
            if status is None or status.worker_epoch != led.number:
                continue
            who = rank_name(led, node_id)
            if status.worker_stalled is not None:
                if status.worker_stalled == "frozen":  # re-plan without it for a while
                    self._quarantine[node_id] = time.monotonic() + max(
                        QUARANTINE_MIN, 4 * self.config.stall_timeout
                    )
                telling = 2 if status.worker_stalled == "frozen" else 0
                failures.append((telling, f"{who} {status.worker_error}"))
            elif status.worker_state == "exited":
                error = status.worker_error or "stopped"
                # a killed rank is the cause; its peers then exit on the broken link
                telling = 3 if "signal" in error else 1
                failures.append((telling, f"{who} stopped: {error}"))
        if failures:
            telling, reason = max(failures)
            # A rank that exited on a broken link is a symptom: the rank that broke it (killed,
            # frozen) usually reports a poll later, from another node. Name the cause when it
            # comes; fall back to the symptom after the grace.
            if telling == 1 and len(failures) < len(statuses):
                if led.symptom_seen is None:
                    led.symptom_seen = time.monotonic()
                if time.monotonic() - led.symptom_seen < CONDUCTOR_GRACE:
                    return
            self._fail(reason)
            return
        lost = led.conductor_lost
        if lost is not None and time.monotonic() - lost > CONDUCTOR_GRACE:
            conductor = led.conductor_rank()
            self._fail(
                f"the conductor ({rank_name(led, led.nodes[conductor])}, the last stage's "
                f"first rank) lost its link to the leader; no rank reported why within "
                f"{CONDUCTOR_GRACE:g} s"
                if conductor is not None
                else "the conductor lost its link to the leader"
            )
            return
        if led.state != "loading":
            return
        ready = all(
            s is not None and s.worker_epoch == led.number and s.worker_state == "ready"
            for s in statuses.values()
        )
        if ready and self._dispatcher.attach(led.number):
            led.state, self._failures = "ready", 0
            self._dispatcher.resume()  # requests held during a planned re-plan go now
            log.info("epoch %d ready: %d ranks", led.number, len(led.nodes))
        elif time.monotonic() - led.started > LOAD_TIMEOUT:
            self._fail(f"workers not ready after {LOAD_TIMEOUT:.0f}s")

    # ---- planning and forming --------------------------------------------------------------

    def members_for(
        self, spec: ModelSpec, eligible: list[Announcement], own_profile: ProfileSummary | None
    ) -> Members:
        """The eligible members as placement sees them (exo_tp.node.leader.members)."""
        return gather_members(
            spec, eligible, own_profile, self.peers, self.balance, self.config.stages
        )

    def _next_number(self) -> int:
        """Higher than any epoch this node or a peer has seen."""
        seen = max((s.epoch for s in self.peers.statuses.values()), default=0)
        return max(self._highest_epoch(), self.led.number if self.led else 0, seen) + 1

    async def _form(
        self, eligible: list[Announcement], key: str, adapter_job: str | None = None
    ) -> None:
        number = self._next_number()
        previous = self.led
        eligible_ids = tuple(sorted(m.node_id for m in eligible))
        self.led = LedEpoch(
            number=number,
            nodes=(),
            plan=None,
            members=eligible_ids,
            model=key,
            adapter_job=adapter_job,
        )
        self._dispatcher.detach("the cluster is re-planning")
        self._dispatcher.expected_epoch = number
        try:
            model = await self.models.prepare(key, eligible_ids)
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
        self.led.nodes, self.led.plan = nodes, placement.plan
        self.led.prediction = placement.prediction
        self._dispatcher.kv_tokens = self._kv_tokens(placement, eligible)
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
            draft = (
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
                draft if member is conductor else None,
            )
        self.led.started = time.monotonic()
        if previous is not None:  # members dropped from the cluster let their workers go
            dropped = [self.peers.get(n) for n in set(previous.nodes) - set(nodes)]
            await asyncio.gather(*(self._release(p, number - 1) for p in dropped if p))

    def _kv_tokens(self, placement: Placement, eligible: list[Announcement]) -> int | None:
        """Tokens of context the plan's KV memory holds (exo_tp.plan.kv_width), all streams
        together, from each rank's node's available memory (as the planner counts it) less the
        recurrent state of a full batch."""
        serving, by_id = self.config.serving, {m.node_id: m for m in eligible}
        free = [
            int(by_id[n].memory_available * MEMORY_HEADROOM) if by_id[n].memory_available else 2**62
            for n in placement.rank_order
        ]
        return kv_token_capacity(
            placement.plan,
            free,
            DTYPE_BYTES[self.config.dtype],
            serving.kv_bits,
            serving.kv_group_size,
            serving.kv_cache_bytes,
            # every stream the batch may run keeps its recurrent state (hybrid families)
            streams=serving.max_concurrency,
        )

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
        balance = self.balance
        if balance.draining_since is None:
            statuses = {n: self.peers.status(n) for n in led.nodes}
            if not balance.observe(led, statuses, time.monotonic()):
                return
            if any(m.weight > 0 for m in members):  # shares set by hand stay as they were set
                balance.skipped = "the shares were set by --weight"
                return
            profiles: dict[NodeId, ProfileSummary | None] = {
                n: s.profile if s else None for n, s in statuses.items()
            }
            announced = [m for m in members if m.node_id in statuses]
            assert led.plan is not None
            spec = led.plan.stages[0].tp.spec
            weights = dict(
                zip(
                    [a.node_id for a in announced],
                    node_weights(announced, profiles, spec),
                    strict=True,
                )
            )
            balance.begin(led, [m.node_id for m in members], weights)
            me = self.peers.status(self.me)
            eligible = self.members_for(spec, members, me.profile if me else None)
            queue = self._dispatcher.in_flight + self._dispatcher.waiting
            serving = self.config.serving
            draft = serving_draft(serving)
            candidate, chosen, _, _ = plan_of(spec, eligible, serving.objective, queue, draft)
            gain = replan_gain(led.plan, led.nodes, candidate, list(chosen), balance.speeds())
            if gain is not None and gain <= balance.policy.threshold / 2:
                balance.cancel(f"the best split is only {100 * gain:.0f}% faster")
                return
            self._dispatcher.hold()
            return
        if balance.drained(self._dispatcher.in_flight):
            await self._form(members, model, led.adapter_job)

    async def _release(self, peer: Announcement, epoch: Epoch) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ControlRefused, OSError):
            await self._control.release(peer, epoch)
