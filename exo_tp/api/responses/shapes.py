"""OpenAI Responses API replies as typed models (the shapes of the `openai` SDK's
`openai.types.responses`): the Response object, its output items, and its stream events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from exo_tp.api.responses.schema import FunctionTool, NamedFunction

Status = Literal["in_progress", "completed", "incomplete"]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- output items --------------------------------------------------------------------------


class OutputText(_Reply):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []  # none are made (no citations)
    logprobs: list[Any] = []  # not computed on this API


class ReasoningText(_Reply):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageOutput(_Reply):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class ReasoningOutput(_Reply):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Status
    summary: list[Any] = []  # no summaries are written
    content: list[ReasoningText] = []


class FunctionCallOutput(_Reply):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = MessageOutput | ReasoningOutput | FunctionCallOutput


# ---- the Response object -------------------------------------------------------------------


class InputTokensDetails(_Reply):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(_Reply):
    reasoning_tokens: int = 0


class Usage(_Reply):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(_Reply):
    reason: Literal["max_output_tokens"]


class TextFormat(_Reply):
    type: Literal["text"] = "text"


class TextConfig(_Reply):
    format: TextFormat = TextFormat()


class ResponseObject(_Reply):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    model: str
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    parallel_tool_calls: bool
    previous_response_id: None = None
    temperature: float | None
    top_p: float | None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction
    tools: list[FunctionTool]
    text: TextConfig = TextConfig()
    truncation: Literal["disabled", "auto"]
    metadata: dict[str, str]
    user: str | None
    store: bool = False
    background: bool = False
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    output: list[OutputItem]
    usage: Usage | None = None


# ---- stream events -------------------------------------------------------------------------


class _Event(_Reply):
    sequence_number: int = 0  # set as the event is sent


class ResponseEvent(_Event):
    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete"
    ]
    response: ResponseObject


class ItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class PartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class OutputTextDelta(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDone(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDelta(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None


StreamEvent = (
    ResponseEvent
    | ItemEvent
    | PartEvent
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | ArgumentsDelta
    | ArgumentsDone
    | ErrorEvent
)
