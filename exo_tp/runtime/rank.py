"""The rank program: one rank of an epoch, for `exo-tp launch` and `exo-tp run` alike.

    python -m exo_tp.runtime.rank JOB.json
    (EXO_TP_LINK_KEY and the supervisor's link (`exo_tp.process.child`) in the environment;
    in a stage of several ranks MLX_RANK and MLX_HOSTFILE, or the jaccl variables)

It reports to its supervisor (Joining, Loading, Ready, a Heartbeat every second, RankFailed),
joins its stage's MLX group, loads its shard, opens its pipeline hops and its link to the
conductor, then serves: the conductor (the last stage's first rank) joins the request source
and drives continuous batching; every other rank follows it step by step. A rank exits when its
supervisor closes their link (the node replaced the worker, or the launch is over), or when the
epoch's links break.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from exo_tp.arch import table_for
from exo_tp.errors import ExoTpError
from exo_tp.lab.factor import FACTOR_ENV, FACTOR_FILE_ENV, pin_from_env
from exo_tp.models.registry import resolve_model
from exo_tp.models.tokenizer import load_model_tokenizer
from exo_tp.plan.cost import stage_kv_bytes_per_token, stage_state_bytes
from exo_tp.plan.kv_width import kv_bytes_at_width, kv_quantization_problem
from exo_tp.plan.profiles import LinkProfile
from exo_tp.process.blas import active_blas
from exo_tp.process.child import connect_supervisor
from exo_tp.process.lifecycle import die_with_parent
from exo_tp.profile.collective_speed import group_links
from exo_tp.runtime.batching import LockstepBatch, RankSampler
from exo_tp.runtime.conductor import Conductor
from exo_tp.runtime.draft_source import conductor_drafter, follower_drafter, may_speculate
from exo_tp.runtime.follower import ControlFeed, follow, peer_sampler, stage_sampler
from exo_tp.runtime.mtp.on_rank import MtpParts, mtp_on_rank
from exo_tp.runtime.pipeline import HopChannel, StageModel
from exo_tp.runtime.rank_progress import Progress, beat, exit_when_closed
from exo_tp.shard.apply import load_shard
from exo_tp.shard.collectives import sum_over_ranks
from exo_tp.shard.fused_step import FusedForward
from exo_tp.shard.kv_quant import quantize_kv
from exo_tp.shard.layers import HiddenFeed
from exo_tp.shard.row_pieces import multiply_in_pieces, pieces_wanted
from exo_tp.shard.tree import get_path
from exo_tp.transport.channel import Channel, Listener, accept_count, connect
from exo_tp.transport.ring import init_group
from exo_tp.vision.on_rank import vision_on_rank
from exo_tp.wire.assignment import DTYPE_BYTES, LINK_KEY_ENV, Assignment
from exo_tp.wire.runtime import (
    HELLO,
    HOP_MESSAGES,
    SOURCE_MESSAGES,
    STAGE_CONTROL,
    EndTokens,
    Hello,
    Joining,
    Loading,
    RankFailed,
    Ready,
)

log = logging.getLogger("exo_tp.rank")

PEER_TIMEOUT = 120.0  # for the other ranks of the epoch to come up
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "auto": None}


def _most_bytes(job: Assignment, measure: Callable[..., int]) -> int:
    """``measure`` (a `exo_tp.plan.cost` stage measure) on the rank holding the most: the
    prompt cache's budget holds for every rank."""
    spec = job.plan.stages[0].tp.spec
    return max(
        measure(spec, shard, stage.layers, DTYPE_BYTES[job.dtype])
        for stage in job.plan.stages
        for shard in stage.tp.ranks
    )


def _bytes_per_token(job: Assignment) -> int:
    """KV cache bytes per token (the prompt cache's measure of an entry's length), at the
    quantized width when the KV cache is quantized."""
    serving = job.serving
    return kv_bytes_at_width(
        _most_bytes(job, stage_kv_bytes_per_token),
        DTYPE_BYTES[job.dtype],
        serving.kv_bits,
        serving.kv_group_size,
    )


def _bytes_per_entry(job: Assignment) -> int:
    """Recurrent state bytes per prompt-cache entry (constant in its length)."""
    return _most_bytes(job, stage_state_bytes)


