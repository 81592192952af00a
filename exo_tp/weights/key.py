"""A model's key: a cheap fingerprint that names the same model on every node.

SHA-256 over config.json's digest and each safetensors file's name, size and raw header (read
from the first bytes of each file, never the weights), so it takes milliseconds even for a
400 GB model, where the manifest's identity (exo_tp.weights.build) hashes every byte. A shard
store mirrors the original's config.json and headers byte for byte, so a store and the folder
it came from have the same key, and ``manifest_key`` gives it from a manifest alone. Two
checkpoints with the same config and tensor layout but other values (fine-tunes) share a key:
every byte that moves is still checked against the manifest's digests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.weights.build import WEIGHT_SUFFIX, file_digest, read_header
from exo_tp.weights.manifest import ModelManifest
from exo_tp.wire.ids import ModelKey

CONFIG = "config.json"


def _key(config_digest: str, files: list[tuple[str, int, str]]) -> ModelKey:
    text = json.dumps({"config": config_digest, "files": sorted(files)})
    return ModelKey(hashlib.sha256(text.encode()).hexdigest()[:32])


def folder_key(folder: Path) -> ModelKey:
    folder = Path(folder)
    config = folder / CONFIG
    if not config.is_file():
        raise ExoTpError(f"{folder}: no {CONFIG} (not an mlx-lm model folder)")
    files = []
    for path in sorted(folder.glob(f"*{WEIGHT_SUFFIX}")):
        header, _ = read_header(path)
        files.append((path.name, path.stat().st_size, header))
    return _key(file_digest(config), files)


def manifest_key(manifest: ModelManifest) -> ModelKey:
    config = next((f for f in manifest.extra_files if f.name == CONFIG), None)
    if config is None:
        raise ExoTpError(f"the manifest of {manifest.identity[:12]} lists no {CONFIG}")
    files = [(f.name, f.size, f.header) for f in manifest.weight_files]
    return _key(config.digest, files)
