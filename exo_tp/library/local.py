"""`exo_tp.load(...)`: a model split over ranks on this machine, driven from Python the way
mlx-lm's `load` / `generate` / `stream_generate` are.

    with exo_tp.load("smollm2-135m", ranks=3, weights=[5, 3, 2]) as model:
        print(model.generate("The capital of France is", max_tokens=16))

The ranks are `exo-tp launch`'s (exo_tp.runtime.local_ranks), kept running between requests;
several threads may generate at once (the ranks batch them). One thread here reads everything
the conductor says and hands each request its own answers.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exo_tp.errors import ExoTpError
from exo_tp.wire.ids import RequestId
from exo_tp.wire.runtime import Delta, Done, RequestFailed

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from exo_tp.plan.pipeline import PipelinePlan
    from exo_tp.runtime.local_ranks import Answer, LocalRanks
    from exo_tp.vision.families import NoImages
    from exo_tp.vision.prompt import ImagePrompter
    from exo_tp.wire.assignment import DType
    from exo_tp.wire.runtime import GenerateRequest
    from exo_tp.wire.vision import VisionPrompt


@dataclass(frozen=True)
class GenerationResponse:
    """One piece of a streamed answer, named as mlx-lm's `GenerationResponse` is. A piece may
    carry several tokens (``tokens``; ``token`` is its last); the last piece has
    ``finish_reason`` ("stop" or "length") and no text of its own."""

    text: str
    token: int | None
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    finish_reason: str | None = None


class _Stream:
    """One request's answers, handed over by the reader thread."""

    def __init__(self) -> None:
        self.answers: queue.Queue[Answer | ExoTpError] = queue.Queue()


