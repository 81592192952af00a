"""The conductor: the last stage's first rank. It takes requests from the request source,
decides every change to the batch (see `exo_tp.runtime.batching`), samples every sequence with
its own parameters, broadcasts the tokens, and streams each request's text back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.grammar.compiler import Grammars, grammars_for
from exo_tp.grammar.mask import GrammarMask
from exo_tp.runtime.batching import DivergedError, LockstepBatch, Response, Word
from exo_tp.runtime.detokenizers import Detokenizers
from exo_tp.runtime.sampling import request_processors, request_sampler, token_logprob
from exo_tp.runtime.stop_strings import StopMatcher
from exo_tp.shard.collectives import broadcast_from_first
from exo_tp.transport.channel import Channel
from exo_tp.transport.ring import leave
from exo_tp.wire.ids import BatchUid
from exo_tp.wire.runtime import (
    Cancel,
    Delta,
    Done,
    FinishReason,
    Generate,
    GenerateRequest,
    Insert,
    Remove,
    RequestFailed,
    Tokens,
)

log = logging.getLogger(__name__)


def _restore_random_state(key: mx.array) -> None:
    """Make ``key`` MLX's global random key: `mx.random.seed(n)` sets the key (n >> 32,
    n & 0xffffffff), so every key is some seed."""
    high, low = cast(list[int], key.tolist())  # a key is two uint32s
    mx.random.seed((high << 32) | low)


def _random_key() -> mx.array:
    """MLX's global random key (the first of `mx.random.state`)."""
    return mx.random.state[0]  # type: ignore[index]  # mlx's stubs leave out random.state


@dataclass
class _Request:
    """A request the conductor committed, until it leaves the batch."""

    request: GenerateRequest
    uid: BatchUid
    sampler: Callable[[mx.array], mx.array]
    processors: list[Any]
    detokenizer: Any
    stops: StopMatcher
    started: float = field(default_factory=time.perf_counter)
    key: mx.array | None = None  # its own random stream, when it has a seed
    first_token: float = 0.0
    generated: int = 0
    cached: int = 0
    finished: bool = False  # done for the client (it may still be in the batch for a step)
    drafted: int = 0  # speculative decoding: tokens drafted, and accepted by the target
    accepted: int = 0
    grammar: GrammarMask | None = None  # a constrained request's mask

    def sample(self, logprobs: mx.array) -> mx.array:
        if self.key is None:
            return self.sampler(logprobs)
        outside = _random_key()
        _restore_random_state(self.key)
        token = self.sampler(logprobs)
        self.key = _random_key()
        _restore_random_state(outside)
        return token


