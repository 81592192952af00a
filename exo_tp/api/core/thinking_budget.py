"""A thinking budget (Anthropic's `thinking.budget_tokens`): the model thinks for at most that
many tokens. The generation runs in two parts: up to the budget; then, when the model is still
thinking, its thinking block is closed for it (the template's end marker, as budget forcing
does with Qwen3 and DeepSeek models) and the answer goes on from there as a second request
whose prompt is the first one's with every token so far (the prompt cache holds them). One
stream of events comes out, ending with one `Done` that counts both parts."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.api.backend import Backend
from exo_tp.frozen import replace
from exo_tp.wire.ids import RequestId
from exo_tp.wire.runtime import Delta, Done, GenerateRequest


def still_thinking(tokenizer: TokenizerWrapper, text: str, opened: bool) -> bool:
    """Whether ``text`` ends inside a thinking block (``opened``: the prompt opened one)."""
    start, end = tokenizer.think_start, tokenizer.think_end
    last = text.rfind(start)
    if last >= 0:
        return text.find(end, last + len(start)) < 0
    return opened and end not in text


async def within_budget(
    node: Backend, request: GenerateRequest, budget: int, opened: bool
) -> AsyncGenerator[Delta | Done, None]:
    """``request``'s events, its thinking cut after ``budget`` tokens (``opened``: the prompt
    opened the thinking block)."""
    tokenizer = node.tokenizer
    total = request.sampling.max_tokens
    if not tokenizer.has_thinking or total <= budget:  # nothing to cut
        async with aclosing(node.generate(request)) as events:
            async for event in events:
                yield event
        return
    first = replace(request, sampling=replace(request.sampling, max_tokens=budget))
    text, tokens, done = "", list(request.tokens), None
    async with aclosing(node.generate(first)) as events:
        async for event in events:
            if isinstance(event, Done):
                done = event
                break
            text += event.text
            tokens += event.tokens
            yield event
    assert done is not None  # Backend.generate ends with one
    if done.finish_reason != "length" or not still_thinking(tokenizer, text, opened):
        yield done
        return
    close = f"{tokenizer.think_end}\n\n"
    closing = tokenizer.encode(close, add_special_tokens=False)
    yield Delta(id=request.id, text=close, tokens=tuple(closing))
    spent = done.completion_tokens + len(closing)
    if spent >= total:
        yield replace(done, completion_tokens=spent)
        return
    rest = replace(
        request,
        id=RequestId(f"{request.id}-answer"),
        tokens=(*tokens, *closing),
        sampling=replace(request.sampling, max_tokens=total - spent),
    )
    async with aclosing(node.generate(rest)) as events:
        async for event in events:
            if isinstance(event, Delta):
                yield replace(event, id=request.id)
                continue
            yield replace(
                event,
                id=request.id,
                prompt_tokens=done.prompt_tokens,
                cached_tokens=done.cached_tokens,
                completion_tokens=spent + event.completion_tokens,
                prompt_seconds=done.prompt_seconds,
                seconds=done.seconds + event.seconds,
            )
