"""Serving many users at once: exo-tp against mlx_lm.server, measured side by side in one run.

Streaming clients (aiohttp, OpenAI chat completions, greedy, fixed ``max_tokens``) hit each
server at 1, 4 and 16 concurrent streams; every client sends its requests back to back, every
request has a distinct prompt (lengths vary). Per contender and stream count it reports:

- aggregate tokens/s: the completion tokens of every stream (from ``usage``) over the wall time
  of the whole level (first request sent to last stream done; prefill included, as clients see);
- p50 / p95 time to first token (request sent to the first chunk with text);
- p50 inter-token latency (gaps between successive text chunks of a stream, all streams pooled).

Contenders, each started and stopped in turn (one server at a time, private ports):

  ceiling  no server: one process's forward step at batch 1, 4, 16 (mlx-lm, SmolLM2), i.e. the
     most batching can give on this machine (on MLX's CPU build a step at batch B costs about
     B times one at batch 1, so no server batches usefully here; Apple-silicon GPUs do)
  step  no server: exo-tp's conductor step at batch 16 in one process (its batch, per-row
     sampling, token events serialized as for the wire, detokenizing), on SmolLM2 and on a
     1-layer, 64-wide model with SmolLM2's vocabulary: the second's step is nearly all time
     outside the model's compute, so its share of the first is the step overhead (target < 5%)
  a  mlx_lm.server in one process, SmolLM2 (its defaults: --decode-concurrency 32 ...)
  b  mlx_lm.server in its own distributed mode (tensor parallel) on 2 ranks, MLX ring backend,
     a random llama with SmolLM2's dimensions but 8 query / 2 KV heads (mlx-lm refuses a split
     of SmolLM2's 9 / 3 heads over 2 ranks), written at start with mlx-lm's own classes and the
     SmolLM2 tokenizer (bench/_common.py's write_model) in a temporary folder
  c  exo-tp on the same 2 ranks and the same random model
     (`exo-tp run --local-nodes 2 --weights 1,1 --dtype float32`)
  d  exo-tp on SmolLM2 (float32), 2 ranks
  p  exo-tp as a pipeline of 2 stages of 1 rank each (`--stages 1,1`, SmolLM2, float32),
     one micro-batch per stage in flight (overlapped stages, the default)
  q  the same pipeline with one batch in flight across the stages (`--no-overlap`); with p, the
     bench also times one core's decode step (one BLAS thread, as a stage's rank has) at half
     the top stream count and at the top: overlapping two micro-batches of half the streams can
     gain at most the ratio of those steps on decode steps
     (``pipeline_overlap_decode_bound_at_top`` in the JSON line; prefill steps, which cost
     about their token count, can overlap to nearly 2x)
  chat  a multi-turn chat on exo-tp (SmolLM2, 2 ranks): a long system prompt, then each turn
     appends the previous answer and a new user message; every turn's time to first token with
     the prompt cache (the server's default) and without it (`--prompt-cache-size 0`), on the
     same conversation (the cached run replays the uncached run's answers, and reports whether
     its own greedy answers were the same)

exo-tp's serving flags are passed only when `exo-tp run --help` lists them: --max-concurrency
(set to the largest stream count, so 16 streams can share one batch) and --prompt-cache-size.
Every server process (and whatever it started) is stopped at the end, on errors, on Ctrl-C and
on SIGTERM.

    python bench/serving.py [--contenders ceiling,a,b,c,d,p,q,chat] [--streams 1,4,16]
        [--max-tokens 32] [--requests-per-client 1] [--min-requests 4] [--turns 6]
        [--logs DIR] [--quick]

`--quick` (streams 1 and 2, 4 tokens, one request per client, 2 chat turns, one node for c, d
and the chat, the cached chat on d's cluster) is a smoke run of every contender; unless --model
is given, every contender runs the random 8/2-head model in a tiny shape (hidden 144, 4 layers,
bench/_common.py's ``tiny_model``), so that c and d are one command and d's levels run on c's
cluster (about 1 minute on the 2-core VM); `--quick --contenders a` takes about 8 s.

Targets: exo-tp's aggregate at 16 streams >= 4x its 1-stream rate and >= mlx_lm.server
distributed's (b vs c, same model and ranks); cached last-turn TTFT <= 0.3x the uncached one.
The last line of stdout is one JSON object with these ratios and the whole table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
from _common import (
    ROOT,
    WorkerResult,
    env,
    pinned,
    resolve,
    tiny_model,
    worker_result,
    write_model,
)

sys.path.insert(0, str(ROOT))

from exo_tp.process.blas import THREADS_ENV, share_cores  # noqa: E402
from exo_tp.transport.ports import free_ports, port_is_free  # noqa: E402
from exo_tp.transport.ring import ring_env, write_hostfile  # noqa: E402
from exo_tp.transport.ring_wait import WAIT_ENV  # noqa: E402

CONTENDERS = {
    "a": "(a) mlx_lm.server, 1 process, SmolLM2",
    "b": "(b) mlx_lm.server distributed, 2 ranks, random 8/2-head model",
    "c": "(c) exo-tp, 2 ranks, random 8/2-head model",
    "d": "(d) exo-tp, 2 ranks, SmolLM2",
    "p": "(p) exo-tp pipeline, 2 stages of 1 rank, SmolLM2, overlapped",
    "q": "(q) exo-tp pipeline, 2 stages of 1 rank, SmolLM2, one batch",
}
# The pipeline contenders' extra flags: stages of one rank each, with or without overlap.
PIPELINE = {"p": ("--stages", "1,1"), "q": ("--stages", "1,1", "--no-overlap")}
ALL = ("ceiling", "step", *CONTENDERS, "chat")
SERVING_FLAGS = ("--max-concurrency", "--prompt-cache-size", "--prompt-cache-bytes")
GIVE_UP_429 = 300.0  # seconds a client keeps retrying a request refused with 429
# mlx_lm.server answers requests naming this model with the one given by --model.
MLX_LM_DEFAULT_MODEL = "default_model"


class StepSeconds(WorkerResult):
    """A decode step's median seconds at each batch size."""

    seconds: dict[int, float]


