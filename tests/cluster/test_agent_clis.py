"""The real agent CLIs against a real 2-node cluster, each completing a turn that calls a tool
and reads its result (issue #40): Claude Code (`claude -p`), Codex CLI (`codex exec`), aider,
`llm`, and the OpenAI Agents SDK with its chat and its Responses model.

The cluster serves SmolLM2 with a tool-capable template (tests/tool_model.py). SmolLM2 copies
text it is asked to repeat, so each prompt hands it the call to make in its template's format;
the CLI must then parse the call from the stream, run its own tool, send the result back and
end the turn. What the tool returned (which only the CLI can produce) shows the round trip.
SmolLM2's context is 8192 tokens: each CLI is started with the flags or settings that shrink
its prompt to fit (a short system prompt, only the tool used), as a user of a small local model
would. The CLIs come from .ci/install (under ~/.local/share/exo-tp/agents, or $EXO_TP_AGENTS);
a test whose CLI is missing skips with the reason. Each CLI is configured never to reach
anthropic.com or openai.com: its base URL is the cluster's, telemetry and updates off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from api_reference import SingleDevice
from cluster_helpers import LocalCluster, local_cluster
from openai import OpenAI
from tool_model import write_tool_model

AGENTS = Path(os.environ.get("EXO_TP_AGENTS", Path.home() / ".local/share/exo-tp/agents"))
BIN_DIRS = [AGENTS / "npm/node_modules/.bin", AGENTS / "aider/bin", AGENTS / "py/bin"]
TURN_TIMEOUT = 300  # seconds: a turn is two or three generations on a shared 2-core box
REPEAT = "Please repeat exactly this text and nothing else:\n"


def _tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the tool model's template writes one (and mlx-lm's json_tools parser reads)."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"{REPEAT}<tool_call>\n{call}\n</tool_call>"


def _cli(name: str) -> str:
    for folder in BIN_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (.ci/install puts it under {AGENTS})")
    return found


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI's run, which must succeed (a failure shows its output)."""
    done = subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, "HOME": str(cwd), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TURN_TIMEOUT,
    )
    assert done.returncode == 0, (
        args[0],
        done.returncode,
        done.stdout[-3000:],
        done.stderr[-3000:],
    )
    return done


@pytest.fixture(scope="module")
def model_dir(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("agents") / "smollm2-tools"
    return write_tool_model(folder, default_models["smollm2-135m"])


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> SingleDevice:
    return SingleDevice(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[LocalCluster]:
    # A request without max_tokens (Codex's, llm's) gets ANSWER_TOKENS rather than the node's
    # default 512: SmolLM2 may ramble after a tool's result, at ~0.1 s a token here.
    extra = ("--max-tokens", str(ANSWER_TOKENS))
    with local_cluster(2, weights=[0.6, 0.4], model=str(model_dir), extra=extra) as running:
        yield running


LEFT_OUT = "x-exo-tp-tools-left-out"
ANSWER_TOKENS = 64  # the reference's answers end (end of turn) before
BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "The command to execute"}},
    "required": ["command"],
}


