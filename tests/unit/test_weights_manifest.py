"""The weight manifest: offsets and block digests against the safetensors package and hashlib,
identity, the cache and its invalidation; the pure modules import no MLX."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from arch_configs import tiny_config
from safetensors import safe_open
from tiny_models import write_tiny_model

from exo_tp.weights import build
from exo_tp.weights.build import manifest_for
from exo_tp.weights.manifest import DIGEST_BYTES


def test_block_digests_are_the_digests_of_slices(
    default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = default_models["smollm2-135m-q4"]
    manifest = manifest_for(folder, tmp_path_factory.getbasetemp() / "manifests")
    assert {f.name for f in manifest.extra_files} == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        assert set(f.keys()) == {t.name for t in manifest.tensors}
        for name in [
            "model.embed_tokens.weight",
            "model.layers.7.self_attn.o_proj.weight",
            "model.layers.7.self_attn.o_proj.scales",
            "model.layers.2.mlp.up_proj.biases",
            "model.layers.29.mlp.down_proj.weight",
            "model.norm.weight",
        ]:
            entry = manifest.tensor(name)
            full = f.get_tensor(name)
            assert entry.shape == full.shape and entry.nbytes == full.nbytes
            assert len(entry.digests) == len(entry.cuts) - 1 >= 1
            for i, (a, b) in enumerate(zip(entry.cuts, entry.cuts[1:], strict=False)):
                block = full[(slice(None),) * entry.axis + (slice(a, b),)]
                want = hashlib.sha256(np.ascontiguousarray(block).tobytes()).hexdigest()
                assert entry.digests[i] == want[: 2 * DIGEST_BYTES], (name, i)
    # the split axis of each kind: rows of column-parallel weights, packed columns of row-
    # parallel ones (4 bits: 8 columns per uint32), whole for norms
    assert manifest.tensor("model.layers.0.self_attn.q_proj.weight").axis == 0
    down = manifest.tensor("model.layers.0.mlp.down_proj.weight")
    assert down.axis == 1 and down.cuts[1] == 32 * 4 // 32  # FFN grain 32 = 4 uint32
    assert manifest.tensor("model.layers.0.mlp.down_proj.scales").cuts[1] == 1  # 32 / group 32
    assert manifest.tensor("model.norm.weight").cuts == (0, 576)
    whole = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert manifest.weight_files[0].digest == whole


def test_identity_and_cache(
    tmp_path: Path, default_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_tiny_model(
        tmp_path / "model", tiny_config("llama"), default_models["smollm2-135m"]
    )
    cache = tmp_path / "cache"
    builds = []
    real = build.build_manifest
    monkeypatch.setattr(build, "build_manifest", lambda f: builds.append(f) or real(f))
    first = manifest_for(folder, cache)
    assert manifest_for(folder, cache) == first and len(builds) == 1  # cached
    os.utime(folder / "tokenizer.json")  # touched: recomputed, same content, same identity
    assert manifest_for(folder, cache).identity == first.identity and len(builds) == 2
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"rope_theta": 10000.0', '"rope_theta": 1e4'))
    assert manifest_for(folder, cache).identity != first.identity and len(builds) == 3
    with open(folder / "model.safetensors", "r+b") as f:  # one weight byte changes
        f.seek(first.tensor("model.norm.weight").offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    changed = manifest_for(folder, cache)
    assert len(builds) == 4 and changed.weight_files[0].digest != first.weight_files[0].digest
    assert changed.tensor("model.norm.weight").digests != first.tensor("model.norm.weight").digests


def test_pure_modules_import_no_mlx() -> None:
    code = (
        "import sys; import exo_tp.weights.boxes, exo_tp.weights.transfer, "
        "exo_tp.weights.layout, exo_tp.weights.describe, exo_tp.weights.store, "
        "exo_tp.weights.server, exo_tp.weights.client; "
        "assert not [m for m in sys.modules if m.startswith('mlx')], 'mlx imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
