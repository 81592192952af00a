"""Replicas against one tensor-parallel group on the same nodes (issue #59 point 7), in one run.

Two local nodes (`exo-tp run --local-nodes 2 --weights 1,1 --no-bench`) serve the same model
first as one TP group over both nodes (`--replicas 1`), then as 2 replicas of one node each
(`--replicas 2`, a router sending each request to the least loaded), one cluster at a time.
On each, after a warm-up, it measures:

- one stream alone, ``--rounds`` times: tokens/s over the request's wall time and decode ms per
  token (first text chunk to last, over the tokens after the first), medians;
- ``--streams`` concurrent streaming chats (aiohttp, greedy, ``--max-tokens`` each, distinct
  prompts), ``--rounds`` times: aggregate completion tokens/s over the level's wall time, TTFT
  p50 / p90 (medians over the rounds), and the most requests each group held at once (polled
  from /v1/cluster: whether the router spread them);
- load on demand: a second model (another depth, so another key) in a ``--models-dir`` folder,
  named by its folder path: seconds from the first request to its first token, retried every
  0.2 s while the cluster answers 503 ``model_loading`` (its Retry-After is reported, not
  waited out), while main-model requests run back to back beside it (all must succeed, and the
  main groups must keep their nodes). ``--quick``: on the replicas cluster only.

Readiness is /v1/cluster's groups: as many as replicas, every one ``ready``. Every server
runs with ``--max-concurrency`` = ``--streams`` (one group batches them all) and a 300 s stall
timeout (a loaded 2-core VM can be slow over a step).

The planner's pick: `exo-tp plan --replicas --json --objective latency|throughput --queue S`
on two equal device profiles (synthetic, written here; ``--profile`` twice for real ones),
compared with the layout measured faster (throughput: the higher aggregate tokens/s; latency:
the lower single-stream ms per token).

Model: a tiny random SmolLM2-shaped checkpoint (bench/_common.py's ``tiny_model``: end rows
zeroed, so every stream decodes all its tokens), or ``--model`` (a folder or name). The second
model is always a tiny one, 2 layers (3 where the main model has 2).

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
from collections.abc import Iterator
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
LOG_WORDS = ("Traceback", "ERROR", "CRITICAL", "WARNING")


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
            main = [g for g in await groups(session, server.url) if g["model"] == server.model]
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
                if g["model"] == server.model:
                    name = g["group"] or "main"
                    peak[name] = max(peak.get(name, 0), g["in_flight"] + g["waiting"])
            await asyncio.sleep(0.3)
    return peak


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def med(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ms_per_token(stream: Stream) -> float | None:
    if len(stream.chunks) < 2 or stream.completion_tokens < 2:
        return None
    return 1e3 * (stream.chunks[-1] - stream.chunks[0]) / (stream.completion_tokens - 1)


def failures(streams: list[Stream]) -> list[str]:
    return [s.error or "no text" for s in streams if s.error or not s.chunks]


async def single(server: Server, args: argparse.Namespace, source: Iterator[str]) -> dict:
    rates, per_token, errors = [], [], []
    async with client_session(args.read_timeout) as session:
        for _ in range(args.rounds):
            level = await run_level(session, server, 1, 1, args.max_tokens, source)
            errors += failures(level.results)
            rates.append(sum(s.completion_tokens for s in level.ok()) / level.wall)
            per_token += [ms_per_token(s) for s in level.ok()]
    return {"tps": med(rates), "ms_per_token": med(per_token), "errors": errors}


async def concurrent(server: Server, args: argparse.Namespace, source: Iterator[str]) -> dict:
    rates, p50, p90, errors, peaks = [], [], [], [], []
    async with client_session(args.read_timeout) as session:
        for _ in range(args.rounds):
            done = asyncio.Event()
            watch = asyncio.create_task(peak_load(server, done))
            level = await run_level(session, server, args.streams, 1, args.max_tokens, source)
            done.set()
            peaks.append(await watch)
            errors += failures(level.results)
            rates.append(sum(s.completion_tokens for s in level.ok()) / level.wall)
            ttft = [s.ttft for s in level.ok() if s.ttft is not None]
            p50.append(pct(ttft, 50))
            p90.append(pct(ttft, 90))
            log(f"{server.name}: {args.streams} streams {rates[-1]:.1f} tok/s, TTFT p50 {p50[-1]}")
    return {
        "aggregate_tps": med(rates),
        "ttft_p50_s": med(p50),
        "ttft_p90_s": med(p90),
        "peak_requests_per_group": peaks,
        "errors": errors,
    }


def text_of(raw: bytes) -> str:
    """The text a server-sent chat chunk carries ("" for any other line)."""
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return ""
    choices = json.loads(line[len("data:") :]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def first_token(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> dict:
    """Seconds from the first request naming ``model`` to its first token, retrying its 503s."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        **{"max_tokens": tokens, "temperature": 0.0, "stream": True},
    }
    start, tries, retry_after = time.perf_counter(), 0, None
    while time.perf_counter() - start < 600:
        tries += 1
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status == 503:
                retry_after = response.headers.get("Retry-After", retry_after)
                await response.read()
                await asyncio.sleep(RETRY)
                continue
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.text())[:200]}"}
            async for raw in response.content:
                if text_of(raw):
                    seconds = time.perf_counter() - start
                    await response.read()  # the rest of the stream
                    return {"ttft_s": seconds, "tries": tries, "retry_after": retry_after}
            return {"error": "the stream ended without text"}
    return {"error": "no token in 600 s"}


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
    ranks = {g["group"]: g["ranks"] for g in before if g["model"] == server.model}
    kept = ranks == {g["group"]: g["ranks"] for g in after if g["model"] == server.model}
    loaded = [g for g in after if g["model"] == str(second)]
    got.update(
        main_requests_beside=len(served),
        main_errors_beside=failures(served),
        main_groups_kept_nodes=kept,
        second_groups=[{k: g[k] for k in ("group", "state", "ranks")} for g in loaded],
    )
    log(f"{server.name}: load on demand {got}")
    return got


