"""Heterogeneous lab: a fast and an emulated slow device on this machine, measured vs predicted.

Device 0 is a core at full speed; device 1 another core whose every matmul does s times the
real work (the lab's work factor, exo_tp.lab: slow at every instant, like a slower machine,
not a time-sliced core). Each rank is pinned to its own core. No root, no cgroups.

Modes:
- ``plans`` (default): for each s in --factors, profile both devices with `exo-tp bench` at
  the same time, each on its core (the slow one with --work-factor s), measure the link
  between them, then decode SmolLM2 (float32) with `exo-tp launch` under: the fast device
  alone, even TP, uneven TP with shares from the measured bench scores, pipeline (layers in
  proportion to the scores) and the planner's choice (`choose_plan`). Each is measured
  (median of --rounds alternating rounds) and predicted by the cost model. Per s: uneven/even
  gain against the ideal (1+s)/2, the planner's rank among the measured plans,
  measured/predicted of every plan.
- ``validate``: one rank alone at factor 1 and at each s, alternating: the decode slowdown
  should be s (within 10%).
- ``mixed`` (a many-core machine): 3-6 ranks, each on its own core at its factor (--clusters,
  e.g. 1,1.5,2;1,1,2,3): the fastest ranks alone (even TP), even TP, uneven TP with shares from
  the bench scores and the planner's choice, measured and predicted as in ``plans``; the
  uneven/even gain against the ideal max(s) * sum(1/s) / N (even TP runs at the slowest
  rank's pace).
- ``rebalance``: a 2-node `exo-tp run --local-nodes 2` cluster under 8 greedy streams; the
  second node's factor goes 1 -> s at run time. Tokens/s before the change, after it (before
  re-planning), after the re-plan, and the seconds the re-plan took; the shares before and
  after. Then a fresh cluster, started with the second node already at s (same flags, load
  and window), plans itself at start-up: its tokens/s and shares, and after-re-plan / fresh
  (the issue's target: within 10%).

    python bench/hetero_lab.py [--mode plans|validate|rebalance|mixed] [--factors 1.5,2,3]
        [--tokens 48] [--rounds 3] [--quick] [--state DIR]

``--state DIR`` (mixed mode, for a lent machine's calls of at most 10 minutes): the profiles,
the link and every run's tokens/s are saved in DIR as they are measured and reused when the
mode starts again with the same DIR, so a call cut short loses only the run in progress and
the next call (DIR carried back) continues from there.

The last line of stdout is one JSON object. ``--quick``: one factor (2), few tokens, one round,
quick profiles, and (unless --model is given) a tiny random model with SmolLM2's tokenizer
(bench/_common.py's ``tiny_model``): checks the lab runs, measures nothing worth reporting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, TypeVar

from _common import (
    MODEL_HELP,
    ROOT,
    env,
    generation_tps,
    launch_command,
    model_arg,
    pinned,
)

sys.path.insert(0, str(ROOT))

from exo_tp.frozen import Frozen  # noqa: E402
from exo_tp.lab.factor import write_factor_file  # noqa: E402
from exo_tp.models.registry import resolve_model  # noqa: E402
from exo_tp.plan import load_spec, plan_tensor_parallel  # noqa: E402
from exo_tp.plan.cluster import Cluster, Link, cluster_from_profiles  # noqa: E402
from exo_tp.plan.cost import LinkCost  # noqa: E402
from exo_tp.plan.devices import DeviceProfile  # noqa: E402
from exo_tp.plan.pipeline import PipelinePlan, plan_pipeline, single_stage, split_layers  # noqa: E402,E501
from exo_tp.plan.predict import predict  # noqa: E402
from exo_tp.plan.search import choose_plan  # noqa: E402

CORES = sorted(os.sched_getaffinity(0))
M = TypeVar("M", bound=Frozen)


class Sample(Frozen):
    """One run's tokens/s, a line of --state DIR's samples.jsonl."""

    key: str
    tokens_per_second: float


class LabState:
    """--state DIR: what a mode has measured so far, kept across calls (none without DIR)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.samples: dict[str, float] = {}
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            log = folder / "samples.jsonl"
            if log.exists():
                for line in log.read_text().splitlines():
                    with contextlib.suppress(ValueError):  # a line cut short by a killed call
                        entry = Sample.model_validate_json(line)
                        self.samples[entry.key] = entry.tokens_per_second
            if self.samples:
                print(f"  reusing {len(self.samples)} runs from {log}", file=sys.stderr)

    def sample(self, key: str, measure: Callable[[], float]) -> float:
        """The run's tokens/s: from an earlier call if it was measured, else measured now."""
        if key in self.samples:
            return self.samples[key]
        value = float(measure())
        self.samples[key] = value
        if self.folder is not None:
            with open(self.folder / "samples.jsonl", "a") as log:
                log.write(Sample(key=key, tokens_per_second=value).model_dump_json() + "\n")
        return value

    def kept(self, name: str, kind: type[M], measure: Callable[[], M]) -> M:
        """A pydantic value (profiles, the link) measured once per DIR."""
        path = None if self.folder is None else self.folder / f"{name}.json"
        if path is not None and path.exists():
            return kind.model_validate_json(path.read_text())
        value = measure()
        if path is not None:
            path.write_text(value.model_dump_json())
        return value