# The most batching can give on this machine: one process's decode step at batch B (KV cache of
# 16 tokens), median of 5. On a CPU build whose matmuls run at the same FLOP rate at any batch,
# a step costs B times as much and no server can beat that.
CEILING = """
import json, sys, time, mlx.core as mx
from serving import StepSeconds
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
model, _ = load(sys.argv[1])
out = {}
for batch in json.loads(sys.argv[2]):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.ones((batch, 16), dtype=mx.int32), cache=cache))
    token, times = mx.ones((batch, 1), dtype=mx.int32), []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - start)
    out[batch] = sorted(times)[1]
print(StepSeconds(seconds=out).model_dump_json())
"""

# Each rank of mlx_lm.server's distributed mode: join the ring first (strict: a missing set-up
# is an error, never a silent group of one), then mlx_lm.server's own main, which reuses it.
MLX_LM_RANK = """
import sys, mlx.core as mx
mx.distributed.init(backend="ring", strict=True)
from mlx_lm.server import main
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
main()
"""

TOPICS = [
    "a lighthouse keeper who finds a map",
    "two rival bakers in a small town",
    "a robot learning to paint",
    "a storm over a fishing village",
    "a lost dog crossing a city",
    "an old clockmaker and his apprentice",
    "a girl who talks to rivers",
    "a train that never stops",
    "a garden on the roof of a hospital",
    "a musician who lost her voice",
    "a desert caravan",
    "a boy building a boat from scrap",
    "a library that opens only at night",
    "a detective who hates mysteries",
    "a mountain village in winter",
    "a pirate who cannot swim",
    "a scientist and a talking crow",
    "a market at the edge of the world",
    "twin sisters separated at birth",
    "a knight afraid of horses",
    "a city under the sea",
    "a farmer who grows glass",
    "the last tree in a forest",
    "a chef cooking for a king",
]
FILLER = [
    "The story should have a clear beginning, a surprising middle and a quiet ending.",
    "Describe the weather, the smells and the sounds of every place the characters visit.",
    "Give every character a name, a habit and a secret they keep from the others.",
    "Let the dialogue carry the plot, and keep the sentences short and vivid.",
    "Include a journey, a misunderstanding, and a moment where someone is very brave.",
    "The tone should be warm but a little melancholic, like an old folk tale.",
    "Avoid magic solving the problem; the characters must solve it themselves.",
]

SYSTEM_PROMPT = """\
You are Atlas, the support assistant of Northwind Outfitters, a company that sells outdoor
equipment (tents, sleeping bags, stoves, backpacks, boots and climbing gear) online and in twelve
shops. Follow these rules in every answer.
1. Greet the customer only in your first answer; afterwards go straight to the point.
2. Orders ship within two working days; delivery takes three to five working days in the country
and up to two weeks abroad.
3. Returns are free within 60 days if the item is unused and in its original packaging; used
items can be returned within 30 days for store credit only.
4. Every tent, stove and backpack has a two-year warranty covering manufacturing defects; damage
from misuse or normal wear is not covered.
5. Members of the Northwind Club get free express shipping and a ten percent discount.
6. Tents, stoves and sleeping bags can be rented by the week from any shop.
7. Never advise using a stove inside a tent.
8. Keep answers short: at most three sentences unless the customer asks for details."""
USER_TURNS = [
    "Hi! I ordered a tent yesterday. When will it arrive? I live in the country.",
    "Can I still return it if I open the box to check the colour?",
    "And if I use it for one weekend and do not like it, what happens then?",
    "My old stove from you broke after eighteen months. Is that covered?",
    "What does joining the Northwind Club give me exactly?",
    "Last question: can I rent a sleeping bag for next week instead of buying one?",
]


