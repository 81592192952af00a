"""The leader's loop against a fine-tuning job's pause (exo_tp.node.leader.formation.Leader).

A job pauses the leader while it may be forming an epoch across many awaits (preparing the
model, placing it, assigning ranks). CI once had the pause let go of the epoch in the middle of
such a round: the round then failed on the epoch it had lost, the error killed the leader's
loop, and after the job the cluster never formed again. These tests hold a round open at the
model's preparation, the first await of a formation, and check what the pause and the loop do.
The leader here is a real one over this node alone; only the cluster's model is a stand-in, so
that the test decides when a preparation returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from exo_tp import __version__
from exo_tp.errors import ExoTpError
from exo_tp.node.cluster.config import NodeConfig
from exo_tp.node.cluster.control import ControlClient
from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.cluster.peers import Peers
from exo_tp.node.leader.cluster_model import ClusterModel
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.epochs import EpochNumbers
from exo_tp.node.leader.formation import Leader
from exo_tp.node.leader.model_requests import ModelRequests
from exo_tp.wire.announcement import Announcement

ME = "node-0"
WAIT = 10.0  # seconds for an event the leader's loop sets within a round or two


class HeldModel:
    """The cluster's model as the leader sees it, whose preparation waits for the test."""

    def __init__(self, errors: Sequence[BaseException] = ()) -> None:
        self.entered = asyncio.Event()  # a preparation began
        self.release = asyncio.Event()  # the test lets it end
        self.calls = 0
        self._errors = list(errors)

    def target(self, nodes: Sequence[str], current: str | None, wanted: str | None) -> str:
        return "model"

    def name_of(self, key: str, offers: object) -> str:
        return key

    def offers(self) -> dict[str, list[tuple[str, str]]]:
        return {}

    async def prepare(self, key: str, members: Sequence[str], main: bool = True) -> None:
        self.calls += 1
        self.entered.set()
        await self.release.wait()
        self.entered.clear()
        self.release.clear()
        if self._errors:
            raise self._errors.pop(0)
        raise ExoTpError("the stand-in has no model")  # the round fails its epoch cleanly


def leader(model: HeldModel) -> Leader:
    secret = "s" * 32
    me = Announcement(
        node_id=ME, version=__version__, cluster="t", host="127.0.0.1", api_port=1, control_port=2
    )
    control = ControlClient(secret)

    def my_status() -> NodeStatus:
        return NodeStatus(node_id=ME, leader=ME, epoch=0)

    peers = Peers(me, secret, "127.0.0.1", control, my_status)
    dispatcher = Dispatcher(b"k" * 32, "127.0.0.1", max_concurrency=4, max_queue=4)
    config = NodeConfig(node_id=ME, settle=0.0)
    stand_in: ClusterModel = model  # type: ignore[assignment]
    epochs = EpochNumbers(lambda: 0)
    return Leader(config, stand_in, peers, control, dispatcher, 0, epochs, ModelRequests())


async def started(model: HeldModel) -> None:
    await asyncio.wait_for(model.entered.wait(), WAIT)


def test_a_pause_waits_for_the_round_in_progress_and_no_round_runs_while_paused() -> None:
    async def main() -> None:
        model = HeldModel()
        lead = leader(model)
        loop = asyncio.create_task(lead.run_forever())
        await started(model)  # a formation round is preparing the model
        forming = lead.led
        assert forming is not None
        pause = asyncio.create_task(lead.pause("fine-tuning job j is starting"))
        for _ in range(20):  # the pause gets every chance to run ahead of the round
            await asyncio.sleep(0)
        assert not pause.done(), "the pause let go of the epoch while a round was forming it"
        assert lead.led is forming
        model.release.set()
        await asyncio.wait_for(pause, WAIT)
        assert lead.led is None and lead.paused is not None
        calls = model.calls
        rounds = asyncio.create_task(model.entered.wait())
        done, _ = await asyncio.wait({rounds}, timeout=1.5)  # several rounds of the loop
        assert not done and model.calls == calls, "a round formed while the job held the cluster"
        lead.resume()
        await asyncio.wait_for(rounds, WAIT)  # the cluster forms again after the job
        assert not loop.done()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(main())


def test_the_loop_survives_an_unexpected_error_in_a_round() -> None:
    async def main() -> None:
        model = HeldModel(errors=[AttributeError("'NoneType' object has no attribute 'nodes'")])
        lead = leader(model)
        loop = asyncio.create_task(lead.run_forever())
        await started(model)
        first = lead.led
        model.release.set()  # this round fails on the unexpected error
        await started(model)  # and a later round forms again
        assert not loop.done()
        failed = lead.state.previous  # the epoch the new round replaced
        assert first is not None and failed is not None and failed.number == first.number
        assert failed.state == "failed" and lead.led is not None and lead.led is not failed
        assert "AttributeError" in failed.reason
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(main())
