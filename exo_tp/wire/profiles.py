"""What a node tells its cluster about its device (NodeStatus.profile, NodeStatus.probes):
defined in exo_tp.plan.profiles, below the planner that reads them (see there), and taken from
here by the node and the other wire types."""

from exo_tp.plan.profiles import (
    ENGINE_DTYPE,
    DecodeScore,
    FormatScore,
    LinkProfile,
    ProfileSummary,
    ShapeSeconds,
    decode_score,
    measured_now,
)

__all__ = [
    "DecodeScore",
    "ENGINE_DTYPE",
    "FormatScore",
    "LinkProfile",
    "ProfileSummary",
    "ShapeSeconds",
    "decode_score",
    "measured_now",
]