@dataclass
class Stream:
    """What a client saw of one streamed request."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    rejected: int = 0  # 429 answers before the server took the request
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None


@dataclass
class Level:
    """One contender at one number of concurrent streams."""

    streams: int
    wall: float
    results: list[Stream]

    def ok(self) -> list[Stream]:
        return [r for r in self.results if r.error is None and r.chunks]

    def summary(self) -> dict[str, Any]:
        ok = self.ok()
        ttft = [r.ttft for r in ok if r.ttft is not None]
        gaps = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
        tokens = sum(r.completion_tokens for r in ok)
        return {
            "aggregate_tps": round(tokens / self.wall, 3) if self.wall > 0 else None,
            "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p95_s": _percentile(ttft, 95),
            "itl_p50_ms": None if not gaps else round(float(np.percentile(gaps, 50)) * 1e3, 2),
            "requests": len(self.results),
            "completion_tokens": tokens,
            "errors": len(self.results) - len(ok),
            "rejected_429": sum(r.rejected for r in self.results),
            "wall_s": round(self.wall, 2),
        }


def _percentile(values: Sequence[float], q: float) -> float | None:
    return None if not values else round(float(np.percentile(values, q)), 3)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- servers


class Server:
    """Processes serving one OpenAI-compatible API, stopped with everything they started.

    Each process starts a session of its own, so every descendant (exo-tp nodes and their rank
    workers, mlx_lm.server ranks) can be found and stopped by session id, even one whose parent
    already exited.
    """

    def __init__(
        self,
        name: str,
        commands: Sequence[tuple[list[str], dict[str, str]]],
        port: int,
        model: str,
        logs: Path,
    ):
        self.name, self.commands, self.model = name, commands, model
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = logs / f"{name}.log"
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Server:
        try:
            with self.log_path.open("ab") as out:
                for command, environment in self.commands:
                    self.procs.append(
                        subprocess.Popen(
                            command,
                            env=environment,
                            cwd=ROOT,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            start_new_session=True,
                            preexec_fn=_default_sigint,
                        )
                    )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _session_members(self) -> list[psutil.Process]:
        sessions = {p.pid for p in self.procs}
        members = []
        for proc in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(proc.pid) in sessions:
                    members.append(proc)
        return members

    def stop(self) -> None:
        # SIGINT first: exo-tp's local cluster and mlx_lm.server shut down their children on it.
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(self._session_members(), timeout=15)
        for proc in alive + self._session_members():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(self._session_members(), timeout=10)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        left = self._session_members()
        if left:
            log(f"warning: {self.name}: processes still alive: {[p.pid for p in left]}")

    def exited(self) -> str | None:
        for proc in self.procs:
            if proc.poll() is not None:
                return f"{self.name}: process exited with code {proc.returncode}"
        return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _default_sigint() -> None:
    """A server's SIGINT back to its default action (a ``preexec_fn``): a shell that starts
    this bench in the background ignores SIGINT for it, every child inherited that, and `stop`
    waited out its 15 s on each server, which had not seen the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def api_port(count: int = 1) -> int:
    """A port with ``count - 1`` free ports after it (exo-tp's local nodes take P, P+1, ...)."""
    for _ in range(100):
        port = free_ports(1)[0]
        if port + count < 65536 and all(port_is_free(port + i) for i in range(count)):
            return port
    raise RuntimeError("no free block of API ports")


def mlx_lm_single(model: Path, logs: Path) -> Server:
    port = api_port()
    command = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return Server("mlx_lm_single", [(command, env())], port, MLX_LM_DEFAULT_MODEL, logs)


def mlx_lm_distributed(model: Path, ranks: int, logs: Path) -> Server:
    port = api_port()
    hostfile = logs / "mlx_lm_hosts.json"
    write_hostfile(hostfile, [f"127.0.0.1:{p}" for p in free_ports(ranks)])
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    # Its ranks split the cores for OpenBLAS's threads as exo-tp's local ranks do.
    shared = {**env(), **share_cores(ranks, env())}
    # mlx-lm as users run it: its ranks spin in their ring waits (exo_tp.transport.ring_wait).
    stock = {**shared, WAIT_ENV: "spin"}
    commands = [
        ([sys.executable, "-c", MLX_LM_RANK, *args], {**stock, **ring_env(r, hostfile, stock)})
        for r in range(ranks)
    ]
    return Server("mlx_lm_distributed", commands, port, MLX_LM_DEFAULT_MODEL, logs)


