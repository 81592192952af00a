"""Replicas against one tensor-parallel group on the same nodes (issue #59 point 7), in one run.

Two local nodes (`exo-tp run --local-nodes 2 --weights 1,1 --no-bench`) serve the same model
first as one TP group over both nodes (`--replicas 1`), then as 2 replicas of one node each
(`--replicas 2`, a router sending each request to the least loaded), one cluster at a time.
On each, after a warm-up, it measures:

- one stream alone: tokens/s over its wall time, decode ms per token (first text chunk to last);
- ``--streams`` concurrent streaming chats (aiohttp, greedy, ``--max-tokens`` each, distinct
  prompts): aggregate completion tokens/s over the wall time, TTFT p50 / p90, and the most
  requests each group held at once (polled from /v1/cluster: whether the router spread them);
  both ``--rounds`` times, medians;
- load on demand: a second model (another depth, so another key) in a ``--models-dir`` folder,
  named by its folder path: seconds from the first request to its first token, retried every
  0.2 s while the cluster answers 503 (codes and Retry-After reported, not waited out), with
  main-model requests back to back beside it (all must succeed, the main groups keep their
  nodes). ``--quick``: on the replicas cluster only.

Readiness: /v1/cluster's pinned groups, as many as replicas, all ``ready``. Both clusters run
with ``--max-concurrency`` = ``--streams`` (one group batches them all) and a 300 s stall timeout.

The planner's pick (`exo-tp plan --replicas --json --objective latency|throughput --queue S`
on two equal synthetic profiles, or two ``--profile``) against the layout measured faster
(throughput: higher aggregate tokens/s; latency: lower single-stream ms per token).

Model: a tiny random SmolLM2-shaped one (bench/_common.py's ``tiny_model``, end rows zeroed: no
stream ends early) or ``--model``; the second is tiny, 2 layers (3 if the main one has 2).

    python bench/replicas.py [--model M] [--streams 16] [--max-tokens 64] [--rounds 3]
        [--profile a.json --profile b.json] [--logs DIR] [--quick]

``--quick``: 4 streams, 8 tokens, 1 round. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from _common import ROOT, env, resolve, tiny_model
from serving import Server, Stream, api_port, client_session, log, prompts, run_level, stream_chat

NODES = 2
LAYOUTS = (1, 2)  # --replicas of each cluster, in turn
NAMES = {1: "one_group", 2: "replicas"}
RETRY = 0.2  # seconds between tries of a model that loads
HEADER = "| layout | 1 stream tok/s | ms/token | {} streams tok/s | TTFT p50 s | TTFT p90 s "
HEADER += "| load on demand s | errors |"
LOG_WORDS = ("Traceback", "ERROR", "CRITICAL", "WARNING")
# Log lines that are part of the measurement: the 503s of a model that loads; zeroconf
# announcements of other clusters on this machine.
EXPECTED = ("with 503: loading the model", "with 503: cluster not ready", "ignored announcement")
# The synthetic devices the planner is asked about: the headline figures of `exo-tp bench
# --quick` on the 2-core VM of docs/benchmarks.md (rounded), one core each, memory ample.
SYNTHETIC = {
    **{"chip": "synthetic cpu", "cores": 1, "mlx_version": "0", "mlx_device": "cpu"},
    **{"memory_total": 16 * 10**9, "memory_available": 8 * 10**9, "backends": ("ring",)},
    **{"memory_bandwidth": 2.7e9, "decode_seconds_per_byte": 6.3e-10, "prefill_flops": 1.4e9},
    "layer_overhead_seconds": 1e-3,
}


def cluster(args: argparse.Namespace, replicas: int, models_dir: Path, logs: Path) -> Server:
    port = api_port(NODES)
    command = [
        *(sys.executable, "-m", "exo_tp", "run", "--local-nodes", str(NODES)),
        *("--weights", ",".join(["1"] * NODES), "--model", args.model, "--no-bench"),
        *("--replicas", str(replicas), "--models-dir", str(models_dir)),
        *("--api-port", str(port), "--max-concurrency", str(args.streams)),
        *("--stall-timeout", "300"),
    ]
    return Server(NAMES[replicas], [(command, env())], port, args.model, logs)


async def groups(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """/v1/cluster's groups ([] while the API is not up)."""
    try:
        async with session.get(f"{url}/v1/cluster") as response:
            return list((await response.json()).get("groups", [])) if response.ok else []
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
        return []


async def wait_groups(server: Server, count: int, timeout: float) -> list[dict[str, Any]]:
    """The main model's groups once there are ``count``, every one ready."""
    start = time.perf_counter()
    async with client_session(read_timeout=10) as session:
        while time.perf_counter() - start < timeout:
            if gone := server.exited():
                raise RuntimeError(f"{gone}; its log ends:\n{server.log_tail()}")
            main = [g for g in await groups(session, server.url) if g["pinned"]]
            if len(main) == count and all(g["state"] == "ready" for g in main):
                log(f"{server.name}: {count} group(s) ready in {time.perf_counter() - start:.0f} s")
                return main
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.name}: not ready in {timeout:.0f} s:\n{server.log_tail()}")


