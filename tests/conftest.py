"""Shared fixtures: prepared default models and single-device mlx-lm references."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The shared helpers (tests/*.py) and every tier's modules, which import each other by name
# (tests/unit: pure; tests/ranks: MLX in-process and ring jobs; tests/cluster: nodes, clients,
# browsers; docs/testing.md).
TIERS = ("unit", "ranks", "cluster")
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), *(str(ROOT / "tests" / tier) for tier in TIERS)]
# Workers are started with `python -m exo_tp...` from this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)
# Every process the tests start (ranks, nodes, CLIs, bench scripts) imports exo_tp from here;
# with bytecode writing off (PYTHONDONTWRITEBYTECODE, set on these VMs) each compiled its
# modules from source again: ~0.4 s of CPU per process (2.2 -> 1.8 s for a rank's imports).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

from exo_tp.process.blas import PRELOAD_ENV, PRELOADED_ENV, preload_blas  # noqa: E402
from exo_tp.transport.ring_wait import WAIT_ENV  # noqa: E402

# Set in pytest-xdist's workers (the README's test command runs two, tests/machine_share.py).
WORKER_ENV = "PYTEST_XDIST_WORKER"
if WORKER_ENV in os.environ:
    # Two workers share the cores: ranks that spin while they wait (exo-tp's choice where each
    # rank has a core) would take them from the other worker's processes. A test of the waits
    # themselves sets its own.
    os.environ.setdefault(WAIT_ENV, "sleep")

# The single-device references this process computes multiply with the system's OpenBLAS, as
# exo-tp's own processes do: MLX's bundled BLAS made them ~4x slower (a 228-token tool prompt
# and 36 tokens of SmolLM2: 32.7 s, 7.4 s preloaded), the suite's largest avoidable cost.
# pytest re-executes itself once with the library preloaded (before MLX loads: test modules
# import it at collection), then puts the environment back, so that every process a test
# starts chooses its BLAS as it would from a shell (`EXO_TP_BLAS=bundled` still means the
# bundled one there).
_STARTED_WITH = "EXO_TP_TESTS_LD_PRELOAD"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if _STARTED_WITH not in os.environ:
        os.environ[_STARTED_WITH] = os.environ.get(PRELOAD_ENV, "")
        # pytest's output capture holds stdout and stderr: the new process gets the real ones
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        preload_blas()  # returns only when there is nothing to preload
        if capture is not None:
            capture.start_global_capturing()
    if _distributes(config):
        # pytest-xdist's workers start from this environment: they inherit the preload (they
        # cannot re-execute themselves: the controller talks to them over their stdin) and put
        # the environment back themselves, in this hook.
        return
    if started_with := os.environ.pop(_STARTED_WITH):
        os.environ[PRELOAD_ENV] = started_with
    else:
        os.environ.pop(PRELOAD_ENV, None)
    os.environ.pop(PRELOADED_ENV, None)


def _distributes(config: pytest.Config) -> bool:
    """This process is pytest-xdist's controller: it starts workers and runs no test."""
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and WORKER_ENV not in os.environ and not config.option.collectonly


# No test may reach the real model hub or touch this user's Hugging Face cache: hub tests
# point HF_ENDPOINT at a stand-in hub on loopback (tests/hub_standin.py) and a cache of their own.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ["HF_HOME"] = str(
    Path(os.environ.get("TMPDIR", "/tmp")) / f"exo-tp-tests-hf-{os.getpid()}"
)
os.environ.pop("HF_TOKEN", None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="run the whole architecture x ranks x quantization matrix "
        "(tests/ranks/test_arch_matrix.py), not only its default sample",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (a bench script covers it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (pyproject's addopts) with every ``alone`` module in one unit of
    work (tests/machine_share.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from machine_share import AloneTogether, alone_modules

    AloneTogether.alone = alone_modules(ROOT / "tests")
    return AloneTogether(config, log)


@pytest.fixture(scope="session")
def _machine_hold(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from machine_share import MachineShare

    share = MachineShare(tmp_path_factory.getbasetemp().parent)
    yield share
    share.release()


@pytest.fixture(scope="module", autouse=True)
def machine_share(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, a module marked ``alone`` (it measures speeds or links, or times
    itself) runs with no other module beside it, from its first fixture to its last."""
    if WORKER_ENV not in os.environ:
        yield
        return
    share = request.getfixturevalue("_machine_hold")
    with share.module(alone=request.node.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session", autouse=True)
def private_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Nodes the tests start never read or write this user's cluster secret, nor take a secret
    or API key from the environment the tests were started in."""
    saved = {
        k: os.environ.pop(k, None) for k in ("XDG_CONFIG_HOME", "EXO_TP_SECRET", "EXO_TP_API_KEY")
    }
    config = tmp_path_factory.mktemp("config")
    os.environ["XDG_CONFIG_HOME"] = str(config)
    try:
        yield config
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


@pytest.fixture(scope="session")
def default_models() -> dict[str, Path]:
    from exo_tp.models.registry import prepare_default_models

    return prepare_default_models()


@pytest.fixture(scope="session")
def tiny_smollm2(default_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer and head groups on tiny random weights (tests/tiny_models.py): the
    cluster tests that check exactness, batching and the API, not the model's answers."""
    from tiny_models import write_tiny_smollm2

    folder = tmp_path_factory.mktemp("tiny-smollm2") / "smollm2-tiny"
    return write_tiny_smollm2(folder, default_models["smollm2-135m"])
