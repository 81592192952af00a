"""A model folder with random weights in another folder's shape, for a machine without the model.

The lab's many-core runs go to a lent machine that reaches no hub and takes a small working
tree: it gets the model's config.json and tokenizer files, and this builds the weights there
with the bench scripts' writer of random models (bench/_common.py's ``write_model``, mlx-lm's
own classes).
Decode speed does not depend on the weights' values. The end-of-sequence tokens' output rows
are zeroed, so greedy decoding never stops early (every run decodes all its tokens). KEY=VALUE
pairs change the config first (another shape with the same tokenizer: e.g. hidden_size=1024
intermediate_size=4096 num_hidden_layers=16 num_attention_heads=16 num_key_value_heads=4).

    python bench/shaped_model.py FROM_FOLDER OUT_FOLDER [KEY=VALUE ...]
    python bench/shaped_model.py --quick

``--quick`` builds a 2-layer, 64-wide model from the default model's folder in a temporary
folder, checks that its end-of-sequence rows are zero when read back, removes it and prints
one JSON line (the usual run prints the folder).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from _common import end_rows, resolve, write_model

# The quick run's shape; model_type as a bare string takes the KEY=VALUE parser's other branch.
QUICK = (
    "num_hidden_layers=2",
    "hidden_size=64",
    "intermediate_size=128",
    "num_attention_heads=2",
    "num_key_value_heads=1",
    "head_dim=32",
    "model_type=llama",
)
USAGE = "python bench/shaped_model.py FROM_FOLDER OUT_FOLDER [KEY=VALUE ...] | --quick"


def build(source: Path, out: Path, pairs: list[str]) -> Path:
    """``source``'s shape changed by ``pairs``, random weights, EOS output rows zeroed."""
    changes: dict[str, object] = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        try:
            changes[key] = json.loads(value)  # numbers, lists, true/false
        except json.JSONDecodeError:
            changes[key] = value  # a bare string (model_type=qwen2)
    return write_model(out, source, **changes)


def quick() -> None:
    with tempfile.TemporaryDirectory(prefix="shaped-model-") as tmp:
        out = build(resolve("smollm2-135m"), Path(tmp) / "model", list(QUICK))
        config = json.loads((out / "config.json").read_text())
        weights = mx.load(str(out / "model.safetensors"))
        head, eos = end_rows(config, weights)
        zeroed = bool(mx.all(weights[head][mx.array(eos)] == 0).item())
        if not zeroed:
            raise SystemExit("the end-of-sequence rows are not zero")
        shape = {k: config[k] for k in (p.split("=", 1)[0] for p in QUICK)}
        size = sum(f.stat().st_size for f in out.iterdir())
        print(json.dumps({"config": shape, "bytes": size, "eos_rows_zeroed": zeroed}))


def main() -> None:
    if sys.argv[1:] == ["--quick"]:
        quick()
    elif len(sys.argv) < 3 or not all("=" in a for a in sys.argv[3:]):
        raise SystemExit(USAGE)
    else:
        print(build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]))


if __name__ == "__main__":
    main()