class Profiles(Frozen):
    """The bench's profile of each distinct work factor (kept by --state)."""

    by_factor: dict[float, DeviceProfile]


def profile(factor: float, core: int, home: Path, args: argparse.Namespace) -> DeviceProfile:
    """`exo-tp bench` of a device pinned to ``core`` at ``factor``, with the lab model's
    matrix shapes (the planner prices each matrix by its shape)."""
    command = [sys.executable, "-m", "exo_tp", "bench", "--refresh", "--json"]
    # The folder, not the name: a name would prepare the default models again in this fresh home.
    command += ["--model", str(resolve_model(args.model))]
    command += ["--work-factor", f"{factor:g}"] + (["--quick"] if args.quick else [])
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env={**env(), "EXO_TP_HOME": str(home)},
        preexec_fn=pinned(core),
    )
    return DeviceProfile.model_validate_json(out.stdout.strip().splitlines()[-1])


def profile_together(factors: list[float], args: argparse.Namespace) -> list[DeviceProfile]:
    """`exo-tp bench` of each factor at the same time, each on its own core and in its own
    home. Measured together, the profiles see this machine in the same state: on a VM whose
    speed drifts by a fifth over minutes, two profiles taken minutes apart get that drift into
    their ratio, which sets the shares and the planner's choice."""
    with tempfile.TemporaryDirectory() as home, ThreadPoolExecutor(len(factors)) as pool:
        measuring = [
            pool.submit(profile, f, CORES[i % len(CORES)], Path(home) / str(i), args)
            for i, f in enumerate(factors)
        ]
        return [m.result() for m in measuring]


def measure_link() -> LinkCost:
    """The bench's 2-rank ring probe, one rank per core (jobs of the one supervisor)."""
    from exo_tp.profile.link_probe import LinkMeasurement
    from exo_tp.profile.links import measure_pair, probe_job
    from exo_tp.transport.ports import free_ports
    from exo_tp.transport.ring import write_hostfile

    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(2)])
        jobs = [
            probe_job(
                f"probe {rank}",
                rank,
                hostfile,
                False,
                base_env=env(),
                cores=(CORES[rank % len(CORES)],),
            )
            for rank in range(2)
        ]
        result = measure_pair(jobs, timeout=120)[0]
    if not isinstance(result, LinkMeasurement):
        raise RuntimeError(f"link probe failed: {result.message}")
    return LinkCost(
        latency=max(result.all_sum_latency, result.all_sum_in_graph),
        bandwidth=result.all_sum_bandwidth,
        measured=True,
    )


def stage_args(plan: PipelinePlan) -> list[str]:
    if len(plan.stages) == 1:
        return []
    return [
        "--stages",
        ",".join(str(s.size) for s in plan.stages),
        "--stage-layers",
        ",".join(str(s.layers.size) for s in plan.stages),
    ]