def _expected(
    ref: SingleDevice, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[list[int], tuple[str, list[dict[str, Any]]]]:
    """Single-device mlx-lm's prompt and answer (its text and parsed calls) for a request."""
    prompt = ref.chat_tokens(messages, tools)
    generated = ref.generate(prompt, ANSWER_TOKENS)
    assert generated.finish_reason == "stop"
    return prompt, ref.tool_calls(generated.text, tools)


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _text(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": text, **extra}


def test_claude_code_request_as_sent(cluster: LocalCluster, ref: SingleDevice) -> None:
    """The fields of Claude Code's request (captured from 2.1.332), through the anthropic SDK:
    a system message inside the conversation is rendered where it stands, thinking, effort
    and context management change nothing on this model, a deferred and a built-in tool are
    not shown to it (the built-in one named in the header), and max_tokens 128000 is a cap."""
    # a timeout of its own: the SDK refuses a whole (not streamed) answer of 128000 tokens
    client = anthropic.Anthropic(
        base_url=cluster.urls[0], api_key="unused", max_retries=0, timeout=TURN_TIMEOUT
    )
    call = _tool_call("Bash", {"command": "echo hi"})
    cache = {"type": "ephemeral"}
    body: dict[str, Any] = {
        "model": "claude-opus-5-5",  # any name: a node serves its one model
        "max_tokens": 128000,
        "system": [_text("You are a Claude agent."), _text("Be helpful.", cache_control=cache)],
        "messages": [
            {"role": "system", "content": [_text("Be brief.")], "output_config": {"effort": "low"}},
            {"role": "system", "content": []},
            {"role": "user", "content": call},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": BASH_SCHEMA},
            {"name": "Later", "input_schema": BASH_SCHEMA, "defer_loading": True},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "metadata": {"user_id": '{"device_id":"0"}'},
        "extra_body": {
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
    }
    raw = client.messages.with_raw_response.create(**body)
    assert raw.headers[LEFT_OUT] == "web_search"
    reply = raw.parse()
    messages = [
        {"role": "system", "content": "You are a Claude agent.\nBe helpful."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": call},
    ]
    bash = _function("Bash", "Run a command", BASH_SCHEMA)
    prompt, (_, calls) = _expected(ref, messages, [bash])
    assert reply.usage.input_tokens == len(prompt)
    assert calls, "the reference makes no call: the prompt no longer shows one"
    uses = [(b.name, b.input) for b in reply.content if b.type == "tool_use"]
    assert uses == [(c["name"], c["arguments"]) for c in calls]
    assert reply.stop_reason == "tool_use"


def _input(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def test_codex_request_as_sent(cluster: LocalCluster, ref: SingleDevice) -> None:
    """The fields of Codex CLI's request (captured from 0.171.0), through the openai SDK: a
    namespace tool's functions are offered to the model after the function tools before it,
    web_search is left out (named in the header), developer messages are system messages."""
    client = OpenAI(base_url=f"{cluster.urls[1]}/v1", api_key="unused", max_retries=0)
    run = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    target = {"type": "object", "properties": {"target": {"type": "string"}}}
    call = _tool_call("exec_command", {"cmd": "echo hi"})
    close = {"name": "close_agent", "description": "Close an agent", "parameters": target}
    body: dict[str, Any] = {
        "model": "gpt-5.5-codex",
        "input": [_input("developer", "You are a coding agent."), _input("user", call)],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Run a command",
                "strict": False,
                "parameters": run,
            },  # fmt: skip
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Sub-agents",
                "tools": [{"type": "function", "strict": False, **close}],
            },  # fmt: skip
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "extra_body": {"client_metadata": {"session_id": "session-1", "turn_id": "turn-1"}},
    }
    raw = client.responses.with_raw_response.create(**body)
    assert raw.headers[LEFT_OUT] == "web_search"
    reply = raw.parse()
    tools = [_function("exec_command", "Run a command", run), _function(**close)]
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": call},
    ]
    prompt, (_, calls) = _expected(ref, messages, tools)
    assert reply.usage and reply.usage.input_tokens == len(prompt)
    assert calls, "the reference makes no call: the prompt no longer shows one"
    made = [(o.name, json.loads(o.arguments)) for o in reply.output if o.type == "function_call"]
    assert made == [(c["name"], c["arguments"]) for c in calls]
    assert [t.name for t in reply.tools if t.type == "function"] == ["exec_command", "close_agent"]


def _json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_claude_code_turn_with_a_tool(cluster: LocalCluster, tmp_path: Path) -> None:
    """`claude -p` over the Messages API: what it sends as it is (system messages inside the
    conversation, adaptive thinking, context_management, output_config, max_tokens 128000,
    streaming), one Bash call it runs, and the answer after its result."""
    out = _run(
        [
            _cli("claude"),
            "-p",
            "--bare",  # no CLAUDE.md, hooks or attribution reminders
            "--tools",
            "Bash",
            "--allowedTools",
            "Bash",
            "--max-turns",
            "3",
            "--system-prompt",
            "You are a helpful assistant.",
            "--output-format",
            "stream-json",
            "--verbose",
            _tool_call("Bash", {"command": "echo hi"}),
        ],
        tmp_path,
        {
            "ANTHROPIC_BASE_URL": cluster.urls[1],
            "ANTHROPIC_API_KEY": "unused",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
        },
    ).stdout
    events = _json_lines(out)
    blocks = [
        (event["type"], block)
        for event in events
        if event["type"] in ("assistant", "user")
        for block in event["message"]["content"]
        if isinstance(block, dict)
    ]
    uses = [b for kind, b in blocks if kind == "assistant" and b["type"] == "tool_use"]
    results = [b for kind, b in blocks if kind == "user" and b["type"] == "tool_result"]
    assert [(u["name"], u["input"]) for u in uses[:1]] == [("Bash", {"command": "echo hi"})]
    assert results and results[0]["tool_use_id"] == uses[0]["id"]
    assert results[0]["content"] == "hi" and not results[0]["is_error"]  # Bash ran it
    end = events[-1]
    assert end["type"] == "result" and end["subtype"] == "success" and not end["is_error"], end
    assert end["num_turns"] >= 2  # it answered after reading the result


CODEX_CONFIG = """\
model = "default_model"
model_provider = "exo-tp"
model_instructions_file = "{instructions}"
web_search = "disabled"
[agents]
enabled = false
[features]
goals = false
[model_providers.exo-tp]
name = "exo-tp"
base_url = "{url}/v1"
wire_api = "responses"
"""


def test_codex_cli_turn_with_a_tool(cluster: LocalCluster, tmp_path: Path) -> None:
    """`codex exec` over the Responses API (developer messages, reasoning and include fields,
    store false, prompt_cache_key, client_metadata, streaming): one exec_command call it
    runs, and the answer after its result."""
    home = tmp_path / "codex"
    home.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text("You are a coding agent. Run commands with exec_command.\n")
    (home / "config.toml").write_text(
        CODEX_CONFIG.format(instructions=instructions, url=cluster.urls[0])
    )
    out = _run(
        [
            _cli("codex"),
            "exec",
            "--skip-git-repo-check",
            "--json",
            _tool_call("exec_command", {"cmd": "echo hi"}),
        ],
        tmp_path,
        {"CODEX_HOME": str(home)},
    ).stdout
    items = [e["item"] for e in _json_lines(out) if e["type"] == "item.completed"]
    commands = [i for i in items if i["type"] == "command_execution"]
    assert commands and "echo hi" in commands[0]["command"], items
    assert commands[0]["aggregated_output"] == "hi\n" and commands[0]["exit_code"] == 0
    assert any(i["type"] == "agent_message" for i in items[items.index(commands[0]) :]), items
    assert _json_lines(out)[-1]["type"] == "turn.completed"


AIDER_SETTINGS = """\
- name: openai/default_model
  edit_format: whole
  examples_as_sys_msg: true
"""


def test_aider_turn_edits_a_file(cluster: LocalCluster, tmp_path: Path) -> None:
    """aider (through litellm, chat completions): its tool is the edit, a whole-file listing
    it parses from the answer and writes to disk."""
    settings = tmp_path / "models.yml"
    settings.write_text(AIDER_SETTINGS)
    work = tmp_path / "work"
    work.mkdir()
    _run(
        [
            _cli("aider"),
            "--model",
            "openai/default_model",
            "--model-settings-file",
            str(settings),
            "--openai-api-base",
            f"{cluster.urls[1]}/v1",
            "--openai-api-key",
            "unused",
            "--no-git",
            "--yes-always",
            "--no-show-model-warnings",
            "--no-check-update",
            "--no-analytics",
            "--no-pretty",
            "--message",
            f'{REPEAT}hello.py\n```\nprint("hi")\n```',
        ],
        work,
        {"LITELLM_LOCAL_MODEL_COST_MAP": "True"},  # no fetch of litellm's price list
    )
    assert (work / "hello.py").read_text() == 'print("hi")\n'


LLM_MODELS = """\
- model_id: exo-tp
  model_name: default_model
  api_base: "{url}/v1"
  supports_tools: true
"""
SHOUT = """
def shout(text: str) -> str:
    "Shout the text."
    return text.upper() + "!"
"""


def test_llm_turn_with_a_tool(cluster: LocalCluster, tmp_path: Path) -> None:
    """Simon Willison's `llm` (chat completions, streamed): a Python function as its tool."""
    (tmp_path / "extra-openai-models.yaml").write_text(LLM_MODELS.format(url=cluster.urls[0]))
    done = _run(
        [
            _cli("llm"),
            "-m",
            "exo-tp",
            "--functions",
            SHOUT,
            "--td",  # prints each call and what the tool returned
            _tool_call("shout", {"text": "hi"}),
        ],
        tmp_path,
        {"LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"},
    )
    debug = done.stderr  # --td writes there
    assert "Tool call: shout({'text': 'hi'})\n  HI!" in debug, (debug, done.stdout)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_turn_with_a_tool(
    cluster: LocalCluster, tmp_path: Path, api: str
) -> None:
    """The OpenAI Agents SDK, with a function tool, on its chat and its Responses model; then
    a structured `output_type`, decoded under its schema and parsed by the SDK."""
    python = AGENTS / "py/bin/python"
    if not python.exists() or subprocess.run([python, "-c", "import agents"]).returncode:
        pytest.skip(f"openai-agents is not installed (.ci/install puts it in {AGENTS}/py)")
    script = Path(__file__).resolve().parents[1] / "agents_sdk_turn.py"
    prompt = _tool_call("shout", {"text": "hi"})
    done = _run([str(python), str(script), f"{cluster.urls[1]}/v1", api, prompt], tmp_path, {})
    turn = json.loads(done.stdout.splitlines()[-1])
    assert turn["calls"][:1] == [{"name": "shout", "arguments": {"text": "hi"}}], turn
    assert turn["outputs"][:1] == ["HI!"] and turn["final"], turn
    assert turn["structured"]["answer"] in ("yes", "no"), turn
    assert isinstance(turn["structured"]["sure"], bool), turn


@pytest.mark.parametrize(("method", "path"), [("HEAD", "/"), ("GET", "/v1/models")])
def test_routes_clients_probe_answer(cluster: LocalCluster, method: str, path: str) -> None:
    """What clients check before their first request: the server is there, a model is served."""
    request = urllib.request.Request(f"{cluster.urls[1]}{path}", method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        body = response.read()
    if method == "GET":
        assert json.loads(body)["data"], body
