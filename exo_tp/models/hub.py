"""Hub models (`ORG/NAME[@revision]`): found in the standard Hugging Face cache, or downloaded
once with `huggingface_hub` (resumable, checked, with progress), only the files mlx-lm reads.

Every failure is one line (`HubError`, with the HTTP status an API request should answer).
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from exo_tp.errors import ExoTpError

log = logging.getLogger(__name__)

# What mlx_lm.load reads: config, weights, tokenizer and chat-template files (as mlx-lm's own
# _download asks for), nothing else (no PyTorch or GGUF copies of the same weights).
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(ExoTpError):
    """A hub model that cannot be had, in one line; ``status`` is the HTTP answer for an API."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class HubRef(BaseModel):
    """``ORG/NAME`` at a revision (a branch, tag or commit; ``main`` when not given)."""

    model_config = ConfigDict(frozen=True)
    repo_id: str
    revision: str = "main"

    def __str__(self) -> str:
        return self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"


class DownloadProgress(BaseModel):
    """Bytes of one download so far (for the log, /v1/cluster and the web UI)."""

    model_config = ConfigDict(frozen=True)
    model: str
    done: int
    total: int
    state: str  # "downloading" | "done" | "failed"
    error: str | None = None


def hub_ref(name: str) -> HubRef | None:
    """``ORG/NAME[@rev]`` as a hub reference; None for anything else (a folder, a default name).

    A name that exists as a local folder is a folder, whatever it looks like.
    """
    repo, _, revision = name.partition("@")
    if not _REPO_ID.match(repo) or Path(name).expanduser().exists():
        return None
    if name.endswith("@"):
        return None
    return HubRef(repo_id=repo, revision=revision or "main")


def cached(ref: HubRef) -> Path | None:
    """The model's folder in the Hugging Face cache if every file mlx-lm needs is there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    try:
        folder = Path(
            snapshot_download(
                ref.repo_id,
                revision=ref.revision,
                allow_patterns=ALLOW_PATTERNS,
                local_files_only=True,
            )
        )
    # Not there, or incomplete (a download to finish): not cached. LocalEntryNotFoundError is
    # both of these (and a FileNotFoundError); a bad id is not ours to hide either way.
    except (EntryNotFoundError, FileNotFoundError, HFValidationError):
        return None
    return folder if _is_model(folder) else None


def _is_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def check(ref: HubRef) -> int:
    """Asks the hub what the download would be: the bytes still to fetch, or a HubError (no
    such repo, gated, offline, not an MLX model)."""
    from huggingface_hub import snapshot_download

    try:
        files = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            allow_patterns=ALLOW_PATTERNS,
            dry_run=True,
            tqdm_class=_bar_class(lambda n: None, show=False),
        )
    except Exception as error:
        raise _one_line(ref, error) from None
    names = {f.filename for f in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HubError(
            f"{ref} is not an MLX model: it has no config.json and *.safetensors "
            "(convert it with mlx_lm.convert, or pick an mlx-community repo)",
            status=400,
        )
    # (a size the hub does not know, None, counts as nothing)
    return sum(f.file_size or 0 for f in files if f.will_download)


def download(ref: HubRef, progress: Callable[[DownloadProgress], None] | None = None) -> Path:
    """The model's folder, fetched into the Hugging Face cache unless it is already there.

    huggingface_hub resumes partial files, checks every file's size, and retries a dropped
    connection; ``progress`` gets the bytes so far every half second (plus a bar on a terminal).
    """
    from huggingface_hub import constants, snapshot_download

    folder = cached(ref)
    if folder is not None:
        return folder
    if constants.HF_HUB_OFFLINE:
        raise HubError(f"{ref} is not in the Hugging Face cache and HF_HUB_OFFLINE is set", 404)
    total = check(ref)
    cache = Path(constants.HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < total:
        raise HubError(
            f"{ref}: the disk is full: {total / 1e6:.1f} MB to download, "
            f"{free / 1e6:.1f} MB free in {cache}",
            507,
        )
    log.info("downloading %s (%.1f MB) from %s", ref, total / 1e6, constants.ENDPOINT)
    watcher = _Watcher(str(ref), total, progress)
    watcher.start()
    try:
        folder = Path(
            snapshot_download(
                ref.repo_id,
                revision=ref.revision,
                allow_patterns=ALLOW_PATTERNS,
                tqdm_class=watcher.bar_class(),
            )
        )
    except Exception as error:
        failure = _one_line(ref, error)
        watcher.stop("failed", str(failure))
        raise failure from None
    watcher.stop("done")
    if not _is_model(folder):
        raise HubError(f"{ref} is not an MLX model: no config.json and *.safetensors")
    log.info("downloaded %s to %s", ref, folder)
    return folder


class _Watcher:
    """Turns huggingface_hub's byte bars into DownloadProgress reports, twice a second."""

    def __init__(
        self, model: str, total: int, report: Callable[[DownloadProgress], None] | None
    ) -> None:
        self.model, self.total, self.report = model, total, report
        self.done = 0
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def bar_class(self) -> type:
        def seen(n: int) -> None:
            self.done = max(self.done, n)

        return _bar_class(seen, show=sys.stderr.isatty())

    def start(self) -> None:
        self.thread.start()

    def _emit(self, state: str, error: str | None = None) -> None:
        if self.report is not None:
            done = self.total if state == "done" else min(self.done, self.total)
            self.report(
                DownloadProgress(
                    model=self.model, done=done, total=self.total, state=state, error=error
                )
            )

    def _run(self) -> None:
        logged = 0.0
        while not self.finished.wait(0.5):
            self._emit("downloading")
            if time.monotonic() - logged > 10:
                logged = time.monotonic()
                log.info(
                    "downloading %s: %.1f of %.1f MB", self.model, self.done / 1e6, self.total / 1e6
                )

    def stop(self, state: str, error: str | None = None) -> None:
        self.finished.set()
        self.thread.join()
        self._emit(state, error)


