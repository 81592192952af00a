"""What a node does when its leader calls it (the signed control routes' handlers): fresh ports
for an epoch, an assignment (fetch the shard if told to, then replace the worker), a release.
It also lets a worker go once its leader is gone (it would spin in a dead ring)."""

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
        self.peers: Peers | None = None  # once the node announced itself
        self.epoch_seen = Epoch(0)  # the highest epoch a leader assigned
        self.assigned_key: str | None = None  # the model of the latest assignment
        self._loading: asyncio.Task[None] | None = None  # fetch, then start the worker
        self.adapters: Callable[[str], Path] | None = None  # a fine-tuning job's adapter folder

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
        if assignment.epoch <= self.epoch_seen and assignment.epoch != 0:
            raise ControlRefused("stale epoch")
        self.epoch_seen = max(self.epoch_seen, assignment.epoch)
        await self.stop_loading()
        self.assigned_key = body.weights.key if body.weights else None
        if not any(order.needs_fetch for order, _ in _orders(body)):
            # no shard order: every node loads assignment.model from its own files
            for wanted, field in _orders(body):
                folder = self.weights.folder(wanted.key)
                if folder is None:
                    raise ControlRefused(f"{self.config.node_id} has no files of {wanted.name}")
                assignment = replace(assignment, **{field: str(folder)})
            await self.worker.replace(assignment, body.leader)
        else:  # fetch the shard (and draft) first; the leader follows it in this node's status
            await self.worker.replace(None)
            self.worker.assigned_by = body.leader
            self._loading = asyncio.create_task(
                self._fetch_then_start(body), name=f"weights-{assignment.epoch}"
            )
        return Accepted(accepted=assignment.epoch)

    async def release(self, body: Release) -> Released:
        epoch = self.worker.epoch
        if epoch is not None and epoch <= body.epoch:
            await self.stop_loading()
            await self.worker.replace(None)
            self.assigned_key = None  # this node serves nothing now (/v1/models, /api/ps)
        return Released(released=body.epoch)

    def weight_urls(self) -> dict[str, str]:
        assert self.peers is not None
        return {
            m.announcement.node_id: weights_url(m.announcement)
            for m in self.peers.membership.members.values()
        }

    async def _fetch_then_start(self, body: Assign) -> None:
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
        await self.worker.replace(assignment, body.leader)

    async def stop_loading(self) -> None:
        task, self._loading = self._loading, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def drop_orphan(self) -> None:
        """Stop the worker (or its fetch) when the leader that assigned it is gone."""
        assert self.peers is not None
        leader = self.worker.assigned_by
        loading = self._loading is not None and not self._loading.done()
        if (
            (self.worker.rank is not None or loading)
            and leader != self.config.node_id
            and leader not in self.peers.alive_ids()
        ):
            log.warning("leader %s is gone; stopping worker of epoch %s", leader, self.worker.epoch)
            await self.stop_loading()
            await self.worker.replace(None)


def _orders(body: Assign) -> list[tuple[WeightOrder, str]]:
    """The assignment's weight orders, each with the Assignment field its folder goes in: the
    shard's (model_dir), then the draft model's (draft_dir, the conductor's node)."""
    pairs = ((body.weights, "model_dir"), (body.draft, "draft_dir"))
    return [(order, field) for order, field in pairs if order is not None]
