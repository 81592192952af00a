"""Device profiles of made-up devices, for the planner's tests: what `exo-tp bench` would write
for a device reading weights at ``gb_per_s`` (its other figures fixed and ample); and the
announcement a made-up node would send."""

from __future__ import annotations

from typing import Any

from exo_tp.plan.devices import DeviceProfile
from exo_tp.wire.announcement import Announcement


def lab_profile(gb_per_s: float, **fields: Any) -> DeviceProfile:
    """A device reading weights at ``gb_per_s`` GB/s; ``fields`` set any other field (node_id,
    kernels, shapes, links ...)."""
    return DeviceProfile(
        **{
            "chip": "lab cpu",
            "cores": 1,
            "mlx_version": "0",
            "mlx_device": "cpu",
            "memory_total": 16 * 10**9,
            "memory_available": 8 * 10**9,
            "backends": ("ring",),
            "memory_bandwidth": gb_per_s * 1e9,
            "decode_seconds_per_byte": 1 / (gb_per_s * 1e9),
            "prefill_flops": 2e10,
            **fields,
        }
    )


def lab_announcement(node_id: str, **fields: Any) -> Announcement:
    """A node's announcement on loopback; ``fields`` set any other field (started, weight,
    decode_seconds_per_byte ...)."""
    return Announcement(
        **{
            "node_id": node_id,
            "version": "0",
            "cluster": "c",
            "host": "127.0.0.1",
            "api_port": 8000,
            "control_port": 8001,
            **fields,
        }
    )
