"""A model folder whose chat template thinks: the prepared SmolLM2 weights with two unused
special tokens renamed ``<think>`` and ``</think>`` (mlx-lm then finds its thinking markers,
as in Qwen3's tokenizer) and a ChatML template that opens a thinking block when
``enable_thinking`` is on, as Qwen3's does. SmolLM2 copies text it is asked to repeat, so a
prompt can make it close the block and answer: the reasoning and the content are then known
to the test before the model writes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Two ordinary words of SmolLM2's vocabulary become the markers: the model copies them from
# the prompt as it copies any word (it never copies an unused special token), and with their
# merges gone no other text encodes to them.
MARKERS = {"Think": "<think>", "Answer": "</think>"}

THINKING_TEMPLATE = """\
{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


def write_thinking_model(folder: Path, smollm2: Path) -> Path:
    """``folder``: the weights linked, the tokenizer with the thinking markers and template."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").symlink_to(smollm2 / "model.safetensors")
    shutil.copy(smollm2 / "config.json", folder / "config.json")
    tokenizer = json.loads((smollm2 / "tokenizer.json").read_text())
    model = tokenizer["model"]
    for word, marker in MARKERS.items():
        token_id = model["vocab"].pop(word)
        model["vocab"][marker] = token_id
        model["merges"] = [m for m in model["merges"] if word not in (*m, "".join(m))]
        tokenizer["added_tokens"].append(
            {
                "id": token_id,
                "content": marker,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,  # kept in the decoded text, as Qwen3's markers are
            }
        )
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
