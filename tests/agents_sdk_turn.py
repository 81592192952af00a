"""One OpenAI Agents SDK turn with a function tool, run by tests/test_agent_clis.py under the
agents' own Python (where .ci/install puts openai-agents, apart from exo-tp's environment).
Arguments: the cluster's /v1 URL, "chat" or "responses" (the SDK's two OpenAI models), the
prompt. Prints one JSON line: the calls the model made, what the tool returned, and the final
output."""

from __future__ import annotations

import json
import sys

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
    print(json.dumps({"calls": calls, "outputs": outputs, "final": str(result.final_output)}))


if __name__ == "__main__":
    main()
