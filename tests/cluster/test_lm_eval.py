"""lm-evaluation-harness (PyPI lm-eval) against a real cluster, offline (issue #60): its
local-completions model runs a multiple-choice task and a generate_until task, both defined from
local files (tests/lm_eval_tasks/), through /v1/completions: lists of token-id prompts, echo with
logprobs and max_tokens 1 for a log-likelihood (lm-eval drops the last entry, the generated
token's), stop strings for a generation. lm-eval runs as a user runs it: its CLI, in a process of
its own (docs/api.md, "Evaluation harnesses").

What it reports is checked against single-device mlx-lm (float32) on the same tokens, tokenized
as lm-eval tokenizes them: each choice's log-likelihood, each item's prediction and the accuracy;
each generation and the exact-match score.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import LocalCluster, local_cluster

TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"
MODEL = "smollm2-135m"
# lm-eval's batch: one request carries this many prompts (a list of token-id lists)
BATCH = 8
LL_ATOL = 2e-3  # a continuation's summed log-probabilities, fp32 (a few tokens of ~1e-4 each)

pytestmark = pytest.mark.skipif(
    find_spec("lm_eval") is None, reason="needs lm-eval (.ci/install installs it)"
)


@dataclass
class Run:
    """One lm-eval run: its aggregated results and each task's samples (``--log_samples``)."""

    results: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]]


def run_lm_eval(url: str, tokenizer: Path, output: Path, tasks: str, batch: int = BATCH) -> Run:
    """lm-eval's CLI against the cluster at ``url`` (its API root), offline: the task files'
    data paths are relative to their folder, so it runs there."""
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={tokenizer}",
            "tokenized_requests=True",
            "max_retries=1",
        ]
    )
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions"]
    args += ["--model_args", model_args, "--batch_size", str(batch), "--tasks", tasks]
    args += ["--include_path", ".", "--output_path", str(output), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    done = subprocess.run(
        args, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, f"lm-eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    (results,) = output.rglob("results_*.json")
    samples = {}
    for name in tasks.split(","):
        (path,) = output.rglob(f"samples_{name}_*.jsonl")
        samples[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return Run(json.loads(results.read_text()), samples)


class SingleDevice:
    """mlx-lm's model (float32) and the tokenizer lm-eval loads (transformers' AutoTokenizer
    on the same folder), tokenizing as lm-eval's local-completions does."""

    def __init__(self, folder: Path):
        from helpers import _single_device
        from transformers import AutoTokenizer

        self.model, _ = _single_device(str(folder))
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), use_fast=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's TemplateLM._encode_pair for a causal model: the context's trailing
        spaces move to the continuation; the whole is encoded and split at the context's
        length."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        return context_ids, whole[len(context_ids) :]

    def loglikelihoods(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Each continuation's summed log-probabilities after its context (one forward of
        the pairs right-padded: a causal model's earlier positions never see the padding)."""
        import mlx.core as mx

        encoded = [self.pair(context, continuation) for context, continuation in pairs]
        rows = [context + continuation for context, continuation in encoded]
        width = max(map(len, rows))
        logits = self.model(mx.array([row + [0] * (width - len(row)) for row in rows]))
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sums = []
        for i, (context, continuation) in enumerate(encoded):
            positions = mx.arange(len(context) - 1, len(context) + len(continuation) - 1)
            picked = logprobs[i, positions, mx.array(continuation)]
            sums.append(mx.sum(picked).item())
        return sums

    def greedy(self, context: str, max_tokens: int, until: list[str]) -> str:
        """Greedy tokens after the context, cut at the first stop string (and end of text)."""
        import mlx.core as mx

        ids = self.encode(context)
        generated: list[int] = []
        for _ in range(max_tokens):
            logits = self.model(mx.array(ids + generated)[None])[0, -1]
            token = mx.argmax(logits).item()
            if token == self.tokenizer.eos_token_id:
                break
            generated.append(token)
        text = self.tokenizer.decode(generated)
        for stop in until:
            text = text.split(stop)[0]
        return text


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # three uneven ranks: the vocabulary (and the prompt's scores) split three ways
    with local_cluster(3, weights=[5, 3, 1], model=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def model_dir(default_models: dict[str, Path]) -> Path:
    return default_models[MODEL]


@pytest.fixture(scope="module")
def run(cluster: LocalCluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    output = tmp_path_factory.mktemp("lm-eval")
    return run_lm_eval(cluster.urls[0], model_dir, output, "exo_tp_mc,exo_tp_gen")


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> SingleDevice:
    return SingleDevice(model_dir)


def check_multiple_choice(run: Run, ref: SingleDevice) -> None:
    """Each choice's log-likelihood lm-eval got from the cluster is mlx-lm's, so each item's
    prediction and the accuracy are too."""
    samples = sorted(run.samples["exo_tp_mc"], key=lambda s: s["doc_id"])
    assert samples, "lm-eval logged no samples"
    table, wrong_ll, wrong_pick, right = [], [], [], 0
    for sample in samples:
        doc = sample["doc"]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        ours = [float(r[0][0]) for r in sample["resps"]]  # (log-likelihood, is_greedy)
        theirs = ref.loglikelihoods(pairs)
        assert len(ours) == len(theirs) == len(doc["choices"])
        pick_ours = max(range(len(ours)), key=ours.__getitem__)
        pick_ref = max(range(len(theirs)), key=theirs.__getitem__)
        right += pick_ref == doc["answer"]
        assert sample["acc"] == float(pick_ours == doc["answer"])
        row = f"{doc['question']!r}: lm-eval {[round(x, 4) for x in ours]}"
        table.append(f"{row}, mlx-lm {[round(x, 4) for x in theirs]}")
        if any(abs(a - b) > LL_ATOL for a, b in zip(ours, theirs, strict=True)):
            wrong_ll.append(table[-1])
        if pick_ours != pick_ref:
            wrong_pick.append(doc["question"])
    accuracy = run.results["results"]["exo_tp_mc"]["acc,none"]
    details = "\n".join(table)
    # exactly 0.0: a one-token continuation whose entries lm-eval cut away ([ctxlen:-1] takes
    # the last for the generated token's: the answer must have one, also for end of text)
    assert not wrong_ll, "log-likelihoods differ from mlx-lm's:\n" + "\n".join(wrong_ll)
    assert not wrong_pick, f"predictions differ on {wrong_pick}:\n{details}"
    assert accuracy == pytest.approx(right / len(samples)), details


def check_generations(run: Run, ref: SingleDevice) -> None:
    """Each generation lm-eval got is mlx-lm's greedy one, so exact match agrees."""
    samples = sorted(run.samples["exo_tp_gen"], key=lambda s: s["doc_id"])
    assert samples, "lm-eval logged no samples"
    matched = 0
    for sample in samples:
        (args,) = sample["arguments"].values()
        context, kwargs = args["arg_0"], args["arg_1"]
        expected = ref.greedy(context, kwargs["max_gen_toks"], kwargs["until"])
        assert sample["resps"][0][0] == expected, (context, sample["resps"], expected)
        matched += expected.strip() == sample["target"]
    score = run.results["results"]["exo_tp_gen"]["exact_match,strip"]
    assert score == pytest.approx(matched / len(samples))


def test_multiple_choice_equals_mlx_lm(run: Run, ref: SingleDevice) -> None:
    assert run.results["results"]["exo_tp_mc"]["sample_len"] == 16
    check_multiple_choice(run, ref)


def test_generate_until_equals_mlx_lm(run: Run, ref: SingleDevice) -> None:
    assert run.results["results"]["exo_tp_gen"]["sample_len"] == 6
    check_generations(run, ref)
