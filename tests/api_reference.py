"""What single-device mlx-lm and mlx_lm.server compute for an API request, built only from
mlx-lm's own code: prompts rendered by mlx_lm.server's tokenizing step, sampling by its
sampler and logits processors (after ``mx.random.seed``), tool calls split and parsed as its
chat handler does."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import (
    CompletionRequest,
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    ResponseGenerator,
    SamplingArguments,
    _make_logits_processors,
    _make_sampler,
)


@dataclass
class Generated:
    tokens: list[int]
    text: str
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token: (id, logprob), most likely first
    finish_reason: str | None


@dataclass
class Sampling:
    """mlx_lm.server's request fields (its defaults when not given)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def arguments(
        self, max_tokens: int, top_logprobs: int = 0, template_kwargs: dict[str, Any] | None = None
    ) -> GenerationArguments:
        return GenerationArguments(
            model=ModelDescription("default_model", "default_model", None),
            sampling=SamplingArguments(
                self.temperature,
                self.top_p,
                self.top_k,
                self.min_p,
                self.xtc_probability,
                self.xtc_threshold,
            ),
            logits=LogitsProcessorArguments(
                self.logit_bias,
                self.repetition_penalty,
                self.repetition_context_size,
                self.presence_penalty,
                self.presence_context_size,
                self.frequency_penalty,
                self.frequency_context_size,
            ),
            stop_words=[],
            max_tokens=max_tokens,
            num_draft_tokens=0,
            logprobs=True,
            top_logprobs=top_logprobs,
            seed=self.seed,
            chat_template_kwargs=template_kwargs,
        )


class SingleDevice:
    def __init__(self, model_dir: Path, chat_template_args: dict[str, Any] | None = None):
        self.model, self.tokenizer = load(str(model_dir))
        self.model.set_dtype(mx.float32)
        self.chat_template_args = chat_template_args or {}
        self._answers: dict[str, Generated] = {}

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt mlx_lm.server's own tokenizing step renders for a chat request."""
        server = SimpleNamespace(
            model_provider=SimpleNamespace(
                processor=None, cli_args=SimpleNamespace(chat_template_args=self.chat_template_args)
            )
        )
        request = CompletionRequest("chat", "", json.loads(json.dumps(messages)), tools, None)
        args = Sampling().arguments(1, template_kwargs=template_kwargs)
        prompt = ResponseGenerator._tokenize(server, self.tokenizer, request, args)[0]
        return list(prompt)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        top_logprobs: int = 0,
    ) -> Generated:
        sampling = sampling or Sampling()
        # Deterministic answers are generated once (several tests compare with the same one).
        key = repr((prompt, max_tokens, sampling, top_logprobs))
        deterministic = sampling.temperature == 0 or sampling.seed is not None
        if deterministic and key in self._answers:
            return copy.deepcopy(self._answers[key])
        out = self._generate(prompt, max_tokens, sampling, top_logprobs)
        if deterministic:
            self._answers[key] = copy.deepcopy(out)
        return out

    def _generate(
        self, prompt: list[int], max_tokens: int, sampling: Sampling, top_logprobs: int
    ) -> Generated:
        args = sampling.arguments(max_tokens, top_logprobs)
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        out = Generated([], "", [], [], None)
        for response in stream_generate(
            self.model,
            self.tokenizer,
            mx.array(prompt),
            max_tokens=max_tokens,
            sampler=_make_sampler(args, self.tokenizer),
            logits_processors=_make_logits_processors(args),
        ):
            row = response.logprobs.astype(mx.float32)
            out.tokens.append(response.token)
            out.text += response.text
            out.logprobs.append(row[response.token].item())
            if top_logprobs:
                best = mx.argsort(-row)[:top_logprobs].tolist()
                out.top.append([(i, row[i].item()) for i in best])
            out.finish_reason = response.finish_reason
        return out

    def tool_calls(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[dict]]:
        """Content and tool calls (name, arguments) of an answer, split by mlx-lm's text state
        machine and parsed by the model's mlx-lm tool parser, as mlx_lm.server does."""
        machine = make_text_state_machine(self.tokenizer)
        state, segments = TextStateMachine.split(machine.make_state("normal"), text)
        content, calls, tool_text, previous = "", [], "", "normal"
        for name, piece in [*segments, ("normal", "")]:
            if name == "tool":
                tool_text += piece
            elif name == "normal":
                if previous == "tool":
                    parsed = self.tokenizer.tool_parser(tool_text, tools)
                    calls += parsed if isinstance(parsed, list) else [parsed]
                    tool_text = ""
                content += piece
            previous = name
        return content, [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
