"""Ollama API replies as typed models (the shapes of the official `ollama` client's types): model
views, chat and generate answers and their NDJSON lines, errors."""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def body(self) -> dict[str, Any]:
        """The JSON body: fields left unset (None) are left out, as Ollama leaves them."""
        return self.model_dump(exclude_none=True)


def timestamp(unix: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes ``created_at``."""
    moment = datetime.datetime.fromtimestamp(
        datetime.datetime.now(datetime.timezone.utc).timestamp() if unix is None else unix,
        datetime.timezone.utc,  # datetime.UTC is Python 3.11's
    )
    return moment.isoformat().replace("+00:00", "Z")


# ---- model views ---------------------------------------------------------------------------


class ModelDetails(_Reply):
    parent_model: str = ""
    format: str = "safetensors"
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ModelCard(_Reply):
    name: str
    model: str
    modified_at: str
    size: int = 0  # the cluster holds shards; no one file has the model's size
    digest: str = ""
    details: ModelDetails = ModelDetails()


FOREVER = "2318-01-01T00:00:00Z"  # Ollama's far future for a model kept loaded


class RunningModel(ModelCard):
    # when it is let go if idle (exo_tp.node.leader.keep_alive); FOREVER: kept loaded until
    # another model is asked for
    expires_at: str = FOREVER
    size_vram: int = 0
    context_length: int | None = None


class Tags(_Reply):
    models: list[ModelCard]


class Running(_Reply):
    models: list[RunningModel]


class Show(_Reply):
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    details: ModelDetails = ModelDetails()
    model_info: dict[str, int] = {}
    capabilities: list[str]
    modified_at: str


class Version(_Reply):
    version: str
    exo_tp: str


class Error(_Reply):
    error: str


# ---- answers -------------------------------------------------------------------------------


class CallFunction(_Reply):
    name: str
    arguments: dict[str, Any]


class ToolCall(_Reply):
    function: CallFunction


class Message(_Reply):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None


class Statistics(_Reply):
    """Whether a line is the answer's last, and the last one's statistics (durations in
    nanoseconds)."""

    done: bool
    done_reason: Literal["stop", "length", "load", "unload"] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class _Line(Statistics):
    """One answer, or one NDJSON line of it; the last has ``done`` and the statistics."""

    model: str
    created_at: str


class ChatLine(_Line):
    message: Message


class GenerateLine(_Line):
    response: str
