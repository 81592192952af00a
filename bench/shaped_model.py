"""A model folder with random weights in another folder's shape, for a machine without the model.

The lab's many-core runs go to a lent machine that reaches no hub and takes a small working
tree: it gets the model's config.json and tokenizer files, and this builds the weights there.
Decode speed does not depend on the weights' values. The end-of-sequence tokens' output rows
are zeroed, so greedy decoding never stops early (every run decodes all its tokens).

    python bench/shaped_model.py FROM_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    config = json.loads((source / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    eos = config.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    rows = mx.ones((weights[head].shape[0], 1), dtype=weights[head].dtype)
    rows[mx.array(eos)] = 0
    weights[head] = weights[head] * rows
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    print(out)


if __name__ == "__main__":
    main()
