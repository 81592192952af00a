"""What nodes tell each other about model weights (typed; part of NodeStatus and Assign).

A node offers each model it was given (``--model``: the folder's files) and each shard store it
holds, named by the model's key (exo_tp.weights.key: the same on every node). The leader sends
each node of an epoch a WeightOrder: which model, and, when some node lacks the files, that
node's part of the transfer plan. The node reports its fetch (bytes, rate, ETA) in its status.
"""

from __future__ import annotations

from typing import Literal

from exo_tp.frozen import Frozen
from exo_tp.weights.transfer import NodeTransfer
from exo_tp.wire.ids import Epoch, ModelIdentity, ModelKey
from exo_tp.wire.weights import ServedStats, TransferProgress

FetchState = Literal["fetching", "done", "failed", "cancelled"]


class ModelOffer(Frozen):
    name: str  # as the node was given it (a prepared model's name or a folder)
    key: ModelKey
    files: bool  # the node has the model folder (every byte)
    identity: ModelIdentity | None = None  # the manifest's, once this node knows it
    held_bytes: int = 0  # weight bytes it holds (all of them with the files)
    total_bytes: int = 0  # 0 until the manifest is known
    # Offered only as a draft model (`--draft-model`): a conductor's node fetches it, but the
    # cluster does not serve it as a model of its own.
    draft: bool = False


class FetchSummary(Frozen):
    """One node's fetch of its shard for one epoch."""

    epoch: Epoch
    key: ModelKey
    name: str
    state: FetchState
    share_bytes: int  # its rank's share
    retained_bytes: int  # of which it already held
    planned_bytes: int  # the rest, to fetch
    progress: TransferProgress | None = None
    error: str | None = None
    seconds: float = 0.0


class WeightsStatus(Frozen):
    default: ModelKey | None = None  # key of the model it was started with (its first --model)
    offers: tuple[ModelOffer, ...] = ()
    fetch: FetchSummary | None = None  # the latest
    recent: tuple[FetchSummary, ...] = ()  # earlier ones, newest first
    served: ServedStats | None = None  # bytes its weight server sent


class WeightOrder(Frozen):
    """The model an epoch serves, as the leader tells one node."""

    key: ModelKey
    name: str
    identity: ModelIdentity | None = None  # the manifest's, when there is a transfer plan
    # None: every node of the epoch loads from its own files (no manifest was needed).
    transfer: NodeTransfer | None = None

    @property
    def needs_fetch(self) -> bool:
        return self.transfer is not None and self.transfer.load_from == "store"
