"""One OpenAI Agents SDK turn with a function tool, then one with a structured `output_type`,
run by tests/cluster/test_agent_clis.py under the agents' own Python (where .ci/install puts
openai-agents, apart from exo-tp's environment). Arguments: the cluster's /v1 URL, "chat" or
"responses" (the SDK's two OpenAI models), the prompt. Prints one JSON line: the calls the model
made, what the tool returned, the final output, and the structured turn's output as the SDK
parsed it into its pydantic type."""

from __future__ import annotations

import json
import sys
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel


class Verdict(BaseModel):
    """A structured output with bounded values: a tiny model's answer always completes."""

    answer: Literal["yes", "no"]
    sure: bool


@function_tool
def shout(text: str) -> str:
    """Shout the text."""
    return text.upper() + "!"


def main() -> None:
    base_url, api, prompt = sys.argv[1:4]
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = (
        OpenAIChatCompletionsModel(model="default_model", openai_client=client)
        if api == "chat"
        else OpenAIResponsesModel(model="default_model", openai_client=client)
    )
    agent = Agent(
        name="exo-tp",
        instructions="You are a helpful assistant.",
        model=model,
        tools=[shout],
        model_settings=ModelSettings(temperature=0, max_tokens=64),
    )
    result = Runner.run_sync(agent, prompt, max_turns=3)
    calls = [
        {"name": item.raw_item.name, "arguments": json.loads(item.raw_item.arguments)}
        for item in result.new_items
        if item.type == "tool_call_item"
    ]
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    # The SDK asks for its output type's strict JSON schema (response_format on chat,
    # text.format on responses) and parses the answer into it, raising if it does not match.
    judge = Agent(
        name="judge",
        instructions="Answer the question.",
        model=model,
        output_type=Verdict,
        model_settings=ModelSettings(temperature=0, max_tokens=64),
    )
    verdict = Runner.run_sync(judge, "Is Paris in France?", max_turns=1).final_output
    assert isinstance(verdict, Verdict)
    print(
        json.dumps(
            {
                "calls": calls,
                "outputs": outputs,
                "final": str(result.final_output),
                "structured": verdict.model_dump(),
            }
        )
    )


if __name__ == "__main__":
    main()