class LoadedModel:
    """A model served by local ranks. Close it (or use it as a context manager) to stop them."""

    def __init__(
        self,
        ranks: LocalRanks,
        tokenizer: TokenizerWrapper,
        plan: PipelinePlan,
        images: ImagePrompter | NoImages | None = None,
    ):
        self.tokenizer, self.plan = tokenizer, plan
        self.images = images  # a vision checkpoint's processor (None: it takes no images)
        self._ranks = ranks
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._error: ExoTpError | None = None
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="exo-tp answers", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Hand each answer to its request; a rank's failure ends every request."""
        try:
            while True:
                answer = self._ranks.next_answer()
                with self._lock:
                    stream = self._streams.get(answer.id)
                if stream is not None:
                    stream.answers.put(answer)
        except ExoTpError as error:
            with self._lock:
                self._error = error if not self._closed else ExoTpError("the model was closed")
                streams = list(self._streams.values())
            for stream in streams:
                stream.answers.put(self._error)

    def _start(self, request: GenerateRequest) -> _Stream:
        stream = _Stream()
        with self._lock:
            if self._closed:
                raise ExoTpError("the model was closed")
            if self._error is not None:
                raise self._error
            self._streams[request.id] = stream
        # A broken link to the conductor: the reader hands this stream the ranks' failure.
        with contextlib.suppress(OSError):
            self._ranks.send(request)
        return stream

    def _prompt(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """Token ids as mlx-lm's `stream_generate` makes them of a string (the BOS token added
        unless the text starts with it; no chat template: apply it yourself, as with mlx-lm)."""
        if not isinstance(prompt, str):
            return tuple(int(t) for t in prompt)
        bos = self.tokenizer.bos_token
        special = bos is None or not prompt.startswith(bos)
        return tuple(self.tokenizer.encode(prompt, add_special_tokens=special))

    def _image_prompt(
        self, prompt: str | Sequence[int], images: Sequence[Any]
    ) -> tuple[tuple[int, ...], VisionPrompt]:
        from exo_tp.vision.families import NoImages

        if self.images is None or isinstance(self.images, NoImages):
            why = self.images.reason if self.images else "its checkpoint has no vision tower"
            raise ExoTpError(f"this model takes no images ({why})")
        if not isinstance(prompt, str):
            raise ExoTpError("a prompt with images is text: the processor places the images")
        from PIL import Image

        try:
            pictures = [
                (i if isinstance(i, Image.Image) else Image.open(i)).convert("RGB") for i in images
            ]
            tokens, vision = self.images.prompt(prompt, pictures)
        except (OSError, ValueError) as error:
            raise ExoTpError(f"the images could not be read: {error}") from None
        return tuple(tokens), vision

    def stream_generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        *,
        temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        logprobs: bool = False,
        image: Sequence[Any] | None = None,
    ) -> Iterator[GenerationResponse]:
        """Generate from ``prompt`` (text or token ids), yielding the answer as it comes.
        Sampling arguments are mlx-lm's `make_sampler`'s; ``stop``: stop strings; ``image``:
        PIL images or image files for a vision model, as mlx-vlm's `generate` takes them
        (the prompt rendered with the chat template, e.g. by mlx-vlm's apply_chat_template)."""
        from exo_tp.wire.runtime import GenerateRequest, OutOfVocabulary, SamplingParams

        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            logprobs=logprobs,
        )
        tokens, vision = self._prompt(prompt), None
        if image:
            tokens, vision = self._image_prompt(prompt, image)
        request = GenerateRequest(
            id=RequestId(f"library-{next(self._ids)}"),
            tokens=tokens,
            sampling=sampling,
            stop=tuple(stop),
            vision=vision,
        )
        try:
            request = request.fit(self.plan.stages[0].tp.spec.vocab_size)
        except OutOfVocabulary as error:
            raise ExoTpError(f"the prompt does not fit the model: {error}") from None
        stream = self._start(request)
        try:
            yield from _responses(stream, len(request.tokens))
        finally:
            with self._lock:
                finished = self._streams.pop(request.id, None) is None
            if not finished and not self._closed and self._error is None:
                self._ranks.cancel(request.id)  # the caller stopped reading early

    def generate(
        self, prompt: str | Sequence[int], max_tokens: int = 256, verbose: bool = False, **kwargs
    ) -> str:
        """The whole answer's text (``kwargs``: `stream_generate`'s); ``verbose`` prints it as
        it comes and then its speeds, as mlx-lm's `generate` does."""
        text, last = [], None
        for last in self.stream_generate(prompt, max_tokens, **kwargs):
            text.append(last.text)
            if verbose:
                print(last.text, end="", flush=True)
        if verbose and last is not None:
            print(f"\nPrompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
            print(
                f"Generation: {last.generation_tokens} tokens, "
                f"{last.generation_tps:.3f} tokens-per-sec"
            )
        return "".join(text)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._ranks.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _responses(stream: _Stream, prompt_tokens: int) -> Iterator[GenerationResponse]:
    started = time.perf_counter()
    first: float | None = None
    generated = 0
    while True:
        answer = stream.answers.get()
        if isinstance(answer, ExoTpError):
            raise answer
        if isinstance(answer, RequestFailed):
            raise ExoTpError(f"generation failed: {answer.message}")
        now = time.perf_counter()
        first = first if first is not None else now
        prompt_tps = prompt_tokens / max(first - started, 1e-9)
        if isinstance(answer, Done):
            decode = answer.seconds - answer.prompt_seconds
            yield GenerationResponse(
                text="",
                token=None,
                tokens=(),
                logprobs=None,
                prompt_tokens=answer.prompt_tokens,
                prompt_tps=answer.prompt_tokens / answer.prompt_seconds
                if answer.prompt_seconds
                else prompt_tps,
                generation_tokens=answer.completion_tokens,
                generation_tps=answer.completion_tokens / decode if decode > 0 else 0.0,
                finish_reason=answer.finish_reason,
            )
            return
        assert isinstance(answer, Delta)
        generated += len(answer.tokens)
        yield GenerationResponse(
            text=answer.text,
            token=answer.tokens[-1] if answer.tokens else None,
            tokens=answer.tokens,
            logprobs=tuple(p.logprob for p in answer.logprobs) if answer.logprobs else None,
            prompt_tokens=prompt_tokens,
            prompt_tps=prompt_tps,
            generation_tokens=generated,
            generation_tps=(generated - 1) / (now - first) if now > first else 0.0,
        )


def load(
    model: str,
    ranks: int = 1,
    weights: Sequence[float] | None = None,
    *,
    stages: Sequence[int] | None = None,
    dtype: DType = "float32",
    max_concurrency: int = 8,
    prompt_cache_size: int = 10,
    join_timeout: float = 120.0,
) -> LoadedModel:
    """Split ``model`` (a prepared name, an mlx-lm folder or a hub id) over ``ranks`` local
    ranks with shares ``weights`` (default equal), as ``stages`` tensor-parallel groups chained
    as pipeline stages (default one), start them and wait until they serve."""
    from exo_tp.models.registry import resolve_model
    from exo_tp.models.tokenizer import load_model_tokenizer
    from exo_tp.plan import load_spec
    from exo_tp.plan.of_model import weighted_plan
    from exo_tp.plan.pipeline import plan_pipeline
    from exo_tp.runtime.local_ranks import LocalRanks
    from exo_tp.vision.families import NoImages, unsupported_vision_family, vision_config
    from exo_tp.wire.assignment import ServingOptions

    shares = list(weights) if weights is not None else [1.0] * ranks
    if len(shares) != ranks:
        raise ExoTpError(f"{len(shares)} weights for {ranks} ranks")
    model_dir = resolve_model(model)
    spec = load_spec(model_dir)
    if stages is None:  # a model without a table: stages of whole layers, as `exo-tp plan`
        plan, _ = weighted_plan(spec, shares)
    else:
        if sum(stages) != ranks:
            raise ExoTpError(f"stages {list(stages)} add up to {sum(stages)} ranks, not {ranks}")
        bounds = list(itertools.accumulate(stages, initial=0))
        plan = plan_pipeline(spec, [shares[a:b] for a, b in itertools.pairwise(bounds)], None)
    serving = ServingOptions(max_concurrency=max_concurrency, prompt_cache_size=prompt_cache_size)
    # The ranks multiply with the system's OpenBLAS, as `exo-tp`'s own processes do (this
    # process is the library user's and is left as it is).
    blas = [_preloaded()] * plan.size
    local = LocalRanks(str(Path(model_dir)), plan, dtype, serving, None, blas, join_timeout)
    try:
        local.wait_ready()
    except BaseException:
        local.close(graceful=False)
        raise
    images: ImagePrompter | NoImages | None = None
    if vision_config(model_dir) is not None:
        from exo_tp.vision.prompt import ImagePrompter

        images = ImagePrompter(model_dir)
    elif (why := unsupported_vision_family(model_dir)) is not None:
        images = NoImages(why)
    return LoadedModel(local, load_model_tokenizer(model_dir), plan, images)


def _preloaded() -> dict[str, str]:
    """The variables that preload the chosen BLAS in a child (none where nothing is to be)."""
    import os

    from exo_tp.process.blas import preload_environment

    return {k: v for k, v in preload_environment().items() if os.environ.get(k) != v}
