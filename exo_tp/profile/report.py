"""The readable table `exo-tp bench` prints: device, scores, every kernel, links."""

from __future__ import annotations

from exo_tp.plan.devices import DeviceProfile, MatmulScore
from exo_tp.plan.human import duration, rate, size
from exo_tp.wire.profiles import LinkProfile


def _link_line(link: LinkProfile) -> str:
    if not link.up:
        return f"{link.a} <-> {link.b}  DOWN: {link.error}"
    return (
        f"{link.a} <-> {link.b}  up  all_sum 4 KB {duration(link.all_sum_latency or 0)}"
        f", 8 MB {rate(link.all_sum_bandwidth or 0)}"
        f", send/recv one way {duration(link.send_recv_latency or 0)}"
    )


def _kernel_line(k: MatmulScore) -> str:
    return (
        f"{k.kind:<7} {k.dtype:<9} {f'{k.m}x{k.k} . {k.k}x{k.n}':<24} "
        f"{duration(k.seconds):>9} {rate(k.weight_bytes_per_second):>12} "
        f"{rate(k.flops, 'FLOP'):>14} {size(k.working_set_bytes):>12}"
    )


def render_profile(p: DeviceProfile, cached: bool = False) -> str:
    origin = (
        f"cached profile measured {p.measured_at} (--refresh to measure again)"
        if cached
        else f"measured in {p.duration_seconds:.1f} s"
    )
    lines = [
        f"device   {p.chip} ({p.cores} cores) on {p.hostname or '?'}"
        + (f", node {p.node_id}" if p.node_id else ""),
        f"mlx      {p.mlx_version} on {p.mlx_device}; distributed backends: "
        f"{', '.join(p.backends) or 'none'}",
        *([f"blas     {p.blas}"] if p.blas else []),
        f"memory   {size(p.memory_available)} available of {size(p.memory_total)}; "
        f"read bandwidth {rate(p.memory_bandwidth)}",
        f"decode   {p.decode_seconds_per_byte:.3e} s/byte ({rate(p.decode_speed)} of "
        f"{p.decode_dtype} weights)",
        f"prefill  {rate(p.prefill_flops, 'FLOP')} ({p.decode_dtype})",
        f"{'quick' if p.quick else 'full'} run, {origin}",
        "",
        f"{'kind':<7} {'dtype':<9} {'shape (M x K . K x N)':<24} {'time':>9} {'weights':>12} "
        f"{'compute':>14} {'working set':>12}",
    ]
    lines += [_kernel_line(k) for k in p.kernels]
    if p.shapes:
        lines += ["", "the model's matrix shapes (the planner prices each matrix by these)"]
        lines += [_kernel_line(k) for k in p.shapes]
    if p.links:
        lines += ["", "links (MLX ring, 2 ranks per pair)"] + [_link_line(x) for x in p.links]
    return "\n".join(lines)