def decode_tps(model: Path, plan: PipelinePlan, factors: list[float], tokens: int) -> float:
    """`exo-tp launch` of ``plan``, global rank i at ``factors[i]`` on core i."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        weights = [round(w, 6) for s in plan.stages for w in s.tp.weights]
        command = launch_command(model, weights, tokens, report, *stage_args(plan))
        command += ["--work-factor", ",".join(f"{f:g}" for f in factors)]
        result = subprocess.run(command, capture_output=True, text=True, env=env(), check=False)
        if result.returncode:
            raise SystemExit(f"launch failed: {result.stderr[-2000:]}")
        return generation_tps(report)


def alternating(
    runs: dict[str, Callable[[], float]],
    rounds: int,
    state: LabState | None = None,
    scope: str = "",
) -> dict[str, float]:
    """Median of ``rounds`` rounds of every run, the order reversed each round (drift in the
    machine's state hits every run alike). With a ``state``, runs it holds are not repeated."""
    state = state or LabState(None)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(state.sample(f"{scope}/{name}/{r}", runs[name]))
            print(f"  round {r + 1} {name}: {samples[name][-1]:.3f}", file=sys.stderr, flush=True)
    return {name: statistics.median(v) for name, v in samples.items()}


def window(args: argparse.Namespace) -> tuple[int, int]:
    """The context and prompt tokens every plan is chosen and predicted for (the launches
    decode --tokens after the bench prompt)."""
    return args.tokens + 64, 16


def measure_plans(
    model: Path,
    plans: dict[str, tuple[PipelinePlan, tuple[int, ...]]],
    device_factor: list[float],
    cluster: Cluster,
    args: argparse.Namespace,
    state: LabState | None = None,
    scope: str = "",
) -> tuple[dict[str, float], dict[str, float], str | None]:
    """Every plan (on the devices it names) measured, median of --rounds alternating rounds,
    and predicted by the cost model; and which other plan the planner's is, if any."""
    context, prompt = window(args)
    priced = {
        name: predict(plan, on, cluster, context, prompt) for name, (plan, on) in plans.items()
    }
    predicted = {name: p.tokens_per_second for name, p in priced.items()}
    # Printed before the runs: a lent machine's time limit can cut the rounds short.
    for name, p in priced.items():
        parts = ", ".join(
            f"compute {s.compute_seconds * 1e3:.1f} + collectives {s.collective_seconds * 1e3:.1f}"
            for s in p.stages
        )
        print(
            f"  predicted {name} on {list(plans[name][1])}: {p.tokens_per_second:.3f} tok/s "
            f"(ms per token: {parts}; hops {p.hop_seconds * 1e3:.1f})",
            file=sys.stderr,
        )

    # The planner's choice is usually one of the other plans: the same launch, measured once
    # (two runs of one command differ only by the machine's drift between them).
    def launch_key(plan: PipelinePlan, on: tuple[int, ...]) -> tuple[object, ...]:
        weights = tuple(round(w, 6) for s in plan.stages for w in s.tp.weights)
        return weights, tuple(stage_args(plan)), tuple(device_factor[d] for d in on)

    chosen = launch_key(*plans["planner"])
    same = next((n for n, p in plans.items() if n != "planner" and launch_key(*p) == chosen), None)
    runs = {
        name: (
            lambda plan=plan, on=on: decode_tps(
                model, plan, [device_factor[d] for d in on], args.tokens
            )
        )
        for name, (plan, on) in plans.items()
        if not (name == "planner" and same)
    }
    measured = alternating(runs, args.rounds, state, scope)
    if same:
        measured["planner"] = measured[same]
    return measured, predicted, same


def plan_rows(
    plans: dict[str, tuple[PipelinePlan, tuple[int, ...]]],
    measured: dict[str, float],
    predicted: dict[str, float],
) -> dict[str, dict[str, object]]:
    return {
        n: {
            "measured": round(measured[n], 3),
            "predicted": round(predicted[n], 3),
            "measured_over_predicted": round(measured[n] / predicted[n], 3),
            # each stage's TP shares, stage after stage (the planner's may differ from the
            # speeds' proportions: it balances what each device reads its own shard at)
            "shares": [round(w, 3) for stage in plan.stages for w in stage.tp.weights],
        }
        for n, (plan, _) in plans.items()
    }


def gains(measured: dict[str, float], ideal: float) -> dict[str, float]:
    """Uneven over even TP against its ``ideal``, and the planner's place among the plans."""
    gain = measured["uneven_tp"] / measured["even_tp"]
    return {
        "uneven_over_even": round(gain, 3),
        "ideal_uneven_over_even": round(ideal, 3),
        "fraction_of_ideal_gain": round((gain - 1) / (ideal - 1), 3),
        # plans measured faster than the planner's (its own twin is not one of them)
        "planner_rank": 1 + sum(v > measured["planner"] for v in measured.values()),
        "planner_over_best": round(measured["planner"] / max(measured.values()), 3),
    }


def print_result(heading: str, result: dict[str, Any]) -> None:
    """One setup's plans, measured against predicted, and the gains."""
    print(f"{heading} (planner's rank {result['planner_rank']})")
    print(f"  {'plan':>12} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for name, r in result["plans"].items():
        print(
            f"  {name:>12} {r['measured']:>9.2f} {r['predicted']:>9.2f} "
            f"{r['measured_over_predicted']:>6.2f}"
        )
    print(
        f"  uneven/even {result['uneven_over_even']:.2f} (ideal "
        f"{result['ideal_uneven_over_even']:.2f}: {result['fraction_of_ideal_gain']:.0%} "
        f"of the ideal gain)",
        flush=True,
    )


def plans_for(
    model: Path, factor: float, args: argparse.Namespace, link: LinkCost
) -> dict[str, object]:
    spec = load_spec(model)
    fast, slow = profile_together([1.0, factor], args)
    base = cluster_from_profiles(spec, [fast, slow])
    cluster = Cluster(devices=base.devices, links=(Link(a=0, b=1, cost=link),), default_link=link)
    speeds = [d.speed for d in cluster.devices]
    context, prompt = window(args)
    choice = choose_plan(spec, cluster, context_tokens=context, prompt_tokens=prompt)
    device_factor = [1.0, factor]
    plans: dict[str, tuple[PipelinePlan, tuple[int, ...]]] = {
        "fast_alone": (single_stage(plan_tensor_parallel(spec, [1])), (0,)),
        "even_tp": (single_stage(plan_tensor_parallel(spec, [1, 1])), (0, 1)),
        "uneven_tp": (single_stage(plan_tensor_parallel(spec, speeds)), (0, 1)),
        "pipeline": (
            plan_pipeline(spec, [[1], [1]], split_layers(spec.num_layers, speeds)),
            (0, 1),
        ),
        "planner": (choice.best.plan, tuple(choice.best.devices)),
    }
    measured, predicted, same = measure_plans(model, plans, device_factor, cluster, args)
    return {
        "bench_speed_ratio": speeds[0] / speeds[1],
        "planner_choice": choice.best.kind,
        "planner_plan_is": same,
        "plans": plan_rows(plans, measured, predicted),
        **gains(measured, ideal=(1 + factor) / 2),
    }


def run_plans(args: argparse.Namespace) -> dict[str, object]:
    model = resolve_model(args.model)
    link = measure_link()
    out: dict[str, object] = {}
    for factor in args.factors:
        print(f"s = {factor:g}", file=sys.stderr, flush=True)
        result = plans_for(model, factor, args, link)
        out[f"{factor:g}"] = result
        print_result(
            f"s = {factor:g}: bench ratio {result['bench_speed_ratio']:.2f}, planner chose "
            f"{result['planner_choice']}",
            result,
        )
    return {
        "mode": "plans",
        "tokens": args.tokens,
        "rounds": args.rounds,
        "factors": out,
        "link_latency_us": round(link.latency * 1e6, 1),
    }


def run_validate(args: argparse.Namespace) -> dict[str, object]:
    model = resolve_model(args.model)
    spec = load_spec(model)
    alone = single_stage(plan_tensor_parallel(spec, [1]))
    out = {}
    for factor in args.factors:
        ratios = []
        for _ in range(args.rounds):
            base = decode_tps(model, alone, [1.0], args.tokens)
            slow = decode_tps(model, alone, [factor], args.tokens)
            ratios.append(base / slow)
        ratio = statistics.median(ratios)
        out[f"{factor:g}"] = {
            "slowdown": round(ratio, 3),
            "within_10_percent": abs(ratio / factor - 1) <= 0.1,
        }
        print(
            f"s = {factor:g}: decode {ratio:.2f}x slower (rounds {[round(r, 2) for r in ratios]})"
        )
    return {"mode": "validate", "tokens": args.tokens, "factors": out}


def _stream_load(
    url: str, model: str, stop: threading.Event, tokens: list[tuple[float, int]], errors: list[str]
) -> None:
    body = json.dumps(
        {
            "model": model,  # the cluster's own: another name would make it load that one
            "temperature": 0,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
        }
    ).encode()
    while not stop.is_set():
        request = urllib.request.Request(
            url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                usage = json.loads(response.read())["usage"]
            tokens.append((time.monotonic(), usage["completion_tokens"]))
        except OSError as error:
            errors.append(str(error))


def _tps(tokens: list[tuple[float, int]], start: float, stop: float) -> float:
    return sum(n for at, n in tokens if start < at <= stop) / (stop - start)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _start_cluster(
    args: argparse.Namespace, files: list[Path], profile: Path, port: int, log: IO[str]
) -> subprocess.Popen[bytes]:
    """`exo-tp run --local-nodes 2`, one TP stage, rebalancing on, node i's factor from
    ``files[i]``. It plans its shares at start-up as a user's cluster does from its cached
    profile: from the machine's profile measured at factor 1 (``profile``, by `exo-tp bench`),
    scaled by each node's factor as its file holds it then. Not --no-bench: with nothing
    cached, every node would count as average speed, and a fresh cluster at s would start from
    even shares; and not the user's cache (a profile written there changes the shares of every
    later --no-bench cluster on this machine, the tests' included)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exo_tp",
            "run",
            "--local-nodes",
            "2",
            "--api-port",
            str(port),
            "--model",
            args.model,
            "--profile",
            str(profile),
            "--stages",
            "2",
            "--rebalance",
            "on",
            "--stall-timeout",  # pinned ranks on a busy machine can starve for a minute
            "300",
            "--work-factor-file",
            ",".join(map(str, files)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env(),
        start_new_session=True,
    )


def _stop_cluster(cluster: subprocess.Popen[bytes]) -> None:
    os.killpg(cluster.pid, 15)
    cluster.wait(timeout=30)


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            if _get(url + "/health")["state"] == "ready":
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the cluster did not become ready")
        time.sleep(1)


class _Load:
    """8 greedy streams, each sending its next request as soon as the last one ends."""

    def __init__(self, url: str, model: str):
        self.stop = threading.Event()
        self.tokens: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(
                target=_stream_load, args=(url, model, self.stop, self.tokens, self.errors)
            )
            for _ in range(8)
        ]
        for t in self._threads:
            t.start()

    def end(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=600)


def _balance(plan: dict) -> dict[str, object]:
    """The leader's live view in a /v1/plan answer: the imbalance, node 0's smoothed probe
    speed over node 1's (what a re-plan follows; s would match the lab's factor), and whether
    it is re-planning."""
    balance = plan.get("balance") or {}
    speeds = {r["node_id"]: r.get("speed_bytes_per_second") for r in balance.get("ranks", [])}
    fast, slow = speeds.get("local-0"), speeds.get("local-1")
    ratio = fast / slow if fast and slow else None
    imbalance = balance.get("imbalance")
    return {
        "imbalance": round(imbalance, 3) if imbalance is not None else None,
        "live_speed_ratio": round(ratio, 3) if ratio is not None else None,
        "draining": balance.get("state") == "draining",
    }


def _fresh(
    args: argparse.Namespace,
    files: list[Path],
    profile: Path,
    port: int,
    window: float,
    log: IO[str],
) -> dict[str, object]:
    """A fresh cluster started with the slow node already at its new factor: what the re-plan
    should reach. Same flags, load and window as the first cluster's "before"."""
    cluster = _start_cluster(args, files, profile, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url)
        first = _get(url + "/v1/plan")
        load = _Load(url, args.model)
        t0 = time.monotonic()
        time.sleep(window)  # a bench: measuring a window of throughput, not waiting on state
        tps = _tps(load.tokens, t0, t0 + window)
        last = _get(url + "/v1/plan")
        load.end()
    finally:
        _stop_cluster(cluster)
    return {
        "tokens_per_second": tps,
        "shares": first["plan"]["weights"],
        # a re-plan of its own during the window (its live speeds disagreed with its start-up
        # profile) would make it no longer the fresh plan
        "replanned": last["epoch"] != first["epoch"] or bool(_balance(last)["draining"]),
        "balance": _balance(last),
        "failed_requests": len(load.errors),
        "failures": load.errors[:3],
    }


def run_rebalance(args: argparse.Namespace) -> dict[str, object]:
    factor = args.factors[-1]
    window = 20.0 if args.quick else 60.0
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        files = [Path(tmp) / "f0", Path(tmp) / "f1"]
        for f in files:
            write_factor_file(f, 1.0)
        measured = profile(1.0, CORES[0], Path(tmp) / "home", args)
        machine = Path(tmp) / "profile.json"
        machine.write_text(measured.model_dump_json())
        port = 24000 + os.getpid() % 2000
        log_path = Path(tempfile.gettempdir()) / f"hetero-lab-rebalance-{os.getpid()}.log"
        print(f"cluster log: {log_path}", file=sys.stderr, flush=True)
        log = stack.enter_context(log_path.open("w"))
        cluster = _start_cluster(args, files, machine, port, log)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url)
            plan0 = _get(url + "/v1/plan")
            epoch0, shares_before = plan0["epoch"], plan0["plan"]["weights"]
            load = _Load(url, args.model)
            t0 = time.monotonic()
            time.sleep(window)  # a bench: measuring a window of throughput, not waiting on state
            before = _tps(load.tokens, t0, t0 + window)
            write_factor_file(files[1], factor)
            changed = time.monotonic()
            replanned = None
            while time.monotonic() - changed < 600:
                plan = _get(url + "/v1/plan")
                if plan["epoch"] != epoch0 and plan["state"] == "ready":
                    replanned = time.monotonic()
                    break
                time.sleep(0.5)
            slowed = _tps(load.tokens, changed, replanned or time.monotonic())
            time.sleep(window)
            after = _tps(load.tokens, replanned or changed, time.monotonic())
            plan = _get(url + "/v1/plan")
            shares, balance_after = plan["plan"]["weights"], _balance(plan)
            load.end()
        finally:
            _stop_cluster(cluster)
        print("fresh cluster at the new factor", file=sys.stderr, flush=True)
        fresh = _fresh(args, files, machine, port + 2, window, log)  # files[1] holds the new factor
    fresh_tps = float(fresh["tokens_per_second"])  # type: ignore[arg-type]
    ratio = after / fresh_tps if fresh_tps > 0 else None
    result = {
        "mode": "rebalance",
        "factor": factor,
        "window_seconds": window,
        "tokens_per_second_before": round(before, 3),
        "tokens_per_second_slowed": round(slowed, 3),
        "tokens_per_second_after_replan": round(after, 3),
        "replan_seconds": round(replanned - changed, 1) if replanned else None,
        "shares_before": shares_before,
        "shares_after": shares,
        "balance_after": balance_after,
        "tokens_per_second_fresh": round(fresh_tps, 3),
        "shares_fresh": fresh["shares"],
        "fresh_replanned": fresh["replanned"],
        "fresh_balance": fresh["balance"],
        "after_replan_over_fresh": round(ratio, 3) if ratio is not None else None,
        "failed_requests": len(load.errors),
        "failures": load.errors[:3],
        "fresh_failed_requests": fresh["failed_requests"],
        "fresh_failures": fresh["failures"],
    }
    live_after = balance_after["live_speed_ratio"]
    live_fresh = fresh["balance"]["live_speed_ratio"]  # type: ignore[index]
    print(
        f"s 1 -> {factor:g}: {before:.2f} tok/s before (shares {shares_before}), {slowed:.2f} "
        f"slowed, {after:.2f} after re-planning in {result['replan_seconds']} s (shares "
        f"{shares}); fresh cluster at s: {fresh_tps:.2f} (shares {fresh['shares']}"
        f"{', re-planned itself' if fresh['replanned'] else ''}), after/fresh "
        f"{result['after_replan_over_fresh']}; live speed ratio {live_after} after, "
        f"{live_fresh} fresh; {len(load.errors)} + {fresh['failed_requests']} failed"
    )
    return result


def run_mixed(args: argparse.Namespace) -> dict[str, object]:
    """3-6 ranks with mixed factors (a many-core machine: one core per rank). Each distinct
    factor is profiled once by `exo-tp bench`; every pair of ranks gets the measured link."""
    model = resolve_model(args.model)
    spec = load_spec(model)
    widest = max(len(c) for c in args.clusters)
    if widest > len(CORES):
        raise SystemExit(f"{widest} ranks need {widest} cores; this machine lends {len(CORES)}")
    state = LabState(args.state)
    distinct = sorted({f for c in args.clusters for f in c})

    def profile_all() -> Profiles:
        measured = profile_together(distinct, args)
        return Profiles(by_factor=dict(zip(distinct, measured, strict=True)))

    kept = state.kept("profiles", Profiles, profile_all).by_factor
    if missing := [f for f in distinct if f not in kept]:
        raise SystemExit(f"--state {args.state} was profiled for other factors (not {missing})")
    profiles = {f: kept[f] for f in distinct}
    print(f"profiled factors {distinct}", file=sys.stderr, flush=True)
    link = state.kept("link", LinkCost, measure_link)
    out: dict[str, object] = {}
    for factors in args.clusters:
        name = ",".join(f"{f:g}" for f in factors)
        print(f"factors {name}", file=sys.stderr, flush=True)
        base = cluster_from_profiles(spec, [profiles[f] for f in factors])
        cluster = Cluster(devices=base.devices, default_link=link)
        speeds = [d.speed for d in cluster.devices]
        everyone = tuple(range(len(factors)))
        fastest = tuple(i for i, f in enumerate(factors) if f == min(factors))
        context, prompt = window(args)
        choice = choose_plan(spec, cluster, context_tokens=context, prompt_tokens=prompt)
        plans: dict[str, tuple[PipelinePlan, tuple[int, ...]]] = {
            "fastest_only": (
                single_stage(plan_tensor_parallel(spec, [1] * len(fastest))),
                fastest,
            ),
            "even_tp": (single_stage(plan_tensor_parallel(spec, [1] * len(factors))), everyone),
            "uneven_tp": (single_stage(plan_tensor_parallel(spec, speeds)), everyone),
            "planner": (choice.best.plan, tuple(choice.best.devices)),
        }
        measured, predicted, same = measure_plans(
            model, plans, list(factors), cluster, args, state, f"{args.model} x{args.tokens} {name}"
        )
        # Even TP runs at the slowest rank's pace; ideal uneven TP at the summed speeds.
        ideal = max(factors) * sum(1 / f for f in factors) / len(factors)
        result = {
            "planner_choice": choice.best.kind,
            "planner_devices": list(choice.best.devices),
            "planner_plan_is": same,
            "uneven_shares": [round(w, 3) for w in plans["uneven_tp"][0].stages[0].tp.weights],
            "plans": plan_rows(plans, measured, predicted),
            **gains(measured, ideal),
        }
        out[name] = result
        print_result(
            f"factors {name}: planner chose {choice.best.kind} on {list(choice.best.devices)}",
            result,
        )
    return {
        "mode": "mixed",
        "tokens": args.tokens,
        "rounds": args.rounds,
        "cores": len(CORES),
        "clusters": out,
        "link_latency_us": round(link.latency * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=("plans", "validate", "rebalance", "mixed"), default="plans"
    )
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--factors", default="1.5,2,3")
    parser.add_argument(
        "--clusters",
        default="1,1.5,2;1,1,2,3;1,1,1.5,1.5,2,3",
        help="mixed: each cluster's rank factors, clusters apart by ';'",
    )
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="check the lab runs (tiny settings)")
    parser.add_argument(
        "--state",
        type=Path,
        help="mixed: keep the profiles, the link and each run's tokens/s here, and reuse them",
    )
    args = parser.parse_args()
    args.factors = [float(f) for f in args.factors.split(",")]
    args.clusters = [[float(f) for f in c.split(",")] for c in args.clusters.split(";") if c]
    if args.quick:
        args.factors, args.tokens, args.rounds = [2.0], 6, 1
        args.clusters = [c for c in args.clusters if len(c) <= len(CORES)] or [[1.0, 2.0]]
    if len(CORES) < 2:
        raise SystemExit("the lab needs two cores")
    run = {
        "plans": run_plans,
        "validate": run_validate,
        "rebalance": run_rebalance,
        "mixed": run_mixed,
    }[args.mode]
    # --quick: SmolLM2's float32 decode steps made each launch seconds longer; a random
    # model with its tokenizer takes every path of the lab at a fraction of the compute.
    args.model = model_arg(args.model, args.quick)
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
