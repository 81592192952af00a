"""What a node does when its leader calls it (the signed control routes' handlers): fresh ports
for an epoch, an assignment (fetch the shard if told to, then replace the group's worker), a
release. A node runs one worker per group it serves (the main group's, and one for each other
model resident or replica placed on it). It also lets a worker go once its leader is gone (it
would spin in a dead ring)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import aiohttp

from exo_tp.errors import ExoTpError
from exo_tp.frozen import replace
from exo_tp.node.cluster.config import NodeConfig
from exo_tp.node.cluster.control import ControlRefused
from exo_tp.node.cluster.control_messages import (
    MAIN_GROUP,
    Accepted,
    Assign,
    Ports,
    PortsRequest,
    Release,
    Released,
)
from exo_tp.node.cluster.peers import Peers
from exo_tp.node.cluster.weight_orders import WeightOrder
from exo_tp.node.member.peer_manifests import weights_url
from exo_tp.node.member.weights import NodeWeights
from exo_tp.node.member.worker import NodeWorker
from exo_tp.transport.ports import free_ports
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.ids import Epoch

log = logging.getLogger(__name__)

# What fetching a shard meets that is nobody's bug: a refusal or a broken transfer
# (ExoTpError: TransferError, digests), a peer or the network gone, a full disk.
EXPECTED_FETCH_ERRORS = (ExoTpError, PeerRefused, aiohttp.ClientError, TimeoutError, OSError)


class ControlHandlers:
    def __init__(self, config: NodeConfig, worker: NodeWorker, weights: NodeWeights):
        self.config, self.worker, self.weights = config, worker, weights
        # group id -> its worker (the main group's is ``worker``, which fine-tuning shares)
        self.workers: dict[str, NodeWorker] = {MAIN_GROUP: worker}
        self.peers: Peers | None = None  # once the node announced itself
        self.epoch_seen = Epoch(0)  # the highest epoch a leader assigned
        self._seen: dict[str, Epoch] = {}  # the highest epoch assigned, per group
        self.assigned_keys: dict[str, str] = {}  # group -> the model of its latest assignment
        self._loading: dict[str, asyncio.Task[None]] = {}  # fetch, then start the worker
        self.adapters: Callable[[str], Path] | None = None  # a fine-tuning job's adapter folder

    @property
    def assigned_key(self) -> str | None:
        """The model of the main group's latest assignment."""
        return self.assigned_keys.get(MAIN_GROUP)

    def worker_of(self, group: str) -> NodeWorker:
        if group not in self.workers:
            self.workers[group] = NodeWorker(self.config.secret, self.config.stall_timeout)
        return self.workers[group]

    async def ports(self, request: PortsRequest) -> Ports:
        ring, conductor, hop = free_ports(3, host=self.config.host)
        return Ports(ring=ring, conductor=conductor, hop=hop)

    async def assign(self, body: Assign) -> Accepted:
        assignment = body.assignment
        if body.adapter_job is not None:  # this node's own copy of the job's adapter
            folder = self.adapters(body.adapter_job) if self.adapters else None
            if folder is None or not (folder / "adapters.safetensors").is_file():
                raise ControlRefused(f"{self.config.node_id} has no adapter of {body.adapter_job}")
            assignment = replace(assignment, adapter_path=str(folder))
            body = replace(body, assignment=assignment)
        if self.peers is None or body.leader != self.peers.leader_id():
            raise ControlRefused(f"{body.leader} is not my leader")
        group = body.group
        if assignment.epoch <= self._seen.get(group, Epoch(0)) and assignment.epoch != 0:
            raise ControlRefused("stale epoch")
        self._seen[group] = assignment.epoch
        self.epoch_seen = max(self.epoch_seen, assignment.epoch)
        await self.stop_loading(group)
        worker = self.worker_of(group)
        if body.weights:
            self.assigned_keys[group] = body.weights.key
        else:
            self.assigned_keys.pop(group, None)
        if not any(order.needs_fetch for order, _ in _orders(body)):
            # no shard order: every node loads assignment.model from its own files
            for wanted, field in _orders(body):
                folder = self.weights.folder(wanted.key)
                if folder is None:
                    raise ControlRefused(f"{self.config.node_id} has no files of {wanted.name}")
                assignment = replace(assignment, **{field: str(folder)})
            await worker.replace(assignment, body.leader)
        else:  # fetch the shard (and draft) first; the leader follows it in this node's status
            await worker.replace(None)
            worker.assigned_by = body.leader
            self._loading[group] = asyncio.create_task(
                self._fetch_then_start(body, worker), name=f"weights-{assignment.epoch}"
            )
        return Accepted(accepted=assignment.epoch)

    async def release(self, body: Release) -> Released:
        worker = self.workers.get(body.group)
        epoch = worker.epoch if worker else None
        if worker is not None and epoch is not None and epoch <= body.epoch:
            await self.stop_loading(body.group)
            await worker.replace(None)
            # this group serves nothing here now (/v1/models, /api/ps)
            self.assigned_keys.pop(body.group, None)
        return Released(released=body.epoch)

    def weight_urls(self) -> dict[str, str]:
        assert self.peers is not None
        return {
            m.announcement.node_id: weights_url(m.announcement)
            for m in self.peers.membership.members.values()
        }

    async def _fetch_then_start(self, body: Assign, worker: NodeWorker) -> None:
        """The shard, then the draft model (the conductor's node), each from this node's
        files or fetched into its store; then the worker."""
        assignment = body.assignment
        for order, field in _orders(body):
            try:
                folder = await self.weights.receive(order, assignment.epoch, self.weight_urls())
            except Exception as error:  # in the status: the leader fails the epoch, re-plans
                message = (
                    str(error)
                    if isinstance(error, ExoTpError)
                    else f"{type(error).__name__}: {error}"
                )
                if isinstance(error, EXPECTED_FETCH_ERRORS):
                    log.warning("epoch %d: %s", assignment.epoch, message)
                else:  # a bug: the epoch still fails over it, and its traceback is in the log
                    log.exception("epoch %d: fetching the weights failed", assignment.epoch)
                self.weights.failed(assignment.epoch, order, message)
                return
            assignment = replace(assignment, **{field: str(folder)})
        await worker.replace(assignment, body.leader)

    async def stop_loading(self, group: str | None = None) -> None:
        """Stop fetching ``group``'s shard (None: every group's)."""
        groups = list(self._loading) if group is None else [group]
        for name in groups:
            task = self._loading.pop(name, None)
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def drop_orphan(self) -> None:
        """Stop a worker (or its fetch) when the leader that assigned it is gone."""
        assert self.peers is not None
        alive = self.peers.alive_ids()
        for group, worker in list(self.workers.items()):
            leader = worker.assigned_by
            task = self._loading.get(group)
            loading = task is not None and not task.done()
            if (
                (worker.rank is not None or loading)
                and leader != self.config.node_id
                and leader not in alive
            ):
                log.warning("leader %s is gone; stopping worker of epoch %s", leader, worker.epoch)
                await self.stop_loading(group)
                await worker.replace(None)

    async def close(self) -> None:
        """Stop every group's fetch and worker (the main one too)."""
        await self.stop_loading()
        for worker in self.workers.values():
            await worker.close()


def _orders(body: Assign) -> list[tuple[WeightOrder, str]]:
    """The assignment's weight orders, each with the Assignment field its folder goes in: the
    shard's (model_dir), then the draft model's (draft_dir, the conductor's node)."""
    pairs = ((body.weights, "model_dir"), (body.draft, "draft_dir"))
    return [(order, field) for order, field in pairs if order is not None]