def _open_hops(job: Assignment, key: bytes, model: Any) -> Any:
    """This rank's stage model for a pipeline plan (its plain model with one stage)."""
    plan, rank = job.plan, job.rank
    index, local = job.stage_index, job.local_rank
    stages = plan.stages
    if len(stages) == 1:
        return model
    incoming: list[HopChannel] = []
    arrived = threading.Event()
    listener = None
    if index > 0:  # one hop in, from the previous stage's sender (its first rank)

        def on_channel(channel: HopChannel) -> None:
            incoming.append(channel)
            arrived.set()

        listener = Listener(job.hops[rank], key, HOP_MESSAGES, on_channel, "hop")
    outgoing = []
    if index < len(stages) - 1 and local == stages[index].sender:
        for target in stages[index + 1].ranks:
            channel = connect(job.hops[target], key, HOP_MESSAGES, PEER_TIMEOUT)
            channel.send(Hello(epoch=job.epoch, rank=rank))
            outgoing.append(channel)
    if listener is not None:
        try:
            if not arrived.wait(PEER_TIMEOUT):
                raise TimeoutError("the previous pipeline stage never connected")
        finally:
            listener.close()
        hello = incoming[0].recv()
        if not isinstance(hello, Hello) or hello.epoch != job.epoch:
            raise ConnectionError(f"unexpected hop peer: {hello}")
    table = table_for(plan.spec.model_type)
    feed = get_path(model, table.embedding) if index > 0 else None
    return StageModel(
        model,
        get_path(model, table.stack),
        incoming[0] if incoming else None,
        outgoing,
        last=index == len(stages) - 1,
        feed=feed if isinstance(feed, HiddenFeed) else None,
    )


@dataclass(frozen=True)
class _StepParts:
    """What this epoch's steps run with beside the model: fused decode rows and prompt chunks,
    the MTP heads (the last stage's), several streams verified in one step."""

    fused: FusedForward | None
    mtp: MtpParts | None
    verify_rows: bool


def _step_parts(
    job: Assignment, model_dir: Path, model: Any, driver: Any, group: Any, vision: bool
) -> _StepParts:
    """The MTP heads (the last stage's), fused steps and verified rows, decided alike on every
    rank of the stage (each in its all-reduce, in this order everywhere)."""
    mtp = mtp_on_rank(job, model_dir, model, group, DTYPES[job.dtype])
    # (fused: positions ride on ids; the MTP record wants one stream's rows a call)
    fused = None if vision or mtp else _fused_steps(job, driver, group)
    return _StepParts(fused, mtp, _verify_rows(job, group))


def _all_on_gpus(group: mx.distributed.Group) -> bool:
    """Whether every rank of the group computes on a GPU (one all-reduce: all decide alike)."""
    on_gpu = mx.array([int(mx.default_device().type == mx.gpu)])
    return bool(sum_over_ranks(on_gpu, 1, group).item() == group.size())


def _verify_rows(job: Assignment, group: mx.distributed.Group) -> bool:
    """Whether several streams draft and are verified in one step (ServingOptions.
    batch_drafts): on, or auto where the plan has one stage whose ranks all compute on GPUs."""
    choice = job.serving.batch_drafts
    if choice == "off" or job.serving.kv_bits is not None:
        return False
    return choice == "on" or (len(job.plan.stages) == 1 and _all_on_gpus(group))


def _fused_steps(job: Assignment, model: Any, group: mx.distributed.Group) -> FusedForward | None:
    """What runs a step's decode rows and a prompt chunk in one pass, where this epoch does
    (ServingOptions.fused_steps; one stage, a float KV cache, a family whose blocks fuse).
    Every rank must decide alike: the job is the same everywhere, and auto (a GPU) holds
    only where every rank of the stage computes on one, agreed in one all-reduce."""
    choice, model_type = job.serving.fused_steps, job.plan.stages[0].tp.spec.model_type
    if choice == "off" or len(job.plan.stages) > 1 or job.serving.kv_bits is not None:
        return None
    if table_for(model_type).fused is None:
        if job.rank == job.conductor_rank:
            log.info("epoch %d: %s: no fused steps (its blocks do not fuse)", job.epoch, model_type)
        return None
    if choice == "auto" and not _all_on_gpus(group):
        return None
    return FusedForward(model, model_type)


