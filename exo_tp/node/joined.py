"""The parts a node has once it announced itself to its cluster."""

from __future__ import annotations

from dataclasses import dataclass

from exo_tp.node.cluster.peers import Peers
from exo_tp.node.leader.cluster_model import ClusterModel
from exo_tp.node.leader.formation import Leader
from exo_tp.node.leader.resident import ResidentGroups


@dataclass(frozen=True)
class Joined:
    peers: Peers  # discovery, membership, the status poll
    models: ClusterModel  # which model the cluster serves, whose weights move where
    leader: Leader  # formation of the main group, while this node leads
    groups: ResidentGroups  # every group this node leads: the main one and the others

    def leads(self) -> bool:
        return self.leader.leads()