def log_findings(server: Server) -> list[str]:
    """The cluster log's lines that say something went wrong."""
    text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
    return [line[:300] for line in text.splitlines() if any(w in line for w in LOG_WORDS)]


async def measure(args: argparse.Namespace, replicas: int, second: Path, logs: Path) -> dict:
    server = cluster(args, replicas, second.parent, logs)
    log(f"{server.name}: starting `exo-tp run --local-nodes {NODES} --replicas {replicas}`")
    with server:
        ready = await wait_groups(server, replicas, args.ready_timeout)
        source = prompts(seed=100 * replicas)
        async with client_session(args.read_timeout) as session:  # warm every group
            await run_level(session, server, 2 * replicas, 1, 4, source)
        out: dict[str, Any] = {"groups": [{k: g[k] for k in ("group", "ranks")} for g in ready]}
        out["single"] = await single(server, args, prompts(seed=1000 * replicas))
        log(f"{server.name}: 1 stream {out['single']}")
        out["streams"] = await concurrent(server, args, prompts(seed=2000 * replicas))
        if replicas == LAYOUTS[-1] or not args.quick:
            out["load_on_demand"] = await load_on_demand(server, args, second)
    out["log_findings"] = log_findings(server)
    for line in out["log_findings"][:10]:
        log(f"  {server.name} log: {line}")
    return out


def profiles(args: argparse.Namespace, folder: Path) -> list[Path]:
    """Two equal synthetic device profiles (or the ``--profile`` files)."""
    if args.profile:
        return [Path(p) for p in args.profile]
    sys.path.insert(0, str(ROOT))
    from exo_tp.plan.devices import DeviceProfile

    paths = []
    for name in ("a", "b"):
        profile = DeviceProfile(
            **{"node_id": name, "chip": "synthetic cpu", "cores": 1, "mlx_version": "0"},
            **{"mlx_device": "cpu", "memory_total": 16 * 10**9, "memory_available": 8 * 10**9},
            **{"backends": ("ring",), "memory_bandwidth": 5e9, "decode_seconds_per_byte": 2e-10},
            **{"prefill_flops": 2e10, "layer_overhead_seconds": 1e-3},
        )
        paths.append(folder / f"{name}.json")
        paths[-1].write_text(profile.model_dump_json())
    return paths