async def peak_load(server: Server, done: asyncio.Event) -> dict[str, int]:
    """The most requests (running and waiting) each main group held while ``done`` was unset."""
    peak: dict[str, int] = {}
    async with client_session(read_timeout=10) as session:
        while not done.is_set():
            for g in await groups(session, server.url):
                if g["pinned"]:
                    name = g["group"] or "main"
                    peak[name] = max(peak.get(name, 0), g["in_flight"] + g["waiting"])
            await asyncio.sleep(0.3)
    return peak


def med(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 3) if kept else None


def ms_per_token(stream: Stream) -> float | None:
    if len(stream.chunks) < 2 or stream.completion_tokens < 2:
        return None
    return 1e3 * (stream.chunks[-1] - stream.chunks[0]) / (stream.completion_tokens - 1)


def failures(streams: list[Stream]) -> list[str]:
    return [s.error or "no text" for s in streams if s.error or not s.chunks]


async def levels(server: Server, args: argparse.Namespace, streams: int, seed: int) -> dict:
    """``streams`` concurrent chats, ``args.rounds`` times: medians of the rounds' aggregate
    tokens/s, decode ms per token, TTFT p50 / p90; each round's peak load per group."""
    rates, per_token, p50, p90, errors, peaks = [], [], [], [], [], []
    source = prompts(seed)
    async with client_session(args.read_timeout) as session:
        for _ in range(args.rounds):
            done = asyncio.Event()
            watch = asyncio.create_task(peak_load(server, done))
            level = await run_level(session, server, streams, 1, args.max_tokens, source)
            done.set()
            peaks.append(await watch)
            errors += failures(level.results)
            rates.append(sum(s.completion_tokens for s in level.ok()) / level.wall)
            per_token.append(med([ms_per_token(s) for s in level.ok()]))
            if ttft := [s.ttft for s in level.ok() if s.ttft is not None]:
                p50.append(float(np.percentile(ttft, 50)))
                p90.append(float(np.percentile(ttft, 90)))
            said = f"{p50[-1]:.3f} s" if ttft else "-"
            log(f"{server.name}: {streams} stream(s): {rates[-1]:.1f} tok/s, TTFT p50 {said}")
    return {
        **{"tps": med(rates), "ms_per_token": med(per_token)},
        **{"ttft_p50_s": med(p50), "ttft_p90_s": med(p90)},
        **{"peak_requests_per_group": peaks, "errors": errors},
    }


def text_of(raw: bytes) -> str:
    """The text a server-sent chat chunk carries ("" for any other line)."""
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return ""
    choices = json.loads(line[len("data:") :]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def first_token(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> dict:
    """Seconds from the first request naming ``model`` to its first token, retrying its 503s
    every ``RETRY`` s; how many 503s of each code and Retry-After."""
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "temperature": 0.0}
    body.update(messages=[{"role": "user", "content": "Tell me a story."}], stream=True)
    start, refused = time.perf_counter(), {}  # type: ignore[var-annotated]
    while time.perf_counter() - start < 600:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status == 503:
                code = ((await response.json()).get("error") or {}).get("code")
                said = f"{code}, Retry-After {response.headers.get('Retry-After')}"
                refused[said] = refused.get(said, 0) + 1
                await asyncio.sleep(RETRY)
                continue
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.text())[:200]}"}
            async for raw in response.content:
                if text_of(raw):
                    seconds = time.perf_counter() - start
                    await response.read()  # the rest of the stream
                    return {"ttft_s": round(seconds, 3), "refused_503": refused}
            return {"error": "the stream ended without text"}
    return {"error": "no token in 600 s", "refused_503": refused}


async def beside(server: Server, args: argparse.Namespace, done: asyncio.Event) -> list[Stream]:
    """Main-model requests back to back until ``done`` (it stays served while another loads)."""
    out, source = [], prompts(seed=10_000)
    async with client_session(args.read_timeout) as session:
        while not done.is_set():
            messages = [{"role": "user", "content": next(source)}]
            out.append(await stream_chat(session, server, messages, args.max_tokens))
    return out


