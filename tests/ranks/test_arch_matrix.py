"""Every supported architecture, float and quantized, on 1 to 6 ranks equals single-device mlx-lm.

Each case writes a tiny random checkpoint of the architecture (tests/arch_configs.py: awkward
head, KV-head and FFN counts) laid out the way real checkpoints are shipped (tests/tiny_models.py:
Hugging Face names, tied heads omitted, quantized variants through mlx-lm's converter), loads
each rank's shard with the engine's loader on real ranks of the MLX ring with random shares,
and compares with mlx-lm run whole in this process on the same folder: prompt logits in fp32
within 1e-4 (absolute; the tiny models' |logits| stay below ~18) and greedy tokens identical, for
float and quantized variants alike (quantized slices are bit-exact, so both checks hold).

Every case with the same rank count runs in one ring job, model after model
(tests/matrix_ring.py), so the matrix costs one start of N processes per rank count, not one
`exo-tp launch` per case; `test_launch_runs_a_family_end_to_end` keeps one case through the
launcher.

The default run is a deterministic sample (SAMPLE); `--full-matrix` runs every architecture x
ranks 1..6 x {float, 4/8-bit at group 32/64/128} (and gpt_oss in MX-FP4, converted by mlx-lm
and as OpenAI ships it).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from arch_configs import ARCHS, tiny_config
from helpers import Reference, assert_logits_close, launch, mlx_lm_reference
from matrix_ring import RingCase, RingCases, RingOutcome, RingOutcomes
from ring_harness import run_on_ranks
from tiny_models import write_tiny_model

from exo_tp.arch import table_for

PROMPT = "Write a short poem about the sea."
TOKENS = 5
# Greedy steps of the references are decided by at least this much (see Reference.margins).
MIN_MARGIN = 1e-3

# name -> quantization (as quantize_model takes it); None is float
VARIANTS: dict[str, dict[str, Any] | None] = {
    "float": None,
    **{
        f"q{bits}g{group}": {"bits": bits, "group_size": group}
        for bits in (4, 8)
        for group in (32, 64, 128)
    },
}
# gpt-oss in MX-FP4 (scales per 32, no biases): every linear, as mlx-lm's converter makes it,
# and OpenAI's own checkpoint (MX-FP4 experts in their Hugging Face layout, the rest float).
ARCH_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt_oss": {
        "mxfp4": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
        "openai": {"openai_mxfp4": True},
    },
    # Kimi K2.5 as shipped: int4 routed experts in compressed-tensors, the rest float.
    "kimi_k25": {"int4": {"compressed_tensors": True}},
}


def variants(arch: str) -> dict[str, dict[str, Any] | None]:
    return {**VARIANTS, **ARCH_VARIANTS.get(arch, {})}


# Weight seeds (default 0), picked so that every variant's reference generates TOKENS tokens
# (no early end of sequence) and decides each greedy step by at least MIN_MARGIN (random tiny
# models have no reason to be peaked).
SEEDS = {
    "gemma3_text": 1,
    "phi3": 1,
    "qwen2_moe": 1,
    "deepseek_v2": 1,
    "bailing_moe": 1,
    "step3p5": 1,
}
# Float checkpoints of these are stored as bf16 (sliced on disk as raw 16-bit words), the
# others as fp32; every run computes in fp32.
BF16_ARCHS = {"qwen3", "gemma3_text", "mixtral", "qwen2_moe", "deepseek_v3"}


@dataclass(frozen=True)
class Case:
    arch: str
    variant: str
    weights: tuple[float, ...]

    @property
    def id(self) -> str:
        shares = "-".join(map(str, self.weights))
        return f"{self.arch}-{self.variant}-n{len(self.weights)}-w{shares}"


def random_weights(n: int, key: str, zero_rank: int | None = None) -> tuple[float, ...]:
    """Deterministic random shares; ``zero_rank`` holds nothing (and still joins every
    collective)."""
    rng = random.Random(zlib.crc32(key.encode()))
    weights = [round(rng.uniform(0.1, 1.0), 2) for _ in range(n)]
    if zero_rank is not None:
        weights[zero_rank] = 0.0
    return tuple(weights)


def case(arch: str, variant: str, n: int, zero_rank: int | None = None) -> Case:
    return Case(arch, variant, random_weights(n, f"{arch}/{variant}/{n}", zero_rank))


# Each architecture twice with different rank counts: float with more ranks than KV heads
# (query-head units, KV heads replicated; deepseek_v3 instead has a zero-weight rank), and one
# quantized variant (all six bit/group combinations appear) with a zero-weight rank in most;
# N from 1 to 6. To keep CI short, gpt_oss runs OpenAI's MX-FP4 form instead of float and
# deepseek_v3 float only (the others run with `--full-matrix`).
SAMPLE = [
    case("llama", "float", 4),
    case("llama", "q4g128", 5, zero_rank=2),
    case("mistral", "float", 3),
    case("mistral", "q8g32", 4, zero_rank=0),
    case("qwen2", "float", 6),
    case("qwen2", "q4g32", 1),
    case("qwen3", "float", 3, zero_rank=1),
    case("qwen3", "q8g64", 2),
    case("gemma2", "float", 4),
    case("gemma2", "q4g64", 3, zero_rank=0),
    case("gemma3_text", "float", 2),
    case("gemma3_text", "q4g32", 3, zero_rank=2),
    case("phi3", "float", 4, zero_rank=3),
    case("phi3", "q8g64", 2),
    case("mixtral", "float", 4),
    case("mixtral", "q8g128", 5, zero_rank=1),
    case("qwen3_moe", "float", 3),
    case("qwen3_moe", "q4g32", 4, zero_rank=0),
    case("qwen2_moe", "float", 4),
    case("qwen2_moe", "q4g64", 2),
    case("deepseek_v2", "float", 6),
    case("deepseek_v2", "q8g32", 3, zero_rank=1),
    case("deepseek_v3", "float", 4, zero_rank=2),
    case("gpt_oss", "openai", 3),
    case("gpt_oss", "q8g64", 5, zero_rank=4),
    # MX-FP4 embeddings look up bfloat16: the rank without vocab rows must send bfloat16 zeros
    case("gpt_oss", "mxfp4", 3, zero_rank=1),
    case("ernie4_5_moe", "float", 5),
    case("ernie4_5_moe", "q8g64", 3, zero_rank=1),
    case("exaone_moe", "float", 4, zero_rank=3),
    case("exaone_moe", "q4g64", 5),
    case("bailing_moe", "float", 3),
    case("bailing_moe", "q4g128", 4, zero_rank=0),
    # GLM/Mistral 4/Kimi/DSA MoE families: float on 3-5 ranks (glm4_moe: more ranks than its
    # 2 KV heads; kimi_k2: more ranks than its 3 heads), quantized with another N; kimi_k25's
    # quantized case is its shipped int4 form.
    case("glm4_moe", "float", 3),
    case("glm4_moe", "q4g64", 4, zero_rank=0),
    case("glm4_moe_lite", "float", 5),
    case("glm4_moe_lite", "q8g32", 2),
    case("mistral4", "float", 3, zero_rank=1),
    case("mistral4", "q8g128", 4),
    case("kimi_k2", "float", 4),  # 3 heads: one rank holds none
    case("kimi_k2", "q4g128", 2),
    case("kimi_k25", "float", 4),
    case("kimi_k25", "int4", 3, zero_rank=2),  # as shipped: compressed-tensors int4 experts
    # Kimi K3: 3 linear-attention heads on 4 uneven ranks (one holds none of them) beside 5 MLA
    # heads; quantized on 3 ranks with a zero-weight one
    case("kimi_k3", "float", 4),
    case("kimi_k3", "q4g64", 3, zero_rank=1),
    case("deepseek_v32", "float", 5, zero_rank=3),
    case("deepseek_v32", "q8g64", 2),
    case("glm_moe_dsa", "float", 3),
    case("glm_moe_dsa", "q4g32", 4, zero_rank=1),
    # Step 3.5: sliding layers with 12 heads, full ones with 8, the same 2 KV heads
    case("step3p5", "float", 3),
    case("step3p5", "q8g64", 4, zero_rank=1),
    # more ranks than KV heads: replicated KV heads are counted once in the full-width k norm
    case("minimax", "float", 5),
    case("minimax", "q8g64", 3, zero_rank=1),
    case("olmo3", "float", 3),
    case("olmo3", "q4g128", 6, zero_rank=4),
    case("gemma4_text", "float", 5, zero_rank=3),
    case("gemma4_text", "q4g64", 3),
    case("gemma4", "float", 3),
    case("gemma4", "q8g32", 4, zero_rank=2),
    case("smollm3", "float", 3),
    case("smollm3", "q4g32", 4, zero_rank=0),
    case("seed_oss", "float", 5),
    case("seed_oss", "q8g128", 2),
    case("exaone4", "float", 3, zero_rank=1),
    case("exaone4", "q4g128", 5),
    case("ministral3", "float", 5),
    case("ministral3", "q8g64", 3, zero_rank=2),
    case("llama4_text", "float", 3),
    case("llama4_text", "q8g64", 4, zero_rank=1),
    case("qwen3_vl", "float", 3),
    case("qwen3_vl", "q4g128", 6, zero_rank=2),
    case("qwen3_vl_moe", "float", 5),
    case("qwen3_vl_moe", "q8g32", 3, zero_rank=0),
    # DeepSeek V4.1: 6 heads in 2 output groups of 3 on 4 holding ranks (groups straddle ranks)
    case("deepseek_v41", "float", 5, zero_rank=3),
    case("deepseek_v41", "q4g64", 4),
    # Nemotron-H: 3 Mamba-2 groups on 5 uneven ranks (two hold none), quantized with a
    # zero-weight rank; the prompt carries conv and SSM state across the decode steps
    case("nemotron_h", "float", 5),
    case("nemotron_h", "q4g64", 3, zero_rank=1),
    # LFM2: 128 conv channels (two 64-channel units when quantized: a rank holds none)
    case("lfm2", "float", 3),
    case("lfm2", "q8g64", 5, zero_rank=3),
    # Gated DeltaNet hybrids: more ranks than linear key heads (ranks without any keep their
    # recurrent caches in step), uneven shares, then quantized with a zero-weight rank
    case("qwen3_5", "float", 5),
    case("qwen3_5", "q4g64", 3, zero_rank=1),
    case("qwen3_5_moe", "float", 3),
    case("qwen3_5_moe", "q4g128", 5, zero_rank=2),
    case("qwen3_next", "float", 5),
    case("qwen3_next", "q8g64", 3, zero_rank=0),
]


def full_matrix() -> list[Case]:
    return [
        case(arch, variant, n, zero_rank=(n - 2) if n >= 3 and n % 2 else None)
        for arch in ARCHS
        for variant in variants(arch)
        for n in range(1, 7)
    ]


def selected_cases(config: pytest.Config) -> list[Case]:
    return full_matrix() if config.getoption("--full-matrix") else SAMPLE


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "matrix_case" in metafunc.fixturenames:
        cases = selected_cases(metafunc.config)
        metafunc.parametrize("matrix_case", cases, ids=[c.id for c in cases])


class TinyModels:
    """Tiny checkpoints and their single-device references, built once per (arch, variant)."""

    def __init__(self, root: Path, tokenizer: Path):
        self.root = root
        self.tokenizer = tokenizer
        self.models: dict[tuple[str, str], Path] = {}
        self.references: dict[tuple[str, str], Reference] = {}

    def model(self, arch: str, variant: str) -> Path:
        key = (arch, variant)
        if key not in self.models:
            quant = variants(arch)[variant]
            dtype = mx.bfloat16 if arch in BF16_ARCHS and quant is None else mx.float32
            self.models[key] = write_tiny_model(
                self.root / f"{arch}-{variant}",
                tiny_config(arch, quantized=quant is not None),
                self.tokenizer,
                dtype,
                seed=SEEDS.get(arch, 0),
                quantize=quant,
            )
        return self.models[key]

    def reference(self, arch: str, variant: str) -> Reference:
        key = (arch, variant)
        if key not in self.references:
            self.references[key] = mlx_lm_reference(self.model(arch, variant), PROMPT, TOKENS)
        return self.references[key]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_models: dict[str, Path]) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("arch"), default_models["smollm2-135m"])


class RingJobs:
    """Each rank count's cases in one ring job, run when the first of them is asked for."""

    def __init__(self, root: Path, tiny: TinyModels, cases: list[Case]):
        self.root, self.tiny, self.cases = root, tiny, cases
        self.outcomes: dict[str, RingOutcome] = {}

    def outcome(self, case: Case) -> RingOutcome:
        if case.id not in self.outcomes:
            self._run([c for c in self.cases if len(c.weights) == len(case.weights)])
        return self.outcomes[case.id]

    def _run(self, cases: list[Case]) -> None:
        n = len(cases[0].weights)
        job = self.root / f"ranks-{n}"
        job.mkdir()
        ring_cases = RingCases(
            cases=tuple(
                RingCase(
                    id=c.id,
                    model=str(self.tiny.model(c.arch, c.variant)),
                    weights=c.weights,
                    prompt_ids=tuple(self.tiny.reference(c.arch, c.variant).prompt_ids),
                    tokens=TOKENS,
                    staged=table_for(ARCHS[c.arch]["model_type"]).stages,
                    stage_weights=c.weights[::-1],
                )
                for c in cases
            )
        )
        (job / "cases.json").write_text(ring_cases.model_dump_json())
        script = (
            f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
            "from matrix_ring import run_cases\n"
            f"run_cases(group, {str(job / 'cases.json')!r}, OUT)\n"
        )
        try:
            # a few seconds per case on 2 cores (loading included), 6 ranks sharing them
            result = run_on_ranks(n, script, job, timeout=60 + 20 * len(cases))
        except AssertionError as failed:  # a rank died or hung: every case of the job says so
            self.outcomes.update((c.id, RingOutcome(id=c.id, error=str(failed))) for c in cases)
            return
        self.outcomes.update((o.id, o) for o in RingOutcomes.model_validate(result).outcomes)


