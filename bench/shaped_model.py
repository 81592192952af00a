"""A model folder with random weights in another folder's shape, for a machine without the model.

The lab's many-core runs go to a lent machine that reaches no hub and takes a small working
tree: it gets the model's config.json and tokenizer files, and this builds the weights there
with the test suite's writer of random models (tests/tiny_models.py, mlx-lm's own classes).
Decode speed does not depend on the weights' values. The end-of-sequence tokens' output rows
are zeroed, so greedy decoding never stops early (every run decodes all its tokens). KEY=VALUE
pairs change the config first (another shape with the same tokenizer: e.g. hidden_size=1024
intermediate_size=4096 num_hidden_layers=16 num_attention_heads=16 num_key_value_heads=4).

    python bench/shaped_model.py FROM_FOLDER OUT_FOLDER [KEY=VALUE ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from _common import ROOT


def main() -> None:
    if len(sys.argv) < 3 or not all("=" in a for a in sys.argv[3:]):
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from tiny_models import write_tiny_model

    config = json.loads((source / "config.json").read_text())
    for pair in sys.argv[3:]:
        key, value = pair.split("=", 1)
        try:
            config[key] = json.loads(value)  # numbers, lists, true/false
        except json.JSONDecodeError:
            config[key] = value  # a bare string (model_type=qwen2)
    write_tiny_model(out, config, source, form="mlx")
    path = out / "model.safetensors"
    weights = mx.load(str(path))
    eos = config.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    rows = mx.ones((weights[head].shape[0], 1), dtype=weights[head].dtype)
    rows[mx.array(eos)] = 0
    weights[head] = weights[head] * rows
    mx.eval(weights)  # every array in memory before the file they came from is rewritten
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    print(out)


if __name__ == "__main__":
    main()