async def load_on_demand(server: Server, args: argparse.Namespace, second: Path) -> dict:
    async with client_session(args.read_timeout) as session:
        before = await groups(session, server.url)
        done = asyncio.Event()
        main = asyncio.create_task(beside(server, args, done))
        got = await first_token(session, server.url, str(second), args.max_tokens)
        done.set()
        served = await main
        after = await groups(session, server.url)
    ranks = {g["group"]: g["ranks"] for g in before if g["pinned"]}
    kept = ranks == {g["group"]: g["ranks"] for g in after if g["pinned"]}
    loaded = [g for g in after if g["model"] == str(second)]
    got.update(
        main_requests_beside=len(served),
        main_errors_beside=failures(served),
        main_groups_kept_nodes=kept,
        second_groups=[{k: g[k] for k in ("group", "state", "ranks")} for g in loaded],
    )
    log(f"{server.name}: load on demand {got}")
    return got


def log_findings(server: Server, start: int, end: int) -> list[str]:
    """The lines of the cluster log's bytes ``start:end`` (this run's, before it was stopped:
    the workers it stops say they exited) that say something went wrong."""
    lines = server.log_path.read_bytes()[start:end].decode(errors="replace").splitlines()
    found = [line for line in lines if any(w in line for w in LOG_WORDS)]
    return [line[:300] for line in found if not any(e in line for e in EXPECTED)]


async def measure(args: argparse.Namespace, replicas: int, second: Path, logs: Path) -> dict:
    server = cluster(args, replicas, second.parent, logs)
    log(f"{server.name}: starting `exo-tp run --local-nodes {NODES} --replicas {replicas}`")
    start = server.log_path.stat().st_size if server.log_path.exists() else 0  # a kept --logs
    with server:
        ready = await wait_groups(server, replicas, args.ready_timeout)
        source = prompts(seed=0)
        async with client_session(args.read_timeout) as session:  # warm every group
            await run_level(session, server, 2 * replicas, 1, 4, source)
        out: dict[str, Any] = {"groups": [{k: g[k] for k in ("group", "ranks")} for g in ready]}
        out["single"] = await levels(server, args, 1, seed=1000)
        out["streams"] = await levels(server, args, args.streams, seed=2000)
        if replicas == LAYOUTS[-1] or not args.quick:
            out["load_on_demand"] = await load_on_demand(server, args, second)
        end = server.log_path.stat().st_size
    out["log_findings"] = log_findings(server, start, end)
    for line in out["log_findings"][:10]:
        log(f"  {server.name} log: {line}")
    return out


def profiles(args: argparse.Namespace, folder: Path) -> list[Path]:
    """Two equal synthetic device profiles (or the ``--profile`` files)."""
    if args.profile:
        return [Path(p) for p in args.profile]
    sys.path.insert(0, str(ROOT))
    from exo_tp.plan.devices import DeviceProfile

    paths = [folder / f"{name}.json" for name in "ab"]
    for path in paths:
        path.write_text(DeviceProfile(node_id=path.stem, **SYNTHETIC).model_dump_json())
    return paths


def layout(option: dict[str, Any]) -> tuple[str, int]:
    """A planner layout's name, and the nodes a lone stream runs on (its fastest replica's)."""
    nodes = [sum(map(len, c["best"]["groups"])) for c in option["choices"]]
    if len(nodes) > 1:
        return NAMES.get(len(nodes), f"{len(nodes)}_replicas"), max(nodes)
    return ("one_group" if nodes[0] == NODES else f"one_group_on_{nodes[0]}_node"), nodes[0]


def planner_picks(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, Any]]:
    """The layout the planner picks for each objective, why, and what it predicts of each."""
    flags = [f for p in profiles(args, folder) for f in ("--profile", str(p))]
    picks = {}
    for objective in ("latency", "throughput"):
        out = subprocess.run(
            [sys.executable, "-m", "exo_tp", "plan", *flags, "--model", args.model, "--replicas"]
            + ["--objective", objective, "--queue", str(args.streams), "--json"],
            **{"capture_output": True, "text": True, "check": True, "env": env()},
        )
        choice = json.loads(out.stdout.strip().splitlines()[-1])["groups"][0]["choice"]
        name, nodes = layout(choice["best"])
        predicted = {  # tokens/s at the priced streams, ms a token alone
            layout(o)[0]: [round(o["tokens_per_second"], 2), round(1e3 * o["decode_seconds"], 2)]
            for o in choice["options"]
        }
        picks[objective] = {"pick": name, "lone_stream_nodes": nodes, "predicted": predicted}
        picks[objective]["reason"] = choice["reason"]
        log(f"planner, {objective}: {choice['reason']}")
    return picks


def ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top is not None and bottom else None


def faster(one: float | None, two: float | None, higher: bool) -> str | None:
    """The layout faster by a figure measured on each (None: a figure is missing)."""
    if one is None or two is None:
        return None
    return NAMES[2] if (two > one if higher else two < one) else NAMES[1]


