"""Every message that crosses a process boundary, as typed pydantic models (no MLX here).

Each link carries one discriminated union (the ``kind`` field names the message) over the framing
of `exo_tp.transport.channel`:

- a rank and its supervisor (the node daemon, or `exo-tp launch`): `RankEvent` up, nothing down
  (closing the link stops the rank);
- the request source (the leader's dispatcher, or `exo-tp launch`) and the conductor (the last
  stage's first rank): `SourceMessage` down, `ConductorEvent` up;
- the conductor and every other rank of the epoch: `StageControl` (batch changes, and for ranks
  of earlier pipeline stages the sampled tokens);
- a pipeline hop: `HiddenHeader` followed by the raw bytes of the activation.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, model_validator

from exo_tp.frozen import Frozen, replace
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.process.messages import (
    ChildFailed,
    ChildHeartbeat,
    ChildHello,
    ChildPhase,
    ChildReady,
)
from exo_tp.wire.ids import BatchUid, Epoch, Rank, RequestId
from exo_tp.wire.profiles import LinkProfile
from exo_tp.wire.vision import VisionPrompt

MAX_DRAFT_TOKENS = 32  # more drafts than this cost a longer verify step than they can save

# ---- what a request asks for --------------------------------------------------------------


class SamplingParams(Frozen):
    """Per-request sampling, with mlx_lm.server's meanings (`mlx_lm.sample_utils`)."""

    # 0 only with prompt log-probabilities (GenerateRequest.prompt_logprobs): score, generate none
    max_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.0, ge=0.0, le=0.5)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    repetition_context_size: int = Field(default=20, ge=1)
    presence_penalty: float | None = None
    presence_context_size: int = Field(default=20, ge=1)
    frequency_penalty: float | None = None
    frequency_context_size: int = Field(default=20, ge=1)
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: bool = False  # report each generated token's log-probability
    top_logprobs: int = Field(default=0, ge=0, le=20)  # and the k most likely alternatives


class Constraint(Frozen):
    """Constrained decoding (`exo_tp.grammar`): the generated text must match ``grammar``, a
    JSON schema's text (``kind`` "json_schema") or an llguidance lark grammar ("lark": a tool
    call's syntax around its arguments' schema). The text travels rather than a compiled
    grammar: the API compiles it to refuse a bad one, the conductor compiles it again."""

    kind: Literal["json_schema", "lark"]
    grammar: str = Field(min_length=1)


class GenerateRequest(Frozen):
    """One generation: the prompt's token ids and how to continue them."""

    id: RequestId = Field(min_length=1, max_length=200)
    tokens: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings, matched on the streamed text
    # the text continues the prompt's (completions): a first token's leading space is kept
    continuation: bool = False
    logits_out: str | None = None  # launch only: save the prompt's logits here (npy)
    constraint: Constraint | None = None  # structured output: the text must match it
    # more choices of this prompt follow (n > 1): keep its KV cache once it is prefilled
    keep_prompt: bool = False
    # Prompt-lookup speculative decoding: draft tokens per step (0: off; None: the node's
    # default, ServingOptions.num_draft_tokens). Only greedy requests without logits
    # processors or a grammar speculate (exo_tp.runtime.speculative says why).
    num_draft_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    vision: VisionPrompt | None = None  # the prompt's images (exo_tp.wire.vision)
    # the prompt's own log-probabilities, with this many alternatives each (None: not asked;
    # exo_tp.runtime.prompt_scores): what evaluation harnesses score by
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # the prompt's embedding: the final hidden state pooled at its last token or over it all
    embed: Literal["last", "mean"] | None = None

    @model_validator(mode="after")
    def _generates_or_scores(self) -> GenerateRequest:
        if self.sampling.max_tokens == 0 and self.prompt_logprobs is None and not self.embed:
            raise ValueError("max_tokens 0 generates nothing: only with prompt_logprobs or embed")
        return self

    def fit(self, vocab_size: int) -> GenerateRequest:
        """The one check of a request against its model, done where it is made (the API, the
        launch CLI; the conductor trusts it): every token id inside the vocabulary, and a top_k
        that keeps every token read as no filter. Raises OutOfVocabulary."""
        for field, ids in (
            ("tokens", self.tokens),
            ("logit_bias", sorted(self.sampling.logit_bias or ())),
        ):
            for position, token in enumerate(ids):
                if not 0 <= token < vocab_size:
                    raise OutOfVocabulary(field, position, token, vocab_size)
        if self.sampling.top_k < vocab_size:
            return self
        return replace(self, sampling=replace(self.sampling, top_k=0))