def _serve_as_conductor(
    job: Assignment,
    key: bytes,
    model: Any,
    tokenizer: Any,
    group: mx.distributed.Group,
    progress: Progress,
    supervisor: Channel[Any],
    ready: Ready,
    model_dir: Path,
    steps: _StepParts,
) -> None:
    plan = job.plan
    followers = accept_count(job.conductor, key, HELLO, plan.size - 1, PEER_TIMEOUT, "conductor")
    by_rank: dict[int, Channel[Any]] = {}
    for channel in followers:
        hello = channel.recv()
        if hello is None or hello.epoch != job.epoch:
            raise ConnectionError(f"unexpected peer at the conductor: {hello}")
        by_rank[hello.rank] = channel
    # Followers take the end tokens from here rather than each loading the tokenizer (0.65 s
    # of CPU per rank, on every start of every epoch).
    last_stage = set(plan.stages[-1].ranks)
    earlier = [by_rank[r] for r in sorted(by_rank) if r not in last_stage]
    drafter = conductor_drafter(job, group, model_dir, earlier, steps.mtp, DTYPES[job.dtype])
    ends = EndTokens(ids=tuple(sorted(tokenizer.eos_token_ids)), model_drafts=drafter is not None)
    for channel in by_rank.values():
        channel.send(ends)
    source = connect(job.requests_at, key, SOURCE_MESSAGES, PEER_TIMEOUT)
    source.send(Hello(epoch=job.epoch, rank=job.rank))

    def make_batch(sample: RankSampler) -> LockstepBatch:
        progress.batch = LockstepBatch(
            model,
            tokenizer.eos_token_ids,
            job.serving,
            sample,
            _bytes_per_token(job),
            lanes=job.lanes,
            bytes_per_entry=_bytes_per_entry(job),
            speculate=may_speculate(job),
            drafter=drafter,
            fused=steps.fused,
            verify_rows=steps.verify_rows,
        )
        if progress.probe is not None:
            progress.batch.after_step = progress.probe.maybe
        return progress.batch

    conductor = Conductor(
        tokenizer,
        group,
        source,
        list(by_rank.values()),
        earlier,
        plan.stages[0].tp.spec.vocab_size,
        make_batch,
    )
    supervisor.send(ready)
    conductor.serve()


def _serve_as_follower(
    job: Assignment,
    key: bytes,
    model: Any,
    group: mx.distributed.Group,
    progress: Progress,
    supervisor: Channel[Any],
    ready: Ready,
    steps: _StepParts,
) -> None:
    channel = connect(job.conductor, key, STAGE_CONTROL, PEER_TIMEOUT)
    channel.send(Hello(epoch=job.epoch, rank=job.rank))
    feed = ControlFeed(channel)
    opening = feed.end_tokens()
    in_last_stage = job.stage_index == len(job.plan.stages) - 1
    deferred = not in_last_stage and job.lanes > 1  # its tokens arrive a round later
    sample = peer_sampler(group) if in_last_stage else stage_sampler(feed)
    progress.batch = LockstepBatch(
        model,
        opening.ids,
        job.serving,
        None if deferred else sample,
        _bytes_per_token(job),
        lanes=job.lanes,
        deferred=feed.next_tokens if deferred else None,
        bytes_per_entry=_bytes_per_entry(job),
        speculate=may_speculate(job),
        drafter=follower_drafter(opening, in_last_stage, group, feed, steps.mtp),
        fused=steps.fused,
        verify_rows=steps.verify_rows,
    )
    if progress.probe is not None:
        progress.batch.after_step = progress.probe.maybe
    supervisor.send(ready)
    follow(progress.batch, feed, group)