def verdicts(picks: dict[str, dict[str, Any]], runs: dict[int, dict]) -> dict[str, dict]:
    """Each objective's pick against the layout measured faster for it: for throughput the
    same layout; for latency the same number of nodes under a lone stream (one node alone
    decodes a lone stream as a replica does)."""
    one, two = runs[1], runs[2]
    best = {
        "throughput": faster(one["streams"]["tps"], two["streams"]["tps"], True),
        "latency": faster(one["single"]["ms_per_token"], two["single"]["ms_per_token"], False),
    }
    lone = {NAMES[1]: NODES, NAMES[2]: 1, None: None}
    matches = {
        "throughput": picks["throughput"]["pick"] == best["throughput"],
        "latency": picks["latency"]["lone_stream_nodes"] == lone[best["latency"]],
    }
    return {
        objective: {**pick, "measured_faster": best[objective], "matches": matches[objective]}
        for objective, pick in picks.items()
    }


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def errors(run: dict[str, Any]) -> int:
    """Requests of a layout that failed (main-model ones beside the load on demand too)."""
    beside = run.get("load_on_demand", {}).get("main_errors_beside", [])
    return len(run["single"]["errors"]) + len(run["streams"]["errors"]) + len(beside)


def print_table(args: argparse.Namespace, runs: dict[int, dict]) -> None:
    print(HEADER.format(args.streams) + "\n| --- " + "| ---: " * 7 + "|")
    for replicas, run in runs.items():
        one, many, load = run["single"], run["streams"], run.get("load_on_demand", {})
        print(
            f"| {NAMES[replicas]} | {fmt(one['tps'])} | {fmt(one['ms_per_token'], '.1f')} | "
            f"{fmt(many['tps'])} | {fmt(many['ttft_p50_s'], '.3f')} | "
            f"{fmt(many['ttft_p90_s'], '.3f')} | {fmt(load.get('ttft_s'))} | {errors(run)} |"
        )


RATIOS = {  # the JSON's name: where each layout's figure is
    "aggregate_tps": ("streams", "tps"),
    "ttft_p50": ("streams", "ttft_p50_s"),
    "single_stream_tps": ("single", "tps"),
    "single_stream_ms_per_token": ("single", "ms_per_token"),
}


def summary(args: argparse.Namespace, runs: dict[int, dict], picks: dict) -> dict[str, Any]:
    one, two = runs[1], runs[2]
    return {
        **{"model": args.model_label, "streams": args.streams, "max_tokens": args.max_tokens},
        "rounds": args.rounds,
        "replicas_over_one_group": {
            name: ratio(two[part][key], one[part][key]) for name, (part, key) in RATIOS.items()
        },
        "planner": verdicts(picks, runs),
        "load_on_demand_ttft_s": {
            NAMES[r]: run["load_on_demand"].get("ttft_s")
            for r, run in runs.items()
            if "load_on_demand" in run
        },
        "errors": sum(map(errors, runs.values())),
        "log_findings": {NAMES[r]: len(run["log_findings"]) for r, run in runs.items()},
        "runs": {NAMES[r]: run for r, run in runs.items()},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or name (default: a tiny random one)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="append", help="a device profile (twice) to plan on")
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--read-timeout", type=float, default=900)
    parser.add_argument("--logs", type=Path, help="keep the clusters' logs in this folder")
    parser.add_argument("--quick", action="store_true", help="4 streams, 8 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.max_tokens, args.rounds = 4, 8, 1
    if args.profile and len(args.profile) != NODES:
        parser.error(f"--profile: one per node ({NODES})")
    return args


def models(args: argparse.Namespace, scratch: Path) -> Path:
    """Sets ``args.model`` (a tiny one unless given); the second model's folder."""
    args.model_label = args.model or "a tiny random SmolLM2-shaped model"
    if args.model is None:
        args.model = str(tiny_model(scratch / "main"))
    elif Path(args.model).exists():  # the clusters start in the checkout's root
        args.model = str(Path(args.model).resolve())
    layers = json.loads((resolve(args.model) / "config.json").read_text())["num_hidden_layers"]
    return tiny_model(scratch / "library" / "second", num_hidden_layers=3 if layers == 2 else 2)


async def run(args: argparse.Namespace, second: Path, logs: Path) -> dict[int, dict]:
    return {replicas: await measure(args, replicas, second, logs) for replicas in LAYOUTS}


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwinds as Ctrl-C does
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        scratch = Path(tmp)
        logs = args.logs or scratch
        logs.mkdir(parents=True, exist_ok=True)
        second = models(args, scratch)
        picks = planner_picks(args, scratch)
        try:
            runs = asyncio.run(run(args, second, logs))
        except KeyboardInterrupt:
            log("interrupted: every cluster stopped")
            raise SystemExit(130) from None
    print_table(args, runs)
    result = summary(args, runs, picks)
    for objective, verdict in result["planner"].items():
        print(
            f"planner, {objective}: picks {verdict['pick']}, faster measured: "
            f"{verdict['measured_faster']} ({'match' if verdict['matches'] else 'MISMATCH'})"
        )
    result["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
