"""Every model this machine can serve without a download: the prepared default models, models
in the standard Hugging Face cache, and folders under ``--models-dir``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

Source = Literal["prepared", "hub cache", "folder"]


class LocalModel(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str  # what --model and an API request's "model" take
    source: Source
    folder: Path
    size: int  # bytes of weights
    format: str  # "float", "4-bit", ...
    model_type: str


def describe(name: str, source: Source, folder: Path) -> LocalModel:
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quant = config.get("quantization") or config.get("quantization_config")
    fmt = f"{quant.get('bits', '?')}-bit" if isinstance(quant, dict) else "float"
    model_type = str(config.get("model_type", "?"))
    return LocalModel(
        name=name, source=source, folder=folder, size=size, format=fmt, model_type=model_type
    )


def hub_cached() -> list[LocalModel]:
    """Models in the Hugging Face cache whose snapshot holds a config and safetensors."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            folder = Path(revision.snapshot_path)
            if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
                found.append(describe(repo.repo_id, "hub cache", folder))
                break
    return found


def local_models(models_dirs: Sequence[Path] = ()) -> list[LocalModel]:
    from exo_tp.models.registry import DEFAULT_MODELS, is_prepared, models_home

    found = [
        describe(name, "prepared", models_home() / name)
        for name in DEFAULT_MODELS
        if is_prepared(name)
    ]
    found += hub_cached()
    for root in models_dirs:
        for config in sorted(Path(root).expanduser().glob("*/config.json")):
            found.append(describe(str(config.parent), "folder", config.parent))
    return found
