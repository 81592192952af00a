"""Continuous batching on every rank of an epoch, in lockstep.

Every rank of every stage runs the same mlx-lm `BatchGenerator` over its own shard (its layers,
its heads, its KV caches) and must apply the same changes to the batch — a request joins
(`Insert`), requests leave (`Remove`) — before the same step. Given the same changes at the
same steps and the same sampled tokens, the generators evolve identically everywhere: the same
prompt chunks, the same cache merges and filters, the same finishes.

The conductor decides. It numbers each change and sends it at once over TCP to every other rank
(one message per change, not per token). Which changes apply before which step rides on the
token broadcast: with the B sampled tokens the conductor broadcasts one more number, the count of
changes it had committed when it sampled. Before a step, every rank applies the changes up to
the count carried by the *second-to-last* broadcast: the last one may still be computing
(mlx-lm evaluates the next tokens asynchronously), the one before is already known everywhere,
so reading it never waits. With nothing in flight there is no broadcast: an idle rank waits for
the next change and applies exactly that one (the conductor likewise), then steps again.

Ranks of earlier pipeline stages are not in the last stage's group: they receive the sampled
tokens and the same count in a `Tokens` message on the same TCP link as the changes.

Overlapped pipelines (``lanes`` > 1, one lane per stage): the batch is split into lanes, each
its own generator, and every rank steps them in turn (lane = position mod lanes), so while the
last stage works on one lane the earlier stages already work on the next. An Insert names its
lane. Earlier stages cannot wait for a lane's sampled tokens inside its step (that would
serialise the stages again): their sampler hands the generator placeholders, and the real
tokens (a `Tokens` message, by uid) replace them right before the lane's next step, one
round later. The changes before position p are those counted by the broadcast of position
p - max(2, lanes): a position whose tokens every rank holds by then without waiting longer
than it must anyway. With one request only its lane has work and the others are skipped, so
one stream runs exactly as without lanes.

Speculative decoding (`exo_tp.runtime.speculative`): while the batch holds a single stream and
nothing waits to join, a sequence inserted with ``draft_tokens`` > 0 steps speculatively: its
drafts come from tokens every rank holds (prompt lookup) or from the conductor's broadcast (a
draft model, `exo_tp.runtime.draft_model`), its verify step is one forward and one token
broadcast like any step, so the lockstep (same changes, same steps, same tokens) is kept; a
stream whose drafts stop paying pauses (`Backoff`, from counts every rank shares). Pipeline
stages verify alike: the k + 1 positions cross every hop in the one forward, and the earlier
stages read the verify step's tokens from their `Tokens` message (an overlapped pipeline's
earlier stages at once, not a round later: their drafts and rollback need them; with one
stream no other lane has work to overlap). Only with a float KV cache (``speculate``).

Fused steps (``fused``, exo_tp.shard.fused_step): a step's decode rows and one prompt's chunk in
one forward pass, decided by every rank from the batch it holds alike.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch

from exo_tp.runtime.admission import Admission
from exo_tp.runtime.batch_verify import RowsVerify, can_verify_rows
from exo_tp.runtime.diverged import DivergedError
from exo_tp.runtime.fused_steps import fusable, step_fused
from exo_tp.runtime.prompt_cache import prompt_alone, prompt_cache_for
from exo_tp.runtime.prompt_scores import Inserted, prompt_outputs
from exo_tp.runtime.speculative import (
    Backoff,
    Drafter,
    SpeculativeStep,
    can_speculate,
    lookup_drafter,
    prompt_lookup,
)
from exo_tp.shard.fused_step import FusedForward
from exo_tp.vision.registry import VisionRegistry
from exo_tp.wire.assignment import MODEL_DRAFTS, ServingOptions
from exo_tp.wire.ids import BatchUid
from exo_tp.wire.runtime import Insert, Remove, Tokens

log = logging.getLogger(__name__)

Word = mx.array | int  # the committed-changes count of one broadcast
# A rank's part of sampling: the step's log-probabilities (B, V) in, the agreed tokens (B,)
# and the broadcast count out.
RankSampler = Callable[[mx.array], tuple[mx.array, Word]]
# Earlier stages of an overlapped pipeline: the conductor's next Tokens message.
TokenFeed = Callable[[], Tokens]
Response = GenerationBatch.Response


def _word_value(word: Word) -> int:
    # (the array: the count's float32 slot of a peer's token broadcast)
    return int(cast(float, word.item())) if isinstance(word, mx.array) else word


class LockstepBatch:
    def __init__(
        self,
        model: nn.Module,
        eos_tokens: Sequence[int],
        options: ServingOptions,
        sample: RankSampler | None,
        bytes_per_token: int,
        lanes: int = 1,
        deferred: TokenFeed | None = None,
        bytes_per_entry: int = 0,
        speculate: bool = False,
        drafter: Drafter | None = None,
        fused: FusedForward | None = None,
        verify_rows: bool = False,
    ):
        """``sample``: this rank's part of sampling; None with ``deferred`` (earlier stages of
        an overlapped pipeline, whose tokens arrive a round later). ``bytes_per_token`` and
        ``bytes_per_entry`` (recurrent state): the prompt cache's measure (PromptCache).
        ``speculate``: this epoch's plan lets sequences with draft tokens speculate (a float
        KV cache: every rank must pass the same); ``drafter``:
        where drafts come from (a draft model's, exo_tp.runtime.draft_model), else prompt
        lookup. ``fused``: runs a step's decode rows and a prompt chunk in one forward pass
        (exo_tp.shard.fused_step; one stage, a float KV cache: every rank must pass alike).
        ``verify_rows``: several streams draft by prompt lookup and are verified in one step
        (exo_tp.runtime.batch_verify; every rank must pass alike)."""
        if (sample is None) == (deferred is None):
            raise ValueError("a rank samples either now or deferred")
        self.model = model
        # image prompts (exo_tp.vision.registry): set on the model by the rank, None for text
        self.vision: VisionRegistry | None = getattr(model, "vision_registry", None)
        self._sample, self._deferred = sample, deferred
        self.admission = Admission(options)
        self.lanes = [
            BatchGenerator(
                model,
                stop_tokens=[[t] for t in eos_tokens],
                sampler=self._sampler,
                completion_batch_size=options.max_concurrency,
                prefill_batch_size=self.admission.prefill_batch_size,
                prefill_step_size=options.prefill_step_size,
            )
            for _ in range(lanes)
        ]
        self.generator = self.lanes[0]
        self.prompt_cache = prompt_cache_for(options, bytes_per_token, bytes_per_entry)
        self._words: list[Word] = []
        self.applied = 0  # changes applied so far
        self.active: set[int] = set()  # uids in the batch
        self.steps = 0
        # Prompts kept in the prompt cache once prefilled (an Insert's keep_prompt: n choices
        # of one prompt), by uid, until the uid's first token.
        self._keep: dict[int, list[int]] = {}
        self.after_step: Callable[[], None] | None = None  # e.g. the live speed probe
        # Lanes only: the lane of each uid, the visits since the batch was last idle, the last
        # broadcast count of each recent visit, the largest count already agreed, the rows
        # each deferred sampling still owes (visit, lane, rows), and tokens received by uid.
        self._lane_of: dict[int, int] = {}
        self._position = 0
        self._word_at: dict[int, Word] = {}
        self._floor = 0
        self._owed: deque[tuple[int, int, int]] = deque()
        self._received: list[dict[int, int]] = [{} for _ in range(lanes)]
        # Speculative decoding: each sequence's draft tokens per step (its Insert's), and
        # the conductor's count of drafted and accepted tokens (uid, drafted, accepted).
        wanted, by_model = options.num_draft_tokens, MODEL_DRAFTS if drafter else 0
        self.default_drafts = (by_model if wanted is None else wanted) if speculate else 0
        hidden = getattr(drafter, "hidden", None)  # an MTP drafter's record of hidden states
        drafter = drafter or lookup_drafter(options.prompt_lookup_ngram)
        step = SpeculativeStep(model, self._sample_now, drafter, hidden)
        self._speculative = step if speculate else None
        rows = speculate and verify_rows and by_model == 0 and lanes == 1  # prompt lookup only
        self._rows = RowsVerify(model, self._sample_now) if rows else None
        self._ngram = options.prompt_lookup_ngram
        self.rows_steps = 0  # steps that verified several streams' drafts together
        self._drafts: dict[int, int] = {}
        self._backoff = Backoff()  # streams whose drafts stopped paying decode plainly a while
        self.on_drafts: Callable[[BatchUid, int, int], None] | None = None
        self._fused = fused
        self.fused_steps = 0  # steps that ran their decode rows and a chunk in one pass

    def _sampler(self, logprobs: mx.array) -> mx.array:
        if self._deferred is not None:  # placeholders; the tokens replace them a round later
            rows = logprobs.shape[0]
            self._owed.append((self._position, self._position % len(self.lanes), rows))
            return mx.zeros((rows,), dtype=mx.uint32)
        assert self._sample is not None
        tokens, word = self._sample(logprobs)
        if len(self.lanes) == 1:
            self._words.append(word)
        else:
            self._word_at[self._position] = word
        return tokens

    def _sample_now(self, logprobs: mx.array) -> mx.array:
        """A verify step's sampling: earlier stages of an overlapped pipeline wait for its
        tokens here rather than a round later, since its drafts and rollback depend on them."""
        if self._deferred is None:
            return self._sampler(logprobs)
        message = self._deferred()
        if len(message.tokens) != logprobs.shape[0]:
            raise DivergedError(f"{len(message.tokens)} tokens for {logprobs.shape[0]} rows")
        self._word_at[self._position] = message.committed
        return mx.array(message.tokens, dtype=mx.uint32)

    @property
    def idle(self) -> bool:
        return not self.active

    @property
    def speculative(self) -> bool:
        """Whether sequences may speculate in this batch (its plan allows it)."""
        return self._speculative is not None

    @property
    def lane_count(self) -> int:
        return len(self.lanes)

    def lane_loads(self) -> list[int]:
        """Sequences in each lane (the conductor puts a joining request in the lightest)."""
        loads = [0] * len(self.lanes)
        for lane in self._lane_of.values():
            loads[lane] += 1
        return loads

    def agreed(self) -> int:
        """How many changes are applied before the next step (the module doc says why)."""
        if len(self.lanes) > 1:
            return self._agreed_in_lanes()
        if self.idle:
            self._words.clear()
            return self.applied + 1
        if len(self._words) < 2:
            return self.applied
        word = self._words[-2]
        del self._words[:-2]
        return max(self.applied, _word_value(word))

    def _agreed_in_lanes(self) -> int:
        if self.idle:  # every rank is here: start counting visits afresh
            self._settle(self._position)
            self._position = 0
            self._word_at.clear()
            return self.applied + 1
        lanes = len(self.lanes)
        self._settle(self._position - lanes)  # the tokens this lane's next step needs
        horizon = self._position - max(2, lanes)
        for position in [p for p in self._word_at if p <= horizon]:
            self._floor = max(self._floor, _word_value(self._word_at.pop(position)))
        return max(self.applied, self._floor)

    def _settle(self, upto: int) -> None:
        """Earlier stages: read the tokens of every deferred sampling up to visit ``upto``."""
        while self._owed and self._owed[0][0] <= upto:
            position, lane, rows = self._owed.popleft()
            assert self._deferred is not None
            message = self._deferred()
            if len(message.tokens) != rows or len(message.uids) != rows:
                raise DivergedError(f"{len(message.tokens)} tokens for {rows} rows")
            self._received[lane].update(zip(message.uids, message.tokens, strict=True))
            self._word_at[position] = message.committed

    def insert(self, change: Insert, processors: list[Any] | None = None) -> Inserted:
        """Apply an Insert (one with no tokens to generate only scores its prompt)."""
        if change.lane >= len(self.lanes):
            raise DivergedError(f"lane {change.lane} of {len(self.lanes)}")
        generator = self.lanes[change.lane]
        tokens = list(change.tokens)
        if change.vision is not None:
            if self.vision is None:
                raise DivergedError("an image prompt for a model without a vision tower")
            tokens = self.vision.encode(change.uid, tokens, change.vision)
        # on the generator's stream: its steps' collectives are still in flight there, and
        # ours must follow them on every rank in the same order (another stream would race)
        with mx.stream(generator._stream):
            logits, scores, embedding = prompt_outputs(self.model, tokens, change)
        if change.max_tokens == 0:  # it never joins: its uid is spent all the same
            generator._uid_count = max(generator._uid_count, change.uid + 1)
            self.applied += 1
            return Inserted(0, None, scores, embedding)
        cache, cached = self.prompt_cache.fetch(tokens) if self.prompt_cache else (None, 0)
        if len(self.lanes) > 1:  # each lane's generator numbers from the conductor's uids
            generator._uid_count = change.uid
        (uid,) = generator.insert(
            [tokens[cached:]],
            max_tokens=[change.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:cached]] if cached else None,
            logits_processors=[processors] if processors is not None else None,
        )
        if uid != change.uid:
            raise DivergedError(f"request joined as {uid}, the conductor says {change.uid}")
        self.active.add(uid)
        self.admission.joined[uid] = self.steps
        if self._speculative is not None:
            self._speculative.joined()
        if change.keep_prompt and self.prompt_cache is not None:
            self._keep[uid] = tokens
        self._lane_of[uid] = change.lane
        if change.draft_tokens and self.speculative:
            self._drafts[uid] = change.draft_tokens
        self.applied += 1
        return Inserted(cached, logits, scores, embedding)

    def remove(self, change: Remove) -> None:
        present = [uid for uid in change.uids if uid in self.active]
        for lane, generator in enumerate(self.lanes):
            mine = [uid for uid in present if self._lane_of[uid] == lane]
            if not mine:
                continue
            kept = generator.remove(mine, return_prompt_caches=bool(self.prompt_cache))
            for cache, tokens in kept.values():
                self._remember(tokens, cache)
        for uid in present:
            self._forget(uid)
            self._keep.pop(uid, None)
        self.applied += 1

    def _forget(self, uid: int) -> None:
        """A sequence left the batch (removed, or finished in a step)."""
        self.active.discard(uid)
        self._lane_of.pop(uid, None)
        self.admission.joined.pop(uid, None)
        self._drafts.pop(uid, None)
        self._backoff.forget(uid)
        if self.vision is not None:
            self.vision.release(uid)

    def step(self) -> list[Response]:
        """One step of the generator (of the lane whose turn it is): a decode step of the
        running sequences and a chunk of the joining prompts. Returns the generated tokens."""
        lane = self._position % len(self.lanes)
        generator = self.lanes[lane]
        if len(self.lanes) > 1:
            if lane not in self._lane_of.values():
                self._position += 1  # an empty lane: nothing in flight, nothing to wait for
                return []
            if self._deferred is not None:
                self._fill_tokens(lane)
        self.admission.prepare(generator, self.steps)
        responses = self._speculate(generator)
        if responses is None and self._rows is not None and can_verify_rows(generator):
            responses = self._speculate_rows(generator, self._rows)
        fused = self._fused if len(self.lanes) == 1 else None
        if responses is None and fused is not None and fusable(generator):
            responses = step_fused(generator, fused, first=not self.fused_steps)
            self.fused_steps += 1
        if responses is None:
            _, responses = generator.next()
        self._position += 1
        self.steps += 1
        if self.after_step is not None:
            self.after_step()
        for response in responses:
            if response.uid in self._keep:
                self._keep_prompt(generator, response.uid, self._keep.pop(response.uid))
            if response.finish_reason is not None:
                self._forget(response.uid)
                self._remember(response.all_tokens, response.prompt_cache)
        return responses

    def _speculate(self, generator: BatchGenerator) -> list[Response] | None:
        """A speculative step when the batch allows one (the module doc), else None. Every
        rank decides from what it holds alike: the batch, the Insert's drafts, the tokens."""
        if self._speculative is None or not self._drafts or len(self.active) != 1:
            return None  # (one stream in the whole batch: no other lane has work either)
        if not can_speculate(generator):
            return None
        batch = generator._generation_batch
        uid = batch.uids[0]
        # never draft past max_tokens: the last token allowed is the target's own
        most = min(self._drafts.get(uid, 0), batch.max_tokens[0] - batch._num_tokens[0] - 1)
        if most <= 0 or not self._backoff.allows(uid, self.steps):
            return None
        if self._deferred is not None:  # the tokens of every earlier step come first
            self._settle(self._position - 1)
        token, drafts = self._speculative.drafts(generator, most)
        if not drafts:  # nothing repeats yet (prompt lookup): a plain step
            return None
        responses, accepted = self._speculative.run(generator, token, drafts)
        if self._deferred is not None and batch.uids:  # what _fill_tokens hands the next step
            self._received[self._lane_of[uid]] = {uid: int(batch._next_tokens[0].item())}
        self._backoff.record(uid, self.steps, accepted)
        if self.on_drafts is not None:
            self.on_drafts(BatchUid(uid), len(drafts), accepted)
        return responses

    def _speculate_rows(self, generator: BatchGenerator, rows: RowsVerify) -> list[Response] | None:
        """Several streams decoding: each drafts by prompt lookup (its own count and back-off)
        and all are verified in one batched step; None where no stream has drafts."""
        batch = generator._generation_batch
        mx.eval(batch._next_tokens)
        pending = cast(list[int], batch._next_tokens.tolist())
        drafts = []
        for i, uid in enumerate(batch.uids):
            most = min(self._drafts.get(uid, 0), batch.max_tokens[i] - batch._num_tokens[i] - 1)
            allowed = most > 0 and self._backoff.allows(uid, self.steps)
            history = [*batch.tokens[i], pending[i]]
            drafts.append(prompt_lookup(history, self._ngram, most) if allowed else [])
        if not any(drafts):
            return None
        uids = list(batch.uids)
        responses, accepted = rows.run(generator, pending, drafts)
        if not self.rows_steps:
            log.info("a step verified the drafts of %d streams together", len(uids))
        self.rows_steps += 1
        for uid, row, kept in zip(uids, drafts, accepted, strict=True):
            if row:
                self._backoff.record(uid, self.steps, kept)
                if self.on_drafts is not None:
                    self.on_drafts(BatchUid(uid), len(row), kept)
        return responses

    def _keep_prompt(self, generator: BatchGenerator, uid: int, prompt: list[int]) -> None:
        """At a uid's first token, its prompt's KV cache into the prompt cache, so that the
        choices sent after this one skip its prefill (every rank at the same step)."""
        self._remember(prompt, prompt_alone(generator._generation_batch, uid, prompt))

    def _fill_tokens(self, lane: int) -> None:
        """Replace the lane's placeholder tokens with the conductor's (read by `agreed`)."""
        batch = self.lanes[lane]._generation_batch
        received, self._received[lane] = self._received[lane], {}
        if not batch.uids:
            return
        missing = [uid for uid in batch.uids if uid not in received]
        if missing:
            raise DivergedError(f"no tokens for rows {missing} of lane {lane}")
        batch._next_tokens = mx.array([received[uid] for uid in batch.uids], dtype=mx.uint32)

    def _remember(self, tokens: list[int] | None, cache: list[Any] | None) -> None:
        if self.prompt_cache is not None and tokens and cache:
            self.prompt_cache.insert(list(tokens), cache)

    def close(self) -> None:
        for generator in self.lanes:
            generator.close()