def run(job: Assignment, key: bytes, supervisor: Channel[Any], child: str) -> None:
    stage = job.plan.stages[job.stage_index]
    supervisor.send(Joining(child=child, epoch=job.epoch, rank=job.rank))
    threading.Thread(target=exit_when_closed, args=(supervisor,), daemon=True).start()
    group = init_group()  # before loading: a peer that never comes must not cost a load first
    links: tuple[LinkProfile, ...] = ()
    if job.measure_links and group.size() > 1:  # every rank of the stage, in step
        names = [job.nodes[r] if job.nodes else str(r) for r in stage.ranks]
        links = tuple(group_links(group, names))
    supervisor.send(Loading(epoch=job.epoch))
    progress = Progress()
    model_dir = Path(job.model_dir) if job.model_dir else resolve_model(job.model)
    started = time.perf_counter()
    first, last = job.stage_index == 0, job.stage_index == len(job.plan.stages) - 1
    model = load_shard(
        model_dir,
        stage.tp,
        job.local_rank,
        group,
        DTYPES[job.dtype],
        stage.layers,
        first,
        last,
        Path(job.adapter_path) if job.adapter_path else None,
    )
    progress.load_peak = mx.get_peak_memory()
    pieced = multiply_in_pieces(model) if pieces_wanted() else 0
    factor = None
    if os.environ.get(FACTOR_ENV) or os.environ.get(FACTOR_FILE_ENV):  # the lab's slow device
        from exo_tp.lab.slowdown import slow_down_from_env

        factor = slow_down_from_env(model)
    if job.speed_probe:
        from exo_tp.runtime.speed_probe import SpeedProbe

        progress.probe = SpeedProbe(model, (lambda: factor.factor) if factor else lambda: 1.0)
    mine = stage.tp.ranks[job.local_rank]
    log.info(
        "epoch %d rank %d: stage %d/%d layers %d-%d, shard loaded in %.1fs: q heads "
        "%d-%d, kv %s, vocab %d-%d, %.0f MB active; float32 matmuls on %s (%d weights "
        "multiplied in row pieces at batch 1)",
        job.epoch,
        job.rank,
        job.stage_index + 1,
        len(job.plan.stages),
        stage.layers.start,
        stage.layers.stop,
        time.perf_counter() - started,
        mine.heads.q_heads.start,
        mine.heads.q_heads.stop,
        list(mine.heads.kv_heads),
        mine.vocab.start,
        mine.vocab.stop,
        mx.get_active_memory() / 1e6,
        active_blas(),
        pieced,
    )
    vision = vision_on_rank(job, model_dir, model, DTYPES[job.dtype])
    driver = _open_hops(job, key, model)
    driver.vision_registry = vision  # LockstepBatch's: image spans (exo_tp.vision.registry)
    if job.serving.kv_bits is not None:  # mlx-lm's QuantizedKVCache, a sequence at a time:
        # the stage model, so that a pipeline's hops carry one sequence per call too
        serving, bits = job.serving, job.serving.kv_bits  # (bits: narrowed by the check above)
        problem = kv_quantization_problem(stage.tp.spec, bits, serving.kv_group_size)
        if problem:
            raise ExoTpError(problem)
        quantize_kv(driver, bits, serving.kv_group_size, serving.quantized_kv_start)
    steps = _step_parts(job, model_dir, model, driver, group, vision is not None)
    threading.Thread(target=beat, args=(supervisor, progress), daemon=True).start()
    ready = Ready(epoch=job.epoch, rank=job.rank, links=links, memory=progress.memory())
    if job.rank == job.conductor_rank:  # only the conductor reads text: the followers get
        # the end tokens from it (EndTokens)
        tokenizer = load_model_tokenizer(model_dir)
        _serve_as_conductor(
            job, key, driver, tokenizer, group, progress, supervisor, ready, model_dir, steps
        )
    else:
        _serve_as_follower(job, key, driver, group, progress, supervisor, ready, steps)


def _peer_lost(error: Exception) -> bool:
    """MLX's ring backend's error when a peer's socket closed (that peer's rank died)."""
    return isinstance(error, RuntimeError) and "connection to a peer was lost" in str(error)


def main() -> None:
    die_with_parent()
    # A terminal's Ctrl-C reaches the whole process group: a rank leaves when its supervisor
    # closes their link (or with its parent), so a stopped `exo-tp run` or `launch` prints no
    # rank's traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_from_env()  # the lab: one core per rank (nothing unless EXO_TP_CPUS is set)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack on stderr
    job = Assignment.model_validate_json(Path(sys.argv[1]).read_text())
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s rank {job.rank} %(levelname)s %(message)s",
    )
    key = bytes.fromhex(os.environ.pop(LINK_KEY_ENV, ""))
    link = connect_supervisor()
    supervisor = link.channel
    try:
        run(job, key, supervisor, link.child)
    except Exception as error:  # report, then die: a broken ring cannot be reused
        if _peer_lost(error):  # news (another rank died first), not a bug: one line
            log.error("rank failed: %s", error)
        else:
            log.exception("rank failed")
        try:
            supervisor.send(RankFailed(message=f"{type(error).__name__}: {error}"))
        finally:
            os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