class OutOfVocabulary(ValueError):
    """A token id of a request's ``field`` ("tokens" or "logit_bias", at ``position``: in the
    prompt, or among the sorted bias ids) that the model has no row for."""

    def __init__(self, field: str, position: int, token: int, vocab_size: int):
        super().__init__(
            f"token id {token} at position {position} is outside this model's vocabulary "
            f"(0 to {vocab_size - 1})"
        )
        self.field, self.position, self.token = field, position, token


# ---- every link ------------------------------------------------------------------------


class Hello(Frozen):
    """The first message from the connecting end of a link: which epoch and rank it is."""

    kind: Literal["hello"] = "hello"
    epoch: Epoch
    rank: Rank


# ---- request source <-> conductor --------------------------------------------------------


class Generate(Frozen):
    kind: Literal["generate"] = "generate"
    request: GenerateRequest


class Cancel(Frozen):
    kind: Literal["cancel"] = "cancel"
    id: RequestId


SourceMessage = Annotated[Generate | Cancel, Field(discriminator="kind")]


class TokenLogprob(Frozen):
    """A generated token's log-probability (after logits processors, as mlx-lm reports it)
    over the whole vocabulary, and the ``top`` most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Delta(Frozen):
    """Newly generated tokens of one request and the text they complete."""

    kind: Literal["delta"] = "delta"
    id: RequestId
    text: str
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asked for them
    # the prompt's tokens after its first, scored (prompt_logprobs), before any generated one
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    embedding: tuple[float, ...] = ()  # the prompt's, when the request asked (embed)


FinishReason = Literal["stop", "length", "cancelled"]


class Done(Frozen):
    kind: Literal["done"] = "done"
    id: RequestId
    finish_reason: FinishReason
    stop_string: str | None = None  # the request's stop string that ended it, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV cache came from the prompt cache
    # Speculative decoding: tokens drafted by prompt lookup, and of them those the target
    # model agreed with (the rest were rejected and their positions trimmed).
    drafted_tokens: int = Field(default=0, ge=0)
    accepted_tokens: int = Field(default=0, ge=0)
    prompt_seconds: float = 0.0  # until the first generated token
    seconds: float = 0.0


class RequestFailed(Frozen):
    """This request failed (and only it: the ranks keep serving the others)."""

    kind: Literal["failed"] = "failed"
    id: RequestId
    message: str
    # Its structured output's grammar failed while decoding: the client's schema, not the
    # server (the API answers it as the schema's error)
    grammar: bool = False


ConductorEvent = Annotated[Hello | Delta | Done | RequestFailed, Field(discriminator="kind")]


# ---- rank -> supervisor ------------------------------------------------------------------


class RankMemory(Frozen):
    """MLX memory of a rank, bytes: peak while loading its shard, peak so far, active now."""

    load_peak: int = 0
    peak: int = 0
    active: int = 0


# The supervisor (`exo_tp.process.supervisor`) reads these by their base classes.


class Joining(ChildHello):
    """The first message of a rank to its supervisor (``child``: the token it was given)."""

    kind: Literal["joining"] = "joining"
    epoch: Epoch
    rank: Rank


class Loading(ChildPhase):
    kind: Literal["loading"] = "loading"
    phase: Literal["loading"] = "loading"
    epoch: Epoch


class Ready(ChildReady):
    kind: Literal["ready"] = "ready"
    epoch: Epoch
    rank: Rank
    links: tuple[LinkProfile, ...] = ()  # its stage's links, timed as the group formed
    memory: RankMemory = RankMemory()


class Heartbeat(ChildHeartbeat):
    """Sent every second from a thread: a frozen process sends none, a rank stuck in a
    collective keeps sending them with ``steps`` (batch steps completed) no longer growing
    while ``busy`` (requests in flight)."""

    kind: Literal["heartbeat"] = "heartbeat"
    memory: RankMemory = RankMemory()
    speed: RankSpeed | None = None  # its latest live speed sample (exo_tp.runtime.speed_probe)


class RankFailed(ChildFailed):
    kind: Literal["rank_failed"] = "rank_failed"


RankEvent = Annotated[
    Joining | Loading | Ready | Heartbeat | RankFailed, Field(discriminator="kind")
]


# ---- conductor -> the other ranks --------------------------------------------------------


class Insert(Frozen):
    """A request joins the batch (every rank inserts it at the same step)."""

    kind: Literal["insert"] = "insert"
    uid: BatchUid  # the batch generator's id: every rank's must agree
    tokens: tuple[int, ...]
    max_tokens: int
    save_logits: bool = False
    # Overlapped pipelines: the micro-batch (lane) it joins; every rank steps the lanes in turn.
    lane: int = Field(default=0, ge=0)
    keep_prompt: bool = False  # the prompt's cache goes to the prompt cache at its first token
    # Prompt-lookup drafts per step for this sequence (0: never speculates); the conductor
    # resolves the request's and the node's settings so that every rank holds the same.
    draft_tokens: int = Field(default=0, ge=0, le=MAX_DRAFT_TOKENS)
    vision: VisionPrompt | None = None  # the prompt's images: its span runs from a registry
    prompt_logprobs: int | None = None  # score the prompt (every rank runs it: collectives)
    embed: Literal["last", "mean"] | None = None  # the prompt's pooled final hidden state


class Remove(Frozen):
    """Requests leave the batch (cancelled, or stopped by a stop string)."""

    kind: Literal["remove"] = "remove"
    uids: tuple[BatchUid, ...]


class Tokens(Frozen):
    """Earlier pipeline stages: the tokens the conductor sampled in one step, and how many
    batch changes it had committed by then (the same number rides on the last stage's token
    broadcast)."""

    kind: Literal["tokens"] = "tokens"
    tokens: tuple[int, ...]
    committed: int
    # Whose rows, in order: overlapped stages hand each row its token by uid a step later.
    uids: tuple[BatchUid, ...] = ()


class Drafts(Frozen):
    """Earlier pipeline stages: the draft model's drafts for the next verify step (the last
    stage's ranks take them from the conductor's broadcast, exo_tp.runtime.draft_model). Sent
    before that step's Tokens, so the stage feeds them to its first layers and then compares
    them with the sampled tokens as every rank does."""

    kind: Literal["drafts"] = "drafts"
    tokens: tuple[int, ...]


class EndTokens(Frozen):
    """The conductor's first message to each of its followers: the tokens that end a sequence
    (its tokenizer's), so that a follower builds its batch without loading the tokenizer, and
    whether the conductor drafts with a draft model (it loaded one: the followers then take
    the drafts from its broadcast, exo_tp.runtime.draft_model)."""

    kind: Literal["end_tokens"] = "end_tokens"
    ids: tuple[int, ...]
    model_drafts: bool = False


StageControl = Annotated[Insert | Remove | Tokens | Drafts | EndTokens, Field(discriminator="kind")]


# ---- pipeline hops -----------------------------------------------------------------------


class HiddenHeader(Frozen):
    """Precedes the raw bytes of an activation sent to the next pipeline stage."""

    kind: Literal["hidden"] = "hidden"
    shape: tuple[int, ...]
    dtype: str  # numpy dtype of the bytes that follow
    cast: str  # MLX dtype to restore (bfloat16 travels as float32)


HopMessage = Annotated[Hello | HiddenHeader, Field(discriminator="kind")]

SOURCE_MESSAGES: TypeAdapter[Generate | Cancel] = TypeAdapter(SourceMessage)
CONDUCTOR_EVENTS: TypeAdapter[Hello | Delta | Done | RequestFailed] = TypeAdapter(ConductorEvent)
RANK_EVENTS: TypeAdapter[Joining | Loading | Ready | Heartbeat | RankFailed] = TypeAdapter(
    RankEvent
)
STAGE_CONTROL: TypeAdapter[Insert | Remove | Tokens | Drafts | EndTokens] = TypeAdapter(
    StageControl
)
HOP_MESSAGES: TypeAdapter[Hello | HiddenHeader] = TypeAdapter(HopMessage)
HELLO: TypeAdapter[Hello] = TypeAdapter(Hello)
