"""Every supported architecture, float and quantized, on 1 to 6 ranks equals single-device mlx-lm.

Each case writes a tiny random checkpoint of the architecture (tests/arch_configs.py: awkward
head, KV-head and FFN counts) laid out the way real checkpoints are shipped (tests/tiny_models.py:
Hugging Face names, tied heads omitted, quantized variants through mlx-lm's converter), starts
real ranks on the MLX ring through `exo-tp launch` with random shares, and compares with mlx-lm
run whole in this process on the same folder: prompt logits in fp32 within 1e-4 (absolute; the
tiny models' |logits| stay below ~18) and greedy tokens identical, for float and quantized
variants alike (quantized slices are bit-exact, so both checks hold).

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
import pytest
from arch_configs import ARCHS, tiny_config
from helpers import Reference, assert_logits_close, launch, mlx_lm_reference
from tiny_models import write_tiny_model

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
    }
}


def variants(arch: str) -> dict[str, dict[str, Any] | None]:
    return {**VARIANTS, **ARCH_VARIANTS.get(arch, {})}


# Weight seeds (default 0), picked so that every variant's reference generates TOKENS tokens
# (no early end of sequence) and decides each greedy step by at least MIN_MARGIN (random tiny
# models have no reason to be peaked).
SEEDS = {"gemma3_text": 1, "phi3": 1, "qwen2_moe": 1, "deepseek_v2": 1}
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
]


def full_matrix() -> list[Case]:
    return [
        case(arch, variant, n, zero_rank=(n - 2) if n >= 3 and n % 2 else None)
        for arch in ARCHS
        for variant in variants(arch)
        for n in range(1, 7)
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "matrix_case" in metafunc.fixturenames:
        cases = full_matrix() if metafunc.config.getoption("--full-matrix") else SAMPLE
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


def test_equals_single_device_mlx_lm(tmp_path: Path, tiny: TinyModels, matrix_case: Case) -> None:
    c = matrix_case
    reference = tiny.reference(c.arch, c.variant)
    assert min(reference.margins) >= MIN_MARGIN and len(reference.tokens) == TOKENS, (
        f"the reference stops early or its greedy choice is a near-tie "
        f"({min(reference.margins):.2g}): change the tiny model's seed"
    )
    ours = launch(tmp_path, tiny.model(c.arch, c.variant), list(c.weights), PROMPT, TOKENS)
    assert_logits_close(ours.logits, reference.logits, atol=1e-4)
    assert list(ours.report.tokens) == reference.tokens


def test_tied_gemma3_without_lm_head_on_uneven_ranks(tmp_path: Path, tiny: TinyModels) -> None:
    """Gemma 3 as Google ships it: tied embeddings, so the file has no lm_head.weight (mlx-lm's
    sanitize then removes the model's lm_head module); 3 uneven ranks equal single-device."""
    folder = tiny.model("gemma3_text", "float")
    stored = mx.load(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    reference = tiny.reference("gemma3_text", "float")
    assert min(reference.margins) >= MIN_MARGIN and len(reference.tokens) == TOKENS
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
    got = dict(tree_flatten(model.parameters()))
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert mx.array_equal(value, want[name]), name
