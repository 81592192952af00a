"""What a Mamba-2 layer (Nemotron-H) or a short-conv layer (LFM2) of a rank holds, reads and
keeps per stream (pure).

Mamba-2's split unit is a group (exo_tp.arch.families.nemotron_h.NEMOTRON_H): ``groups`` of
them on a rank, each ``linear.head_dim`` channels of z and of x (its heads_per_group heads),
``state_size`` channels of B and of C, and one dt per head. A short conv's unit is a channel.
"""

from __future__ import annotations

from exo_tp.plan.matvec import Segment
from exo_tp.plan.spec import LinearAttention


def mamba_matrices(
    hidden: int, linear: LinearAttention, groups: int
) -> list[tuple[Segment, int, int, int]]:
    """in_proj's rows of this rank's groups (z, x, B, C, dt) and out_proj's columns."""
    if not groups:
        return []
    x, n, per = linear.head_dim, linear.state_size, linear.heads_per_group
    return [
        ("attention", hidden, groups * (2 * x + 2 * n + per), 1),  # in_proj
        ("attention", groups * x, hidden, 1),  # out_proj
    ]


def mamba_floats(linear: LinearAttention, groups: int) -> int:
    """Its groups' conv weights and biases, A_log, D and dt_bias per head, norm weights."""
    channels = groups * (linear.head_dim + 2 * linear.state_size)
    return (
        channels * (linear.conv_kernel + 1)
        + 3 * groups * linear.heads_per_group
        + (groups * linear.head_dim)
    )


def mamba_state_bytes(linear: LinearAttention, groups: int, float_bytes: int) -> int:
    """Per stream, whatever the context: an (head_dim x state_size) float32 SSM state per head
    (a group's heads span linear.head_dim channels) and the conv's last kernel - 1 inputs."""
    channels = groups * (linear.head_dim + 2 * linear.state_size)
    state = groups * linear.head_dim * linear.state_size * 4
    return state + (linear.conv_kernel - 1) * channels * float_bytes


def short_conv_matrices(hidden: int, channels: int) -> list[tuple[Segment, int, int, int]]:
    """in_proj's B, C and x rows of this rank's channels, out_proj's columns."""
    if not channels:
        return []
    return [("attention", hidden, 3 * channels, 1), ("attention", channels, hidden, 1)]


def short_conv_floats(linear: LinearAttention, channels: int) -> int:
    """Its channels' conv taps (biases aside: a few floats)."""
    return channels * linear.conv_kernel


def short_conv_state_bytes(linear: LinearAttention, channels: int, float_bytes: int) -> int:
    """Per stream: the conv's last kernel - 1 inputs of its channels."""
    return (linear.conv_kernel - 1) * channels * float_bytes