@pytest.fixture(scope="module")
def ring_jobs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny: TinyModels
) -> RingJobs:
    return RingJobs(tmp_path_factory.mktemp("rings"), tiny, selected_cases(request.config))


def checked_reference(tiny: TinyModels, arch: str, variant: str) -> Reference:
    reference = tiny.reference(arch, variant)
    assert min(reference.margins) >= MIN_MARGIN and len(reference.tokens) == TOKENS, (
        f"the reference stops early or its greedy choice is a near-tie "
        f"({min(reference.margins):.2g}): change the tiny model's seed"
    )
    return reference


def test_equals_single_device_mlx_lm(
    tiny: TinyModels, ring_jobs: RingJobs, matrix_case: Case
) -> None:
    c = matrix_case
    reference = checked_reference(tiny, c.arch, c.variant)
    outcome = ring_jobs.outcome(c)
    assert outcome.error is None and outcome.logits, outcome.error
    assert_logits_close(np.load(outcome.logits), reference.logits, atol=1e-4)
    assert list(outcome.tokens) == reference.tokens
    if table_for(ARCHS[c.arch]["model_type"]).stages:
        # the same shares for the first half of the layers, reversed for the second half
        staged = outcome.staged
        assert staged is not None and staged.error is None and staged.logits, staged
        assert_logits_close(np.load(staged.logits), reference.logits, atol=1e-4)
        assert list(staged.tokens) == reference.tokens


