"""The library API (`exo_tp.load`, `exo_tp.plan`, `exo_tp.Client`), tested like the CLI: a
side-effect-free import, the plan the CLI prints, and local ranks whose answers equal
single-device mlx-lm's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from helpers import mlx_lm_reference, run_cli, wait_gone
from lab_profiles import lab_profile

import exo_tp
from exo_tp.errors import ExoTpError

# What `import exo_tp` may change in a fresh interpreter: nothing but exo_tp's own modules.
IMPORT_PROBE = """
import json, logging, os, sys
env, meta, handlers = dict(os.environ), list(sys.meta_path), list(logging.getLogger().handlers)
before = set(sys.modules)
import exo_tp
print(json.dumps({
    "env": dict(os.environ) == env,
    "meta_path": list(sys.meta_path) == meta,
    "logging": list(logging.getLogger().handlers) == handlers and not logging.root.handlers,
    "new": sorted(set(sys.modules) - before),
}))
"""


def test_importing_exo_tp_has_no_side_effects() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["env"] and seen["meta_path"] and seen["logging"], seen
    assert all(name.startswith("exo_tp") for name in seen["new"]), seen["new"]  # no mlx, no BLAS


def test_plan_by_weights_is_what_the_cli_prints(default_models: dict[str, Path]) -> None:
    printed = run_cli("plan", "--model", "smollm2-135m", "--weights", "5,3,2", "--json")
    assert printed.returncode == 0, printed.stderr
    ours = exo_tp.plan("smollm2-135m", weights=[5, 3, 2])
    assert ours.model_dump_json(indent=2) == printed.stdout.strip()


def test_plan_by_profiles_is_what_the_cli_prints(
    default_models: dict[str, Path], tmp_path: Path
) -> None:
    files = []
    for name, speed in (("fast", 60.0), ("slow", 20.0), ("slower", 8.0)):
        path = tmp_path / f"{name}.json"
        path.write_text(lab_profile(speed).model_dump_json())
        files.append(path)
    args = [a for f in files for a in ("--profile", str(f))]
    printed = run_cli("plan", "--model", "smollm2-135m", *args, "--streams", "2", "--json")
    assert printed.returncode == 0, printed.stderr
    ours = exo_tp.plan("smollm2-135m", profiles=files, streams=2)
    assert json.loads(ours.model_dump_json()) == json.loads(printed.stdout)


def test_plan_refuses_in_one_readable_error() -> None:
    with pytest.raises(ExoTpError, match="weights or profiles, not both"):
        exo_tp.plan("smollm2-135m", weights=[1, 1], profiles=["a.json"])


@pytest.fixture(scope="module")
def loaded(default_models: dict[str, Path]) -> exo_tp.LoadedModel:
    with exo_tp.load("smollm2-135m", ranks=3, weights=[5, 3, 2]) as model:
        yield model
    pids = [child.process.pid for child in model._ranks.ranks]
    assert wait_gone(pids, 15) == []  # closing stopped every rank


PROMPT = "The three primary colors are"


def test_generate_equals_single_device_mlx_lm(
    loaded: exo_tp.LoadedModel, default_models: dict[str, Path]
) -> None:
    reference = mlx_lm_reference(default_models["smollm2-135m"], PROMPT, 16, chat_template=False)
    assert loaded.generate(PROMPT, max_tokens=16) == reference.text
    pieces = list(loaded.stream_generate(PROMPT, max_tokens=16))
    assert [t for p in pieces for t in p.tokens] == reference.tokens
    assert pieces[-1].finish_reason == "length" and pieces[-1].generation_tokens == 16


def test_threads_generate_at_once_and_an_abandoned_stream_hurts_no_one(
    loaded: exo_tp.LoadedModel, default_models: dict[str, Path]
) -> None:
    prompts = ["Paris is the capital of", "def fibonacci(n):", PROMPT]
    expected = [
        mlx_lm_reference(default_models["smollm2-135m"], p, 12, chat_template=False).text
        for p in prompts
    ]
    abandoned = loaded.stream_generate("Once upon a time", max_tokens=200)
    next(abandoned)
    abandoned.close()  # cancels it on the ranks
    answers: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: answers.update({i: loaded.generate(prompts[i], 12)}))
        for i in range(len(prompts))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert [answers.get(i) for i in range(len(prompts))] == expected


def test_a_rank_dying_fails_the_request_in_one_error(default_models: dict[str, Path]) -> None:
    model = exo_tp.load("smollm2-135m", ranks=2, weights=[1, 1])
    try:
        psutil.Process(model._ranks.ranks[1].process.pid).kill()
        with pytest.raises(ExoTpError, match="rank 1"):
            model.generate(PROMPT, max_tokens=200)
    finally:
        model.close()


def test_bad_input_is_one_readable_error_and_the_ranks_keep_serving(
    loaded: exo_tp.LoadedModel, default_models: dict[str, Path]
) -> None:
    with pytest.raises(ExoTpError, match="1 weights for 2 ranks"):
        exo_tp.load("smollm2-135m", ranks=2, weights=[1])
    with pytest.raises(ExoTpError, match=r"stages \[2, 2\] add up to 4 ranks, not 3"):
        exo_tp.load("smollm2-135m", ranks=3, stages=[2, 2])
    with pytest.raises(ExoTpError, match="does not fit the model"):
        list(loaded.stream_generate([10**9], max_tokens=4))
    reference = mlx_lm_reference(default_models["smollm2-135m"], PROMPT, 4, chat_template=False)
    assert loaded.generate(PROMPT, max_tokens=4) == reference.text
