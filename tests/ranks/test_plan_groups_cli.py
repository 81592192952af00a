"""`exo-tp plan --profile ... --model A --model B` and `--replicas` (issue #59 points 1, 3
and 5): every model a group of its own on the memory the ones before it left, each one group
or replicas by the objective; a model that no longer fits is one line naming its size."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli
from lab_profiles import lab_profile

GB = 10**9


def _profiles(tmp_path: Path, memory: float) -> list[str]:
    args = []
    for name, speed in (("a", 100.0), ("b", 60.0), ("c", 40.0)):
        path = tmp_path / f"{name}.json"
        profile = lab_profile(speed, node_id=name, memory_available=int(memory * GB))
        path.write_text(profile.model_dump_json())
        args += ["--profile", str(path)]
    return args


def test_two_models_each_a_group_and_the_memory_left(
    tmp_path: Path, default_models: dict[str, Path], tiny_smollm2: Path
) -> None:
    models = ["--model", str(default_models["smollm2-135m"]), "--model", str(tiny_smollm2)]
    args = ["plan", *_profiles(tmp_path, 8), *models, "--context", "2048"]
    text = run_cli(*args).stdout
    assert text.count("(pinned)") == 2 and "memory left for more models: a " in text
    plan = json.loads(run_cli(*args, "--json").stdout)
    assert [g["key"] for g in plan["groups"]] == models[1::2]
    held = [0, 0, 0]
    for group in plan["groups"]:
        for replica, choice in zip(
            group["choice"]["best"]["subsets"], group["choice"]["best"]["choices"], strict=True
        ):
            for rank in choice["best"]["prediction"]["memory"]:
                held[replica[rank["device"]]] += rank["weights"] + rank["kv_cache"]
    assert [m - h for m, h in zip(plan["memory"], held, strict=True)] == plan["left"]


def test_replicas_for_throughput_and_a_model_that_does_not_fit(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    model = str(default_models["smollm2-135m"])
    args = ["plan", *_profiles(tmp_path, 8), "--model", model, "--replicas"]
    text = run_cli(*args, "--objective", "throughput", "--queue", "16").stdout
    assert "replicas over {a" in text and "against" in text
    small = _profiles(tmp_path, 0.6)
    result = run_cli("plan", *small, "--model", model, "--model", model + "/", check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "does not fit beside the models resident: its weights alone need" in lines[-1]


def test_several_models_need_profiles_and_distinct_names(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    model = str(default_models["smollm2-135m"])
    for args, said in [
        (["--model", model, "--model", model + "/x", "--weights", "2,1"], "give one --profile"),
        ([*_profiles(tmp_path, 8), "--model", model, "--model", model], "a model is named twice"),
    ]:
        result = run_cli("plan", *args, check=False)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert said in result.stderr.strip().splitlines()[-1]