class Conductor:
    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        group: mx.distributed.Group,
        source: Channel[Generate | Cancel],
        followers: list[Channel[Any]],
        earlier_stages: list[Channel[Any]],
        vocab_size: int,
        make_batch: Callable[[Callable[[mx.array], tuple[mx.array, Word]]], LockstepBatch],
    ):
        self.tokenizer, self.group, self.vocab_size = tokenizer, group, vocab_size
        self._detokenizers = Detokenizers(tokenizer)
        self.source, self.followers, self.earlier = source, followers, earlier_stages
        self.batch = make_batch(self._sample)
        self.batch.on_drafts = self._count_drafts
        self._closing = False  # the source closed in the middle of a step
        self._incoming: queue.Queue[Generate | Cancel | None] = queue.Queue()
        self._committed: list[Insert | Remove] = []
        self._requests: dict[str, _Request] = {}  # by request id, until done for the client
        self._by_uid: dict[BatchUid, _Request] = {}  # until the uid leaves the batch
        self._next_uid = BatchUid(0)
        self._marked: list[BatchUid] = []  # uids of the rows of the step being sampled, in order

    # ---- requests in ---------------------------------------------------------------------

    def _read_source(self) -> None:
        while (message := self.source.recv()) is not None:
            self._incoming.put(message)
        self._incoming.put(None)  # the source is gone: this epoch is over

    def _commit(self, change: Insert | Remove) -> None:
        self._committed.append(change)
        for follower in self.followers:
            follower.send(change)

    def _take(self, message: Generate | Cancel | None) -> bool:
        """Turn a message from the source into committed changes; False once it closed."""
        if message is None:
            return False
        if isinstance(message, Cancel):
            pending = self._requests.get(message.id)
            if pending is not None:
                self._finish(pending, "cancelled")
                self._commit(Remove(uids=(pending.uid,)))
            return True
        request = message.request
        try:
            entry = self._admit(request)
        except ValueError as error:
            self.source.send(RequestFailed(id=request.id, message=str(error)))
            return True
        self._requests[request.id] = self._by_uid[entry.uid] = entry
        self._commit(
            Insert(
                uid=entry.uid,
                tokens=request.tokens,
                max_tokens=request.sampling.max_tokens,
                save_logits=request.logits_out is not None,
                lane=self._lightest_lane(),
                keep_prompt=request.keep_prompt,
                # a prompt's registered ids would make drafts that are never kept
                draft_tokens=0 if request.vision else self._draft_tokens(entry),
                vision=request.vision,
                prompt_logprobs=request.prompt_logprobs,
                embed=request.embed,
            )
        )
        return True

    def _draft_tokens(self, entry: _Request) -> int:
        """The request's drafts per step, or the node's; 0 where verified drafts would not
        give the request's own answer: logits processors (penalties, biases: left out to keep
        the verify step to the plain case) and grammars (their state moves with every position
        they see, the rejected ones included). Sampling at a temperature speculates: every
        verified position is sampled from the target, which is rejection sampling for drafts
        that are points (exo_tp.runtime.speculative)."""
        if not self.batch.speculative:
            return 0
        request = entry.request
        if entry.processors or request.constraint:
            return 0
        wanted = request.num_draft_tokens
        return self.batch.default_drafts if wanted is None else wanted

    def _count_drafts(self, uid: BatchUid, drafted: int, accepted: int) -> None:
        entry = self._by_uid.get(uid)
        if entry is not None:
            entry.drafted += drafted
            entry.accepted += accepted

    def _lightest_lane(self) -> int:
        """Overlapped pipelines: the lane with the fewest sequences, counting those committed
        but not yet applied (the first of equals; a lone request always takes lane 0)."""
        if self.batch.lane_count == 1:
            return 0
        loads = self.batch.lane_loads()
        for change in self._committed[self.batch.applied :]:
            if isinstance(change, Insert):
                loads[change.lane] += 1
        return loads.index(min(loads))

    def _admit(self, request: GenerateRequest) -> _Request:
        """Everything that could fail for this request alone fails here, before it joins."""
        if request.id in self._requests:
            raise ValueError(f"request id {request.id} is already running")
        # Token ids and top_k were fitted to the model where the request was made
        # (GenerateRequest.fit: the API, the launch CLI).
        params = request.sampling
        sampler = request_sampler(params, self.tokenizer)
        processors = request_processors(params)
        grammar = None
        if request.constraint is not None:  # last: no penalty or bias can lift its -inf
            matcher = self._grammars().matcher(request.constraint)  # GrammarError: ValueError
            eos = sorted(self.tokenizer.eos_token_ids)
            grammar = GrammarMask(matcher, self.vocab_size, eos)
            processors = [*processors, grammar]
        key = None
        if params.seed is not None:
            outside = _random_key()
            mx.random.seed(params.seed)
            key = _random_key()
            _restore_random_state(outside)
        uid, self._next_uid = self._next_uid, BatchUid(self._next_uid + 1)
        return _Request(
            request,
            uid,
            sampler,
            processors,
            self._detokenizers.new(request.continuation),
            StopMatcher(request.stop),
            key=key,
            grammar=grammar,
        )

    def _grammars(self) -> Grammars:
        """llguidance's view of the tokenizer, built (~1 s) at the first constrained request."""
        return grammars_for(self.tokenizer, self.vocab_size)

    def _take_pending(self) -> bool:
        while True:
            try:
                message = self._incoming.get_nowait()
            except queue.Empty:
                return True
            if not self._take(message):
                return False

    # ---- sampling (called by the batch generator) ------------------------------------------

    def _marker(self, entry: _Request) -> Callable[[mx.array, mx.array], mx.array]:
        """A logits processor for the request's row: mlx-lm calls each row's processors in row
        order right before it samples, so the markers tell the sampler whose row is whose."""

        def mark(tokens: mx.array, logits: mx.array) -> mx.array:
            self._marked.append(entry.uid)
            if self.batch.vision is not None:  # an image prompt's registered ids read back
                tokens = self.batch.vision.real_tokens(tokens)
            for processor in entry.processors:
                logits = processor(tokens, logits)
            return logits

        return mark

    def _sample(self, logprobs: mx.array) -> tuple[mx.array, Word]:
        rows, self._marked = self._marked, []
        if len(rows) != logprobs.shape[0]:
            raise DivergedError(f"sampling {logprobs.shape[0]} rows, marked {len(rows)}")
        entries = [self._by_uid[uid] for uid in rows]
        if all(e.request.sampling.temperature == 0 for e in entries):
            # Greedy rows (the common case): one argmax over the batch, not one per row.
            tokens = entries[0].sampler(logprobs).astype(mx.float32)
        else:
            tokens = mx.concatenate(
                [e.sample(logprobs[i : i + 1]) for i, e in enumerate(entries)]
            ).astype(mx.float32)
        if not self._take_pending():
            self._closing = True
        word = len(self._committed)
        agreed = broadcast_from_first(mx.concatenate([tokens, mx.array([float(word)])]), self.group)
        sampled = agreed[:-1].astype(mx.uint32)
        if self.earlier:  # earlier pipeline stages follow the same tokens
            message = Tokens(
                tokens=tuple(cast(list[int], sampled.tolist())), committed=word, uids=tuple(rows)
            )
            for channel in self.earlier:
                channel.send(message)
        return sampled, word

    # ---- the loop --------------------------------------------------------------------------

    def serve(self) -> None:
        threading.Thread(target=self._read_source, name="source", daemon=True).start()
        batch = self.batch
        while not self._closing:
            target = batch.agreed()
            if batch.idle and len(self._committed) < target:
                if not self._take(self._incoming.get()) or not self._take_pending():
                    self._end()
                    return
                if len(self._committed) < target:
                    continue  # nothing to apply (e.g. a cancel of a finished request)
            while batch.applied < target:
                self._apply(self._committed[batch.applied])
            if not batch.idle:
                for response in batch.step():
                    self._on_token(response)

    def _end(self) -> None:
        """The source closed while idle: let the other ranks go, and leave together."""
        for follower in self.followers:
            follower.close()
        leave(self.group)

    def _apply(self, change: Insert | Remove) -> None:
        if isinstance(change, Remove):
            self.batch.remove(change)
            for uid in change.uids:
                self._by_uid.pop(uid, None)
            return
        entry = self._by_uid[change.uid]
        inserted = self.batch.insert(change, [self._marker(entry)])
        entry.cached = inserted.cached
        if inserted.logits is not None and entry.request.logits_out:
            np.save(entry.request.logits_out, np.array(inserted.logits[0].astype(mx.float32)))
        if change.prompt_logprobs is not None or change.embed:  # before any generated token
            self.source.send(
                Delta(
                    id=entry.request.id,
                    text="",
                    prompt_logprobs=inserted.scores,
                    embedding=inserted.embedding,
                )
            )
        if change.max_tokens == 0:  # scored only: it never joined the batch
            del self._by_uid[change.uid]
            self._finish(entry, "length")

    # ---- events out ------------------------------------------------------------------------

    def _on_token(self, response: Response) -> None:
        uid = BatchUid(response.uid)  # mlx-lm's uid: the one the Insert named
        entry = self._by_uid.get(uid)
        if entry is None:
            return
        if response.finish_reason is not None:
            del self._by_uid[uid]
        if entry.finished:
            return
        if entry.grammar is not None and entry.grammar.failure is not None:
            leaving = response.finish_reason is not None
            self._fail_grammar(entry, entry.grammar.failure, leaving)
            return
        if entry.generated == 0:
            entry.first_token = time.perf_counter()
        entry.generated += 1
        detokenizer = entry.detokenizer
        if response.finish_reason != "stop":  # the stop token itself is not text
            detokenizer.add_token(response.token)
        if response.finish_reason is not None:
            detokenizer.finalize()
        text = entry.stops.feed(detokenizer.last_segment)
        params = entry.request.sampling
        # the stop token is not text, so it has no entry either: the entries join to the text
        logprobs = (
            (token_logprob(response.logprobs, response.token, params.top_logprobs),)
            # (with the prompt's scores, as vLLM: evaluation harnesses drop the last entry)
            if params.logprobs
            and (response.finish_reason != "stop" or entry.request.prompt_logprobs is not None)
            else ()
        )
        if response.finish_reason is not None and not entry.stops.stopped:
            text += entry.stops.flush()
        self.source.send(
            Delta(id=entry.request.id, text=text, tokens=(response.token,), logprobs=logprobs)
        )
        if entry.stops.stopped:
            self._finish(entry, "stop")
            if response.finish_reason is None:  # it leaves the batch a step or two later
                self._commit(Remove(uids=(entry.uid,)))
        elif response.finish_reason is not None:
            self._finish(entry, "stop" if response.finish_reason == "stop" else "length")

    def _fail_grammar(self, entry: _Request, message: str, leaving: bool) -> None:
        """The request fails for the client (its grammar failed: the text so far is no value);
        it leaves the batch, now unless it is ``leaving`` already. One log line."""
        log.warning("request %s: %s", entry.request.id, message)
        entry.finished = True
        self._requests.pop(entry.request.id, None)
        self.source.send(RequestFailed(id=entry.request.id, message=message, grammar=True))
        if not leaving:
            self._commit(Remove(uids=(entry.uid,)))

    def _finish(self, entry: _Request, reason: FinishReason) -> None:
        entry.finished = True
        self._requests.pop(entry.request.id, None)
        now = time.perf_counter()
        self.source.send(
            Done(
                id=entry.request.id,
                finish_reason=reason,
                prompt_tokens=len(entry.request.tokens),
                completion_tokens=entry.generated,
                cached_tokens=entry.cached,
                drafted_tokens=entry.drafted,
                accepted_tokens=entry.accepted,
                stop_string=entry.stops.matched,
                prompt_seconds=(entry.first_token or now) - entry.started,
                seconds=now - entry.started,
            )
        )