def planner_picks(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, Any]]:
    """Replicas the planner picks for each objective, and why."""
    flags = [f for p in profiles(args, folder) for f in ("--profile", str(p))]
    picks = {}
    for objective in ("latency", "throughput"):
        out = subprocess.run(
            [sys.executable, "-m", "exo_tp", "plan", *flags, "--model", args.model, "--replicas"]
            + ["--objective", objective, "--queue", str(args.streams), "--json"],
            **{"capture_output": True, "text": True, "check": True, "env": env()},
        )
        choice = json.loads(out.stdout.strip().splitlines()[-1])["groups"][0]["choice"]
        picks[objective] = {"replicas": len(choice["best"]["subsets"]), "reason": choice["reason"]}
        log(f"planner, {objective}: {choice['reason']}")
    return picks


def ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top is not None and bottom else None


def faster(one: float | None, two: float | None, higher: bool) -> int | None:
    """The replicas of the faster layout by a figure of each (None: a figure is missing)."""
    if one is None or two is None:
        return None
    return 2 if (two > one if higher else two < one) else 1


def verdicts(picks: dict[str, dict[str, Any]], runs: dict[int, dict]) -> dict[str, dict]:
    """Each objective's pick against the layout measured faster for it."""
    one, two = runs[1], runs[2]
    best = {
        "throughput": faster(
            one["streams"]["aggregate_tps"], two["streams"]["aggregate_tps"], True
        ),
        "latency": faster(one["single"]["ms_per_token"], two["single"]["ms_per_token"], False),
    }
    return {
        objective: {
            "pick": NAMES[pick["replicas"]] if pick["replicas"] in NAMES else pick["replicas"],
            "measured_faster": NAMES.get(best[objective] or 0),
            "matches": pick["replicas"] == best[objective],
        }
        for objective, pick in picks.items()
    }


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(args: argparse.Namespace, runs: dict[int, dict]) -> None:
    print(
        f"| layout | 1 stream tok/s | ms/token | {args.streams} streams tok/s | TTFT p50 s "
        "| TTFT p90 s | load on demand s | errors |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for replicas, run in runs.items():
        one, many, load = run["single"], run["streams"], run.get("load_on_demand", {})
        errors = len(one["errors"]) + len(many["errors"]) + len(load.get("main_errors_beside", []))
        print(
            f"| {NAMES[replicas]} | {fmt(one['tps'])} | {fmt(one['ms_per_token'], '.1f')} | "
            f"{fmt(many['aggregate_tps'])} | {fmt(many['ttft_p50_s'], '.3f')} | "
            f"{fmt(many['ttft_p90_s'], '.3f')} | {fmt(load.get('ttft_s'))} | {errors} |"
        )


def summary(args: argparse.Namespace, runs: dict[int, dict], picks: dict) -> dict[str, Any]:
    one, two = runs[1], runs[2]
    return {
        "model": args.model_label,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "replicas_over_one_group": {
            "aggregate_tps": ratio(
                two["streams"]["aggregate_tps"], one["streams"]["aggregate_tps"]
            ),
            "ttft_p50": ratio(two["streams"]["ttft_p50_s"], one["streams"]["ttft_p50_s"]),
            "single_stream_tps": ratio(two["single"]["tps"], one["single"]["tps"]),
            "single_stream_ms_per_token": ratio(
                two["single"]["ms_per_token"], one["single"]["ms_per_token"]
            ),
        },
        "planner": verdicts(picks, runs),
        "load_on_demand_ttft_s": {
            NAMES[r]: run["load_on_demand"].get("ttft_s")
            for r, run in runs.items()
            if "load_on_demand" in run
        },
        "errors": sum(
            len(run["single"]["errors"]) + len(run["streams"]["errors"]) for run in runs.values()
        ),
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
    layers = json.loads((resolve(args.model) / "config.json").read_text())["num_hidden_layers"]
    return tiny_model(scratch / "library" / "second", num_hidden_layers=3 if layers == 2 else 2)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def run(args: argparse.Namespace, second: Path, logs: Path) -> dict[int, dict]:
    return {replicas: await measure(args, replicas, second, logs) for replicas in LAYOUTS}


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # unwinds like Ctrl-C: every cluster stopped
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
