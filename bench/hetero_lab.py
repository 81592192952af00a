"""Heterogeneous lab: two unequal "devices" on this machine, measured vs predicted.

As root, the lab makes two devices out of this machine's cores with cgroups v1: device 0 is a
whole core, device 1 another core under a CPU quota (`cpu.cfs_quota_us`, default 40%) or,
with `--slow-by busy`, shared with a busy process (a steadier ~2x slower device). It
profiles both at once with `exo-tp bench` run inside their cgroups (they share the memory
bus when they run together, unlike separate machines), measures the link between them with
the bench's 2-rank MLX ring probe, then runs SmolLM2 decoding with `exo-tp launch` under five
plans, every rank moved into its device's cgroups as soon as it starts:

- the fast device alone, even TP (shares 1:1), proportional uneven TP (shares = measured
  decode speeds),
- pure pipeline (one device per stage, layers in proportion to speed),
- the planner's choice (`exo_tp.plan.search.choose_plan` on the measured profiles and link),

and prints each plan's measured decode tokens/s next to the cost model's prediction. With
`--delay-ms` (and `--rate-mbit`) the whole lab runs inside a network namespace of its own whose
loopback has a `tc netem` delay (and rate limit), so every link between the ranks is slow.
Everything it creates (cgroups, namespace) is removed on exit.

    sudo python bench/hetero_lab.py [--quota 0.4] [--tokens 48] [--delay-ms 2 --rate-mbit 1000]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import ROOT, env, generation_tps, launch_command, resolve

sys.path.insert(0, str(ROOT))

from exo_tp.plan import load_spec, plan_tensor_parallel  # noqa: E402
from exo_tp.plan.cluster import Cluster, Link, cluster_from_profiles  # noqa: E402
from exo_tp.plan.cost import LinkCost  # noqa: E402
from exo_tp.plan.devices import DeviceProfile  # noqa: E402
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, single_stage, split_layers  # noqa: E402,E501
from exo_tp.plan.predict import predict  # noqa: E402
from exo_tp.plan.search import choose_plan  # noqa: E402
from exo_tp.runtime.job import Assignment  # noqa: E402

CGROUPS = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # short CFS periods: a quota throttles in small slices, not 100 ms stalls


class Device:
    """A core (cpuset cgroup) with an optional CPU quota (cpu cgroup) or busy competitors."""

    def __init__(self, name: str, core: int, quota: float | None, competitors: int = 0):
        self.name, self.core, self.quota, self.competitors = name, core, quota, competitors
        self.dirs = [
            CGROUPS / kind / f"exo-tp-lab-{os.getpid()}-{name}" for kind in ("cpu", "cpuset")
        ]
        self._busy: list[subprocess.Popen[bytes]] = []

    def create(self) -> None:
        cpu, cpuset = self.dirs
        for d in self.dirs:
            d.mkdir()
        (cpu / "cpu.shares").write_text("262144")  # other processes cannot take the core
        (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        quota = -1 if self.quota is None else int(self.quota * PERIOD_US)
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        (cpuset / "cpuset.cpus").write_text(str(self.core))
        (cpuset / "cpuset.mems").write_text((CGROUPS / "cpuset" / "cpuset.mems").read_text())
        for _ in range(self.competitors):  # busy loops sharing the core fairly with the rank
            self._busy.append(
                subprocess.Popen([*self.prefix(), sys.executable, "-c", "while True: pass"])
            )

    def enter(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def prefix(self) -> list[str]:
        """A command prefix that runs the command inside this device."""
        writes = " && ".join(f'echo $$ > "{d / "cgroup.procs"}"' for d in self.dirs)
        return ["sh", "-c", f'{writes} && exec "$@"', "sh"]

    def remove(self) -> None:
        for busy in self._busy:
            busy.kill()
            busy.wait()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # a dying task is still inside
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), 9)
                    time.sleep(0.1)


@contextlib.contextmanager
def devices(slow_by: str, quota: float) -> Iterator[list[Device]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("the lab needs two cores")
    slow = (
        Device("slow", cores[1], quota)
        if slow_by == "quota"
        else Device("slow", cores[1], None, competitors=1)
    )
    made = [Device("fast", cores[0], None), slow]
    try:
        for d in made:
            d.create()
        yield made
    finally:
        for d in made:
            d.remove()


def profile(device: Device, home: Path, full: bool) -> DeviceProfile:
    command = [
        *device.prefix(),
        sys.executable,
        "-m",
        "exo_tp",
        "bench",
        "--refresh",
        "--json",
        *([] if full else ["--quick"]),
    ]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env={**env(), "EXO_TP_HOME": str(home / device.name)},
    )
    return DeviceProfile.model_validate_json(out.stdout.strip().splitlines()[-1])


def measure_link(pair: Sequence[Device]) -> LinkCost:
    from exo_tp.profile.link_probe import LinkMeasurement
    from exo_tp.profile.links import measure_pair, probe_job
    from exo_tp.transport.ports import free_ports
    from exo_tp.transport.ring import write_hostfile

    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(2)])
        jobs = [
            probe_job(f"probe {d.name}", rank, hostfile, False, d.prefix(), env())
            for rank, d in enumerate(pair)
        ]
        result = measure_pair(jobs, timeout=120)[0]
    if not isinstance(result, LinkMeasurement):
        raise RuntimeError(f"link probe failed: {result.message}")
    # As `cluster_from_profiles` prices a measured link: what an all_sum costs in a forward pass.
    return LinkCost(
        latency=max(result.all_sum_latency, result.all_sum_in_graph),
        bandwidth=result.all_sum_bandwidth,
        measured=True,
    )


def _place(
    launcher: subprocess.Popen[str], placement: Sequence[Device], stop: threading.Event
) -> None:
    """Move every rank of ``launcher`` into its device as soon as it appears."""
    import psutil

    placed: set[int] = set()
    parent = psutil.Process(launcher.pid)
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            for child in parent.children(recursive=True):
                if child.pid in placed:
                    continue
                with contextlib.suppress(psutil.Error, ValueError, OSError):
                    rank = rank_of(child.cmdline())
                    placement[rank].enter(child.pid)
                    placed.add(child.pid)
        time.sleep(0.02)


def rank_of(cmdline: list[str]) -> int:
    """The global rank of a rank process (`python -m exo_tp.runtime.rank JOB.json ...`)."""
    job = cmdline[cmdline.index("exo_tp.runtime.rank") + 1]
    return Assignment.model_validate_json(Path(job).read_text()).rank


def stage_args(plan: PipelinePlan) -> list[str]:
    """`exo-tp launch` options that lay out ``plan``'s stages (none for plain TP)."""
    if len(plan.stages) == 1:
        return []
    return [
        "--stages",
        ",".join(str(s.size) for s in plan.stages),
        "--stage-layers",
        ",".join(str(s.layers.size) for s in plan.stages),
    ]


