"""The ids that cross the wire, one type per concept (a checker keeps them apart; on the wire
they are the plain str/int they wrap)."""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)  # a node's name in the cluster (its announcement's node_id)
Epoch = NewType("Epoch", int)  # one formation of the cluster: members, plan, ranks
Rank = NewType("Rank", int)  # a global rank within an epoch
RequestId = NewType("RequestId", str)  # one generation request, from the API to the conductor
BatchUid = NewType("BatchUid", int)  # a request's row in the batch generator (every rank agrees)
ModelKey = NewType("ModelKey", str)  # a model's cheap fingerprint (exo_tp.weights.key)
ModelIdentity = NewType("ModelIdentity", str)  # a weight manifest's digest identity
