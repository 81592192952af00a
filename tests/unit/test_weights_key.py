"""A model's key names the same model on every node: the folder, its manifest and a shard store
mirroring it agree; another model, or an edited config, has another key."""

from __future__ import annotations

import json
from pathlib import Path

from exo_tp.weights.build import manifest_for
from exo_tp.weights.key import folder_key, manifest_key
from exo_tp.weights.store import ShardStore


def test_folder_manifest_and_store_agree(tmp_path: Path, default_models: dict[str, Path]) -> None:
    folder = default_models["smollm2-135m-q4"]
    manifest = manifest_for(folder)
    key = folder_key(folder)
    assert manifest_key(manifest) == key
    store = ShardStore(tmp_path / "store", manifest)  # sparse files: headers, no weights yet
    for extra in manifest.extra_files:
        assert store.write_file(extra.name, (folder / extra.name).read_bytes())
    assert folder_key(store.folder) == key
    store.close()


def test_other_models_have_other_keys(tmp_path: Path, default_models: dict[str, Path]) -> None:
    q4, float_ = default_models["smollm2-135m-q4"], default_models["smollm2-135m"]
    assert folder_key(q4) != folder_key(float_)
    edited = tmp_path / "edited"
    edited.mkdir()
    for path in q4.iterdir():
        if path.is_file():
            (edited / path.name).symlink_to(path)
    config = json.loads((q4 / "config.json").read_text())
    (edited / "config.json").unlink()
    (edited / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert folder_key(edited) != folder_key(q4)
