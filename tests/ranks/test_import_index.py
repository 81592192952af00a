"""exo_tp.process.import_index: transformers' table of lazy imports read back from disk is
the table transformers builds itself, and a process that reads it builds nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# What a process resolves through transformers' lazy modules (every name, the module it comes
# from, the names missing a backend), and whether transformers built its table itself.
PROBE = """
import json, sys
if sys.argv[1] == "on":
    from exo_tp.process.import_index import install
    install()  # the copy, before transformers is imported
import transformers
import transformers.models
from transformers import AutoTokenizer  # noqa: F401 (what mlx-lm's tokenizer_utils resolves)
from transformers.utils import import_utils
views = {
    name: [sorted(module._class_to_module.items()), sorted(module._modules),
           sorted((k, sorted(v)) for k, v in module._object_missing_backend.items())]
    for name, module in (("transformers", transformers), ("models", transformers.models))
}
built = import_utils.create_import_structure_from_path.cache_info().currsize
print(json.dumps({"views": views, "built": built}))
"""


def _probe(switch: str, home: Path) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(home), "EXO_TP_IMPORT_INDEX": switch}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, switch], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_copy_is_transformers_own_table_spares_building_it_and_survives_damage(
    tmp_path: Path,
) -> None:
    own = _probe("off", tmp_path)
    assert own["built"] > 0  # transformers builds it on every import
    first = _probe("on", tmp_path)  # builds it once and writes it
    written = sorted((tmp_path / "exo-tp" / "imports").glob("transformers-*.json"))
    assert written
    again = _probe("on", tmp_path)
    assert first["views"] == own["views"]
    assert again["views"] == own["views"]
    assert again["built"] == 0  # read back: nothing built
    for copy in written:
        copy.write_text("{not json")
    damaged = _probe("on", tmp_path)  # built as without a copy, and written again
    assert damaged["views"] == own["views"] and damaged["built"] > 0
    repaired = _probe("on", tmp_path)
    assert repaired["views"] == own["views"] and repaired["built"] == 0