def decode_tps(model: Path, plan: PipelinePlan, placement: Sequence[Device], tokens: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        weights = [round(w, 6) for s in plan.stages for w in s.tp.weights]
        command = launch_command(model, weights, tokens, report, *stage_args(plan))
        launcher = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env()
        )
        stop = threading.Event()
        placer = threading.Thread(target=_place, args=(launcher, placement, stop), daemon=True)
        placer.start()
        _, err = launcher.communicate(timeout=900)
        stop.set()
        placer.join()
        if launcher.returncode:
            raise SystemExit(f"launch failed: {err[-2000:]}")
        return generation_tps(report)


def run_lab(args: argparse.Namespace) -> dict[str, object]:
    model = resolve(args.model)
    spec = load_spec(model)
    with devices(args.slow_by, args.quota) as pair, tempfile.TemporaryDirectory() as home:
        # Both at once: the devices share this machine's memory bus when they run together.
        with ThreadPoolExecutor(2) as pool:
            profiles = list(pool.map(lambda d: profile(d, Path(home), args.full_bench), pair))
        link = measure_link(pair)
        base = cluster_from_profiles(spec, profiles)
        cluster = Cluster(
            devices=base.devices, links=(Link(a=0, b=1, cost=link),), default_link=link
        )
        speeds = [d.speed for d in cluster.devices]
        choice = choose_plan(spec, cluster, context_tokens=args.tokens + 64, prompt_tokens=16)
        plans: dict[str, tuple[PipelinePlan, tuple[int, ...]]] = {
            "fast_alone": (single_stage(plan_tensor_parallel(spec, [1])), (0,)),
            "even_tp": (single_stage(plan_tensor_parallel(spec, [1, 1])), (0, 1)),
            "uneven_tp": (single_stage(plan_tensor_parallel(spec, speeds)), (0, 1)),
            "pipeline": (
                plan_pipeline(spec, [[1], [1]], split_layers(spec.num_layers, speeds)),
                (0, 1),
            ),
            "planner": (choice.best.plan, choice.best.devices),
        }
        results: dict[str, dict[str, float]] = {}
        for name, (plan, on) in plans.items():
            predicted = predict(plan, on, cluster, args.tokens + 64, 16).tokens_per_second
            measured = decode_tps(model, plan, [pair[d] for d in on], args.tokens)
            results[name] = {
                "measured": round(measured, 3),
                "predicted": round(predicted, 3),
                "measured_over_predicted": round(measured / predicted, 3),
            }
            print(
                f"{name:>10}: measured {measured:6.2f} tok/s, predicted {predicted:6.2f} "
                f"tok/s ({measured / predicted:.2f}x)",
                file=sys.stderr,
                flush=True,
            )
    names = [d.name for d in pair]
    slowed = (
        f"at {args.quota:.0%} quota" if args.slow_by == "quota" else "shared with a busy process"
    )
    print(
        f"devices: {names[0]} = core {pair[0].core}, {names[1]} = core {pair[1].core} "
        f"{slowed}; decode speeds {speeds[0] / 1e9:.2f} / "
        f"{speeds[1] / 1e9:.2f} GB/s; link: all_sum in a forward pass "
        f"{link.latency * 1e6:.0f} µs, "
        f"{link.bandwidth / 1e9:.2f} GB/s"
        + (f"; netem delay {args.delay_ms} ms" if args.delay_ms else "")
    )
    print(
        f"planner's choice: {choice.best.kind} on devices "
        f"{[[names[d] for d in g] for g in choice.best.groups]}"
    )
    print(f"{'plan':>10} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for name, r in results.items():
        print(
            f"{name:>10} {r['measured']:>9.2f} {r['predicted']:>9.2f} "
            f"{r['measured_over_predicted']:>6.2f}"
        )
    best = max(results, key=lambda n: results[n]["measured"])
    return {
        "plans": results,
        "planner_choice": choice.best.kind,
        "planner_over_even_measured": round(
            results["planner"]["measured"] / results["even_tp"]["measured"], 3
        ),
        "planner_over_best_measured": round(
            results["planner"]["measured"] / results[best]["measured"], 3
        ),
        "uneven_over_even_measured": round(
            results["uneven_tp"]["measured"] / results["even_tp"]["measured"], 3
        ),
        "uneven_over_even_predicted": round(
            results["uneven_tp"]["predicted"] / results["even_tp"]["predicted"], 3
        ),
        "fastest_measured": best,
        "slow_by": args.slow_by,
        "quota": args.quota if args.slow_by == "quota" else None,
        "delay_ms": args.delay_ms,
    }


@contextlib.contextmanager
def netem_namespace(delay_ms: float, rate_mbit: float | None) -> Iterator[str]:
    name = f"exotp-lab-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:

        def inside(*command: str) -> None:
            subprocess.run(["ip", "netns", "exec", name, *command], check=True, capture_output=True)

        inside("ip", "link", "set", "lo", "up")
        netem = ["delay", f"{delay_ms}ms"] + (["rate", f"{rate_mbit}mbit"] if rate_mbit else [])
        try:
            inside("tc", "qdisc", "add", "dev", "lo", "root", "netem", *netem)
        except subprocess.CalledProcessError:
            raise SystemExit(
                "tc netem is not available (this kernel lacks sch_netem): run the "
                "lab without --delay-ms"
            ) from None
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--slow-by",
        choices=("quota", "busy"),
        default="quota",
        help="slow device 1 by a CFS quota, or by a busy process on its core",
    )
    parser.add_argument("--quota", type=float, default=0.4, help="CPU quota of device 1")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--full-bench", action="store_true", help="full (not --quick) profiles")
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="run in a network namespace whose loopback delays every packet",
    )
    parser.add_argument("--rate-mbit", type=float, help="and limits its rate")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the lab needs root (cgroups, network namespaces)")
    if args.delay_ms and not args.inside:
        with netem_namespace(args.delay_ms, args.rate_mbit) as name:
            result = subprocess.run(
                ["ip", "netns", "exec", name, sys.executable, __file__, *sys.argv[1:], "--inside"],
                check=False,
            )
        raise SystemExit(result.returncode)
    print(json.dumps(run_lab(args)))


if __name__ == "__main__":
    main()