def _bar_class(seen: Callable[[int], None], show: bool) -> type:
    """huggingface_hub's progress bar, drawn only on a terminal, telling ``seen`` its bytes."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Bar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not show:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if getattr(self, "unit", None) == "B":
                seen(int(self.n))
            return shown

    return Bar


def _one_line(ref: HubRef, error: BaseException) -> HubError:
    """huggingface_hub's exceptions (several lines, a request id) as one line and a status."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, HubError):
        return error
    if error.__cause__ is not None and type(error).__name__ == "DryRunError":
        return _one_line(ref, error.__cause__)  # the hub's own answer is the cause
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return HubError(f"{ref}: the disk is full ({error.strerror})", 507)
    if isinstance(error, GatedRepoError):
        return HubError(
            f"{ref} is gated: accept its licence on the hub and set HF_TOKEN to a token with "
            "access",
            403,
        )
    if isinstance(error, RepositoryNotFoundError):
        return HubError(f"{ref}: no such model on the hub (or it is private: set HF_TOKEN)", 404)
    if isinstance(error, RevisionNotFoundError):
        return HubError(f"{ref}: the hub has no revision {ref.revision!r}", 404)
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        code = error.response.status_code
        if code in (401, 403):
            return HubError(f"{ref}: the hub refused access ({code}); set HF_TOKEN", 403)
        return HubError(f"{ref}: the hub answered HTTP {code}", 502)
    unreachable = {"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError"}
    if isinstance(error, LocalEntryNotFoundError) or unreachable & {
        c.__name__ for c in type(error).__mro__
    }:
        return HubError(f"{ref}: cannot reach the hub and the model is not in the cache", 503)
    if isinstance(error, ValueError) and "disk" in str(error).lower():
        return HubError(f"{ref}: not enough disk space ({_first_line(error)})", 507)
    name = type(error).__name__
    return HubError(f"{ref}: download failed: {name}: {_first_line(error)}", 502)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]