def exo_tp_serving_flags() -> list[str]:
    """Which of the (new) serving flags `exo-tp run` has in this checkout."""
    out = subprocess.run(
        [sys.executable, "-m", "exo_tp", "run", "--help"],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    options = {word.strip("[],") for word in out.split() if word.startswith(("--", "[--"))}
    return [flag for flag in SERVING_FLAGS if flag in options]


def exo_tp(
    name: str,
    model: str,
    ranks: int,
    logs: Path,
    flags: Sequence[str],
    options: dict[str, str],
    extra: Sequence[str] = (),
) -> Server:
    """`exo-tp run --local-nodes N --weights 1,...` with those ``options`` it supports, and
    ``extra`` flags as they are."""
    port = api_port(ranks)
    command = [
        sys.executable,
        "-m",
        "exo_tp",
        "run",
        "--local-nodes",
        str(ranks),
        "--weights",
        ",".join(["1"] * ranks),
        "--model",
        model,
        "--dtype",
        "float32",
        "--api-port",
        str(port),
    ]
    for option, value in options.items():
        if option in flags:
            command += [option, value]
    command += extra
    return Server(name, [(command, env())], port, model, logs)


# ---------------------------------------------------------------------------------- clients


def payload(
    model: str, messages: list[dict[str, str]], max_tokens: int, stream: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_chat(
    session: aiohttp.ClientSession, server: Server, messages: list[dict[str, str]], max_tokens: int
) -> Stream:
    """One streamed chat completion; a 429 is retried after its Retry-After (and counted)."""
    result = Stream(sent=time.perf_counter())
    body = payload(server.model, messages, max_tokens, stream=True)
    while True:
        try:
            async with session.post(f"{server.url}/v1/chat/completions", json=body) as response:
                if response.status == 429 and time.perf_counter() - result.sent < GIVE_UP_429:
                    result.rejected += 1
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                    continue
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return result
                await _read_events(response.content, result)
                return result
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            result.error = f"{type(error).__name__}: {error}"
            return result


async def _read_events(content: aiohttp.StreamReader, result: Stream) -> None:
    done = False
    async for raw in content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            result.error = str(event["error"])[:200]
            return
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                result.chunks.append(time.perf_counter())
                result.text += text
        usage = event.get("usage")
        if usage:
            result.completion_tokens = usage.get("completion_tokens", 0)
            result.prompt_tokens = usage.get("prompt_tokens")
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if not done:
        result.error = "the stream ended without [DONE]"
    if not result.completion_tokens:  # no usage chunk: count text chunks
        result.completion_tokens = len(result.chunks)


@contextlib.asynccontextmanager
async def client_session(read_timeout: float) -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout)
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent streams
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        yield session


async def wait_ready(server: Server, timeout: float) -> float:
    """Seconds until the server answers a 1-token completion (model loaded, cluster formed)."""
    start = time.perf_counter()
    body = payload(server.model, [{"role": "user", "content": "Hi"}], 1, stream=False)
    async with client_session(read_timeout=timeout) as session:
        while time.perf_counter() - start < timeout:
            gone = server.exited()
            if gone:
                raise RuntimeError(f"{gone}; its log ends:\n{server.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(f"{server.url}/v1/chat/completions", json=body) as response:
                    if response.status == 200:
                        await response.read()
                        return time.perf_counter() - start
            await asyncio.sleep(0.25)  # a start's seconds are logged, not measured
    raise RuntimeError(
        f"{server.name} not ready after {timeout:.0f} s; its log ends:\n{server.log_tail()}"
    )


def prompts(seed: int) -> Iterator[str]:
    """Distinct story prompts of varied lengths (about 40 to 100 tokens with the template)."""
    i = seed
    while True:
        topic = TOPICS[i % len(TOPICS)]
        filler = " ".join(FILLER[i % len(FILLER) :][: i % 4])
        yield f"Story #{i}. Write a long, detailed story about {topic}. {filler}"
        i += 1


async def run_level(
    session: aiohttp.ClientSession,
    server: Server,
    streams: int,
    per_client: int,
    max_tokens: int,
    source: Iterator[str],
) -> Level:
    """``streams`` clients, each sending ``per_client`` requests back to back."""
    results: list[Stream] = []

    async def client() -> None:
        for _ in range(per_client):
            messages = [{"role": "user", "content": next(source)}]
            results.append(await stream_chat(session, server, messages, max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    return Level(streams, time.perf_counter() - start, results)


@contextlib.asynccontextmanager
async def started(server: Server, args: argparse.Namespace) -> AsyncIterator[Server]:
    """The server started and answering; stopped with everything it started on the way out."""
    log(f"{server.name}: starting")
    with server:
        ready = await wait_ready(server, args.ready_timeout)
        log(f"{server.name}: ready after {ready:.0f} s")
        yield server


async def measure_levels(server: Server, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Every stream count in turn, on a ready ``server``."""
    source = prompts(seed=0)
    out = {}
    async with client_session(args.read_timeout) as session:
        for streams in args.streams:
            per_client = max(args.requests_per_client, -(-args.min_requests // streams))
            level = await run_level(session, server, streams, per_client, args.max_tokens, source)
            out[streams] = level.summary()
            s = out[streams]
            log(
                f"{server.name}: {streams:>2} streams: {s['aggregate_tps']} tok/s, TTFT p50 "
                f"{s['ttft_p50_s']} s, ITL p50 {s['itl_p50_ms']} ms, {s['errors']} errors "
                f"({s['wall_s']} s)"
            )
            for r in level.results:
                if r.error:
                    log(f"  error: {r.error}")
    return out


async def chat(server: Server, args: argparse.Namespace, answers: list[str] | None) -> list[Stream]:
    """The multi-turn chat on a ready ``server``; with ``answers``, those are the history (the
    same conversation)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    turns = []
    async with client_session(args.read_timeout) as session:
        for i in range(args.turns):
            messages.append({"role": "user", "content": USER_TURNS[i % len(USER_TURNS)]})
            turn = await stream_chat(session, server, messages, args.max_tokens)
            if turn.error:
                raise RuntimeError(f"{server.name}: turn {i + 1} failed: {turn.error}")
            turns.append(turn)
            log(
                f"{server.name}: turn {i + 1}: TTFT {_fmt(turn.ttft, '.3f', ' s')}, prompt "
                f"{turn.prompt_tokens} tokens, cached {turn.cached_tokens}"
            )
            answer = answers[i] if answers is not None else turn.text
            messages.append({"role": "assistant", "content": answer})
    return turns


# ---------------------------------------------------------------------------------- report


def batch_ceiling(model: Path, batches: Sequence[int], core: int | None = None) -> dict[int, float]:
    """Decode tokens/s of one process's forward step at each batch size (no server); with
    ``core``, pinned to that core with one BLAS thread, as each rank of a stage runs."""
    log(f"batch ceiling: decode steps at batch {list(batches)}")
    one_thread = {} if core is None else {THREADS_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-c", CEILING, str(model), json.dumps(list(batches))],
        capture_output=True,
        text=True,
        env={**env(), **one_thread},
        preexec_fn=None if core is None else pinned(core),
        check=True,
        timeout=600,
    )
    steps = worker_result(out.stdout, StepSeconds).seconds
    return {batch: batch / seconds for batch, seconds in steps.items()}


class ConductorSteps(WorkerResult):
    """The conductor's median step at one batch (seconds) on SmolLM2 and on a 1-layer, 64-wide
    model with its vocabulary (nearly all overhead outside the model)."""

    model: float
    tiny: float


# exo-tp's conductor stepping a full batch in one process: the real Conductor and LockstepBatch,
# its request source a sink that serializes every event as the wire would and drops it.
STEP = """
import sys, time
import mlx.core as mx
from mlx_lm import load
from exo_tp.runtime.batching import LockstepBatch
from exo_tp.runtime.conductor import Conductor
from exo_tp.wire.assignment import ServingOptions
from exo_tp.wire.runtime import Generate, GenerateRequest, SamplingParams
from serving import ConductorSteps

class Sink:
    def send(self, message, raw=None):
        message.model_dump_json()

def median_step(path, batch, steps):
    model, tokenizer = load(path)
    group = mx.distributed.init()  # one process: a group of one
    options = ServingOptions(max_concurrency=batch)
    make = lambda sample: LockstepBatch(model, [], options, sample, 1)  # no EOS: rows stay
    conductor = Conductor(tokenizer, group, Sink(), [], [], model.args.vocab_size, make)
    for i in range(batch):
        tokens = tuple(tokenizer.encode(f"Story number {i}:"))
        params = SamplingParams(max_tokens=10000)
        request = GenerateRequest(id=str(i), tokens=tokens, sampling=params)
        conductor._take(Generate(request=request))
    generator = conductor.batch
    while generator.applied < len(conductor._committed):
        conductor._apply(conductor._committed[generator.applied])
    for _ in range(3):  # prefill, then every row decoding
        for response in generator.step():
            conductor._on_token(response)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for response in generator.step():
            conductor._on_token(response)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]

batch = int(sys.argv[3])
model, tiny = median_step(sys.argv[1], batch, 7), median_step(sys.argv[2], batch, 15)
print(ConductorSteps(model=model, tiny=tiny).model_dump_json())
"""


def step_overhead(smollm2: Path, folder: Path, batch: int) -> ConductorSteps:
    """Median conductor step at ``batch`` on SmolLM2 and on a 1-layer 64-wide model."""
    tiny = write_model(
        folder,
        smollm2,
        zero_eos=False,
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
    )
    log(f"step overhead: conductor steps at batch {batch}")
    out = subprocess.run(
        [sys.executable, "-c", STEP, str(smollm2), str(tiny), str(batch)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    return worker_result(out.stdout, ConductorSteps)


def random_model(folder: Path, smollm2: Path, quick: bool) -> Path:
    """SmolLM2's shape with 8 query / 2 KV heads of 64 (divisible by 2 ranks), random weights;
    --quick: bench/_common.py's tiny model with 8 / 2 heads of its head size (16)."""
    if quick:
        return tiny_model(folder, num_attention_heads=8, num_key_value_heads=2)
    heads = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
    return write_model(folder, smollm2, zero_eos=False, **heads)


def ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top and bottom else None


def print_table(table: dict[str, dict[int, dict[str, Any]]]) -> None:
    print(
        f"{'contender':<64}{'streams':>8}{'agg tok/s':>11}{'TTFT p50':>10}{'TTFT p95':>10}"
        f"{'ITL p50':>10}{'reqs':>6}{'errors':>7}"
    )
    for key, levels in table.items():
        for streams, s in levels.items():
            print(
                f"{CONTENDERS[key]:<64}{streams:>8}{_fmt(s['aggregate_tps'], '.2f'):>11}"
                f"{_fmt(s['ttft_p50_s'], '.2f', ' s'):>10}"
                f"{_fmt(s['ttft_p95_s'], '.2f', ' s'):>10}"
                f"{_fmt(s['itl_p50_ms'], '.0f', ' ms'):>10}{s['requests']:>6}{s['errors']:>7}"
            )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def print_chat(uncached: list[Stream], cached: list[Stream]) -> None:
    print("\nchat on exo-tp (SmolLM2, 2 ranks): time to first token per turn")
    print(f"{'turn':>4}{'prompt tokens':>15}{'no cache':>11}{'cache':>9}{'cached tokens':>15}")
    for i, (u, c) in enumerate(zip(uncached, cached, strict=True)):
        print(
            f"{i + 1:>4}{_fmt(u.prompt_tokens, 'd'):>15}{_fmt(u.ttft, '.3f', ' s'):>11}"
            f"{_fmt(c.ttft, '.3f', ' s'):>9}{_fmt(c.cached_tokens, 'd'):>15}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contenders",
        default=",".join(ALL),
        help=f"which to run, of {','.join(ALL)} (default all)",
    )
    parser.add_argument("--streams", help="concurrent streams per level (default 1,4,16)")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="at least this many requests per level (more per client at few streams)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6, help="turns of the chat")
    parser.add_argument(
        "--ranks", type=int, help="ranks of b, c, d and the chat (default 2; --quick: 1, b 2)"
    )
    parser.add_argument(
        "--model",
        help="the model of a, d and the chat (default smollm2-135m; --quick: a tiny random model "
        "with its tokenizer, bench/_common.py's tiny_model)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        help="exo-tp's decode batch (default: the largest stream count)",
    )
    parser.add_argument(
        "--exo-tp-flags",
        default="",
        help="more `exo-tp run` flags for every exo-tp contender, e.g. '--prefill-batch-size 8'",
    )
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument(
        "--logs", type=Path, help="keep the servers' logs (and the random model) in this folder"
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=900,
        help="seconds a stream may stay silent before it counts as failed",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: streams 1,2, one request per client, 4 tokens, 2 chat turns, one node, "
        "a tiny model",
    )
    args = parser.parse_args()
    if args.quick:
        args.streams = args.streams or "1,2"
        args.requests_per_client, args.min_requests, args.max_tokens, args.turns = 1, 1, 4, 2
        # Every cluster start costs each of its processes the imports of mlx_lm and
        # transformers; a one-node cluster still takes every path of this script.
        args.ranks = args.ranks or 1
    elif args.model is None:
        args.model = "smollm2-135m"
    args.ranks = args.ranks or 2
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(args.contenders) - set(ALL)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; pick from {','.join(ALL)}")
    args.streams = sorted({int(s) for s in (args.streams or "1,4,16").split(",")})
    args.max_concurrency = args.max_concurrency or max(args.streams)
    return args


@dataclass
class Results:
    flags: list[str]
    ceiling: dict[int, float] | None = None
    stage_tps: dict[int, float] | None = None
    step: ConductorSteps | None = None
    table: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    uncached: list[Stream] | None = None
    cached: list[Stream] | None = None


async def run(args: argparse.Namespace, logs: Path, results: Results) -> None:
    """Every contender asked for, one server at a time; ``results`` fills as they finish."""
    random_dir = logs / "random-8-2"
    if args.model is None:
        # --quick: SmolLM2's float32 steps were most of its minutes. The quick model is c's
        # random one, so that c and d are one command (below).
        args.model = str(random_model(random_dir, resolve("smollm2-135m"), quick=True))
    smollm2 = resolve(args.model)
    serving = {"--max-concurrency": str(args.max_concurrency)}
    log(f"exo-tp run has the serving flags {results.flags or 'none'}")
    if "ceiling" in args.contenders:
        results.ceiling = batch_ceiling(smollm2, args.streams)
    if {"p", "q"} <= set(args.contenders):
        top = max(args.streams)
        results.stage_tps = batch_ceiling(smollm2, sorted({max(1, top // 2), top}), core=0)
    if "step" in args.contenders:
        results.step = step_overhead(smollm2, logs / "tiny-1-layer", max(args.streams))
    if {"b", "c"} & set(args.contenders) and args.model != str(random_dir):
        random_model(random_dir, smollm2, args.quick)

    def server(key: str) -> Server:
        if key == "a":
            return mlx_lm_single(smollm2, logs)
        if key == "b":  # its distributed mode needs a ring of two ranks at least
            return mlx_lm_distributed(random_dir, max(2, args.ranks), logs)
        model = str(random_dir) if key == "c" else args.model
        ranks = 2 if key in PIPELINE else args.ranks
        extra = (*PIPELINE.get(key, ()), *args.exo_tp_flags.split())
        return exo_tp(f"exo_tp_{key}", model, ranks, logs, results.flags, serving, extra)

    async def uncached_chat() -> list[Stream]:
        no_cache = {**serving, "--prompt-cache-size": "0"}
        name = "exo_tp_chat_no_cache"
        async with started(
            exo_tp(name, args.model, args.ranks, logs, results.flags, no_cache), args
        ) as ready:
            return await chat(ready, args, None)

    # --quick: the cached chat runs on d's cluster (the same command, unless --exo-tp-flags),
    # one cluster start fewer; a measurement would not want d's prompts in its prompt cache.
    chat_on_d = args.quick and {"d", "chat"} <= set(args.contenders)
    if chat_on_d:  # the conversation the cached chat replays comes first
        results.uncached = await uncached_chat()
    # --quick on its own model: c and d are the same command, so d's levels (and the cached
    # chat) run on c's cluster, one cluster start fewer.
    d_on_c = args.model == str(random_dir) and {"c", "d"} <= set(args.contenders)
    for key in CONTENDERS:
        if key in args.contenders and not (key == "d" and d_on_c):
            async with started(server(key), args) as ready:
                for measured in (key, "d") if key == "c" and d_on_c else (key,):
                    results.table[measured] = await measure_levels(ready, args)
                    if measured == "d" and chat_on_d and results.uncached:
                        answers = [t.text for t in results.uncached]
                        results.cached = await chat(ready, args, answers)
    if "chat" in args.contenders and not chat_on_d:
        results.uncached = await uncached_chat()
        name = "exo_tp_chat_cache"
        async with started(
            exo_tp(name, args.model, args.ranks, logs, results.flags, serving), args
        ) as ready:
            results.cached = await chat(ready, args, [t.text for t in results.uncached])


def report(args: argparse.Namespace, results: Results) -> dict[str, Any]:
    """Print the tables; the headline ratios and the raw numbers for the JSON line."""
    table, uncached, cached = results.table, results.uncached, results.cached
    top = max(args.streams)

    def agg(key: str, streams: int) -> float | None:
        return table.get(key, {}).get(streams, {}).get("aggregate_tps")

    if table:
        print(
            f"{args.max_tokens} tokens per request (greedy), at least {args.min_requests} requests "
            f"per level; aggregate = all streams' completion tokens / wall time of the level"
        )
        print_table(table)
    if "p" in table and "q" in table:
        print(
            "\npipeline, overlapped over one batch in flight (aggregate): "
            + ", ".join(
                f"{n} streams: {_fmt(ratio(agg('p', n), agg('q', n)), '.2f', 'x')}"
                for n in args.streams
            )
        )
    bound = overlap_bound(results.stage_tps, top)
    if bound is not None:
        print(
            f"  decode steps allow at most {bound:.2f}x at {top} streams: one core's decode step "
            f"at batch {top} over one at batch {top // 2} (two micro-batches of {top // 2}; "
            "prefill steps, which cost about their token count, can overlap to nearly 2x)"
        )
    ceiling = results.ceiling
    if ceiling:
        print(
            "\nbatching ceiling of this machine (one process, forward step at batch B, SmolLM2): "
            + ", ".join(f"B={b}: {tps:.1f} tok/s" for b, tps in ceiling.items())
        )
    step = results.step
    if step:
        print(
            f"\nconductor step at batch {top}: SmolLM2 {step.model * 1e3:.1f} ms, 1-layer "
            f"model {step.tiny * 1e3:.1f} ms: overhead outside the model "
            f"{100 * step.tiny / step.model:.1f}% of the step"
        )
    headline: dict[str, Any] = {
        "exo_tp_top_over_1_stream": ratio(agg("d", top), agg("d", 1)),
        "exo_tp_random_top_over_1_stream": ratio(agg("c", top), agg("c", 1)),
        "exo_tp_over_mlx_lm_distributed_at_top": ratio(agg("c", top), agg("b", top)),
        "exo_tp_over_mlx_lm_single_at_top": ratio(agg("d", top), agg("a", top)),
        "mlx_lm_single_top_over_1_stream": ratio(agg("a", top), agg("a", 1)),
        "mlx_lm_distributed_top_over_1_stream": ratio(agg("b", top), agg("b", 1)),
        "batch_ceiling_top_over_1": ratio(ceiling.get(top), ceiling.get(1)) if ceiling else None,
        "step_overhead_share": ratio(step.tiny, step.model) if step else None,
        "pipeline_overlap_over_one_batch_at_top": ratio(agg("p", top), agg("q", top)),
        "pipeline_overlap_over_one_batch_at_1": ratio(agg("p", 1), agg("q", 1)),
        "pipeline_overlap_decode_bound_at_top": bound,
        "chat_last_turn_cached_over_uncached": None,
    }
    chat_summary: dict[str, Any] | None = None
    if uncached and cached:
        print_chat(uncached, cached)
        headline["chat_last_turn_cached_over_uncached"] = ratio(cached[-1].ttft, uncached[-1].ttft)
        chat_summary = {
            "turns": len(uncached),
            "uncached_ttft_s": [_round(t.ttft) for t in uncached],
            "cached_ttft_s": [_round(t.ttft) for t in cached],
            "prompt_tokens": [t.prompt_tokens for t in uncached],
            "cached_tokens": [t.cached_tokens for t in cached],
            "answers_match": [u.text == c.text for u, c in zip(uncached, cached, strict=True)],
        }
    headline.update(
        {
            "top_streams": top,
            "targets": {
                "exo_tp_top_over_1_stream": ">= 4",
                "exo_tp_over_mlx_lm_distributed_at_top": ">= 1",
                "chat_last_turn_cached_over_uncached": "<= 0.3",
                "step_overhead_share": "< 0.05",
                "pipeline_overlap_over_one_batch_at_top": ">= 1.7",
                "pipeline_overlap_over_one_batch_at_1": ">= 1 (no worse)",
            },
            "exo_tp_serving_flags": results.flags,
            "max_tokens": args.max_tokens,
            "batch_ceiling_tps": {str(b): round(v, 3) for b, v in (ceiling or {}).items()},
            "table": {k: {str(s): v for s, v in levels.items()} for k, levels in table.items()},
            "chat": chat_summary,
        }
    )
    return headline


def overlap_bound(tps: dict[int, float] | None, top: int) -> float | None:
    """What overlapping two stages can gain on decode steps, from one core's decode tokens/s
    at each batch: one batch in flight steps all ``top`` rows on each stage in turn;
    overlapped, each stage steps two micro-batches of half as many while the other stage
    steps too. The gain is the step's seconds at ``top`` rows over those at ``top // 2``."""
    half = top // 2
    if not tps or half < 1 or top not in tps or half not in tps:
        return None
    return round((top / tps[top]) / (half / tps[half]), 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C, so every server is stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    load_before = os.getloadavg()[0]
    results = Results(flags=exo_tp_serving_flags())
    with tempfile.TemporaryDirectory(prefix="exo-tp-serving-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            asyncio.run(run(args, logs, results))
        except KeyboardInterrupt:
            log("interrupted: every server stopped")
            raise SystemExit(130) from None
    headline = report(args, results)
    # Other work on the machine slows every contender: the load shows how much to trust a run.
    headline["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(headline))


if __name__ == "__main__":
    main()


def aggregate_under_load(
    name: str, model: str, logs: Path, extra: Sequence[str], streams: int, tokens: int
) -> float:
    """Aggregate tokens/s of ``streams`` concurrent streaming clients (distinct prompts,
    ``tokens`` each) on `exo-tp run --local-nodes 2` with ``extra`` flags."""

    async def aggregate() -> float:
        with exo_tp(name, model, 2, logs, [], {}, extra) as server:
            await wait_ready(server, 900)
            async with client_session(900) as session:
                level = await run_level(session, server, streams, 1, tokens, prompts(seed=0))
        errors = [r.error for r in level.results if r.error]
        if errors:
            sys.exit(f"under load: {errors[0]}")
        return float(level.summary()["aggregate_tps"])

    return asyncio.run(aggregate())
