"""`Ask`, the one request every dialect parses into (a chat's conversation, until its prompt is
rendered, is the shared `Chat` of conversation.py), and `fitted`, which makes it the runtime's
`GenerateRequest`: server defaults for what the client left out, and every value checked
against this model (vocabulary, context) so that nothing a worker could choke on ever leaves
the API."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from exo_tp.api.backend import Backend
from exo_tp.api.core.chat_prompt import Prompt
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.sampling import SamplingFields
from exo_tp.frozen import replace
from exo_tp.wire.ids import RequestId
from exo_tp.wire.runtime import Constraint, GenerateRequest, OutOfVocabulary, SamplingParams

# Below this a temperature divides logits into infinities; its limit is greedy decoding.
MIN_TEMPERATURE = 1e-6
DEFAULT_MODEL_ALIAS = "default_model"  # mlx_lm.server's name for the model it serves


def check_model(node: Backend, model: str | None) -> Backend:
    """The backend serving ``model`` (its tokenizer, template, context, group): 404 for a
    model no node has; 503 while the leader loads it. Checked before the prompt is rendered,
    so a request for another model never meets this one's template."""
    if model is not None and model != DEFAULT_MODEL_ALIAS:
        return node.for_model(model)
    return node


def request_id(prefix: str) -> RequestId:
    """A new generation's id (the runtime's, and OpenAI's answer id)."""
    return RequestId(f"{prefix}-{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Ask:
    """One generation as any dialect asks for it: the rendered prompt, the client's sampling
    fields and token budget, and how its answer is read. ``prompt_param`` names, in errors, the
    dialect's field for the prompt."""

    id: RequestId  # from request_id
    prompt: Prompt
    sampling: SamplingFields
    max_tokens: int | None  # the client's number; None takes the server default
    stream: bool
    stops: Sequence[str] = ()
    prompt_param: str = "messages"
    logprobs: bool = False
    top_logprobs: int = 0
    # the text continues its prompt (completions): a first token's leading space is kept
    continuation: bool = False
    # the text split as mlx_lm.server splits a chat answer (content, reasoning, tool calls);
    # False: all of it content, as a completion's is
    split: bool = True
    max_calls: int | None = None  # tool calls kept (1 when parallel calls are off)
    call_indexes: bool = False  # each tool call numbered, as OpenAI's stream chunks carry them
    # structured output (exo_tp.api.core.structured), and the field that asked for it (in errors);
    # a forced tool call's own (the prompt's) comes before it
    constraint: Constraint | None = None
    constraint_param: str = "response_format"  # the schema's field, as the dialect names it
    thinking_budget: int | None = None  # tokens of thinking at most (thinking_budget.py)
    num_draft_tokens: int | None = None  # speculative drafts per step (None: the node's)
    prompt_logprobs: int | None = None  # the prompt's own log-probabilities (completions' echo)

    def structure(self) -> tuple[Constraint | None, str]:
        """The constraint the text is decoded under, and the field that set it."""
        if self.prompt.constraint is not None:
            return self.prompt.constraint, "tools"
        return self.constraint, self.constraint_param


def fitted(node: Backend, ask: Ask) -> GenerateRequest:
    """The runtime's request for ``ask``: its budget and sampling, checked against the model."""
    budget = token_budget(node, len(ask.prompt.tokens), ask.max_tokens, ask.prompt_param)
    if ask.max_tokens == 0:  # the prompt only (scored): GenerateRequest says it must be
        budget = 0
    sampling = sampling_params(node, ask.sampling, budget, ask.logprobs, ask.top_logprobs)
    request = generate_request(
        node,
        ask.id,
        ask.prompt.tokens,
        sampling,
        ask.stops,
        ask.prompt_param,
        ask.continuation,
        ask.prompt_logprobs,
    )
    if ask.num_draft_tokens is not None:
        request = replace(request, num_draft_tokens=ask.num_draft_tokens)
    if ask.prompt.vision is not None:
        request = replace(request, vision=ask.prompt.vision)
    constraint, _ = ask.structure()
    return request if constraint is None else replace(request, constraint=constraint)


def sampling_params(
    node: Backend, fields: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """mlx_lm.server's reading of the fields (None takes the server's default)."""
    defaults = node.defaults
    temperature = defaults.temperature if fields.temperature is None else fields.temperature
    top_p = defaults.top_p if fields.top_p is None else fields.top_p
    top_k = defaults.top_k if fields.top_k is None else fields.top_k
    min_p = defaults.min_p if fields.min_p is None else fields.min_p
    bias = None
    if fields.logit_bias:
        bias = {int(key): value for key, value in fields.logit_bias.items()}
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        top_p=top_p or 1.0,  # mlx-lm: 0 means off, like 1
        top_k=top_k,  # GenerateRequest.fit reads one keeping every token as no filter
        min_p=min_p,
        xtc_probability=fields.xtc_probability,
        xtc_threshold=fields.xtc_threshold,
        repetition_penalty=fields.repetition_penalty or None,
        repetition_context_size=fields.repetition_context_size,
        presence_penalty=fields.presence_penalty or None,
        presence_context_size=fields.presence_context_size,
        frequency_penalty=fields.frequency_penalty or None,
        frequency_context_size=fields.frequency_context_size,
        logit_bias=bias,
        seed=None if fields.seed is None else fields.seed % 2**64,  # int64 -> mx's uint64
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def token_budget(node: Backend, prompt_tokens: int, wanted: int | None, prompt_param: str) -> int:
    """How many tokens to generate: the request's number, else the server default, either cut
    to what the context leaves after the prompt. A client's number is a cap, not a promise:
    agent CLIs ask for the largest budget of the model they think they talk to (Claude Code
    asks for 32000-128000 tokens), and the answer ends at the context either way
    (``finish_reason: "length"``)."""
    context = node.context_length
    if prompt_tokens >= context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens (the model's, or "
            f"what the cluster's KV cache memory holds); the prompt has {prompt_tokens}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return min(wanted or node.defaults.max_tokens, context - prompt_tokens)


def generate_request(
    node: Backend,
    generation_id: RequestId,
    tokens: list[int],
    sampling: SamplingParams,
    stops: Sequence[str],
    prompt_param: str,
    continuation: bool = False,
    prompt_logprobs: int | None = None,
) -> GenerateRequest:
    """The request, fitted to the model (GenerateRequest.fit: the one check of token ids and
    top_k against the vocabulary); ``prompt_param`` names the prompt's field in errors."""
    if not tokens:
        raise ApiError(400, "The prompt is empty: it encodes to no tokens.", param="prompt")
    request = GenerateRequest(
        id=generation_id,
        tokens=tuple(tokens),
        sampling=sampling,
        stop=tuple(stops),
        continuation=continuation,
        prompt_logprobs=prompt_logprobs,
    )
    try:
        return request.fit(node.vocab_size)
    except OutOfVocabulary as error:
        param = prompt_param if error.field == "tokens" else error.field
        raise ApiError(400, f"Invalid value for '{param}': {error}.", param=param) from None