def test_launch_runs_a_family_end_to_end(tmp_path: Path, tiny: TinyModels) -> None:
    """One case through `exo-tp launch` (the launcher, the conductor, the chat template, the
    hops between pipeline stages): an MoE family as two uneven tensor-parallel stages, one
    rank holding nothing."""
    reference = checked_reference(tiny, "qwen3_moe", "q4g32")
    weights = [0.0, 0.7, 0.3, 0.5]
    model = tiny.model("qwen3_moe", "q4g32")
    ours = launch(tmp_path, model, weights, PROMPT, TOKENS, "--stages", "2,2")
    assert_logits_close(ours.logits, reference.logits, atol=1e-4)
    assert list(ours.report.tokens) == reference.tokens


def test_tied_gemma3_without_lm_head_on_uneven_ranks(tmp_path: Path, tiny: TinyModels) -> None:
    """Gemma 3 as Google ships it: tied embeddings, so the file has no lm_head.weight (mlx-lm's
    sanitize then removes the model's lm_head module); 3 uneven ranks equal single-device."""
    folder = tiny.model("gemma3_text", "float")
    stored = mx.load(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    reference = checked_reference(tiny, "gemma3_text", "float")
    ours = launch(tmp_path, folder, [0.5, 0.2, 0.3], PROMPT, TOKENS)
    assert_logits_close(ours.logits, reference.logits, atol=1e-4)
    assert list(ours.report.tokens) == reference.tokens


@pytest.mark.parametrize("arch", list(ARCHS))
def test_shipped_layout_is_what_mlx_lm_sanitizes(
    tmp_path: Path, default_models: dict[str, Path], arch: str
) -> None:
    """The matrix's checkpoints are in the family's shipped layout, not mlx-lm's: mlx-lm reads
    them (strictly) into exactly the parameters written in its own layout from the same seed."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    config = tiny_config(arch)
    tokenizer = default_models["smollm2-135m"]
    shipped = write_tiny_model(tmp_path / "shipped", config, tokenizer, seed=SEEDS.get(arch, 0))
    held = write_tiny_model(
        tmp_path / "mlx", config, tokenizer, seed=SEEDS.get(arch, 0), form="mlx"
    )
    model, _ = load_model(shipped, lazy=True)
    want = mx.load(str(held / "model.safetensors"))
    if arch == "gemma3_text":  # written in mlx-lm's layout before sanitize drops the tied head
        want = {k: v for k, v in want.items() if not k.startswith("lm_head.")}
    if config.get("norm_head"):  # bailing: sanitize divides the head by its column norms
        head = want["lm_head.weight"]
        norm = mx.linalg.norm(head.astype(mx.float32), axis=0, keepdims=True) + 1e-7
        want["lm_head.weight"] = (head / norm).astype(head.dtype)
    got = dict(tree_flatten(model.parameters()))
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert mx.array_equal(value, want[name]), name
