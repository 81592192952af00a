"""A checkpoint's MTP heads trained on the model's own continuations (for benchmarks and tests).

Random test checkpoints carry random MTP heads, and a random head predicts nothing: every
draft is rejected, which tests exactness but not acceptance, and benchmarks nothing. Here the
heads learn what the model itself writes: greedy continuations of a few prompts, the model's
last hidden state at every position (recorded by exo_tp.runtime.mtp.tap, as the runtime reads
it) and the tokens two and three ahead (the heads' first step, and their second, chained on
their own output as the drafter chains them). The target stays frozen: only the heads learn
(mlx's Adam), and they are written back in the checkpoint's own names, so the trained
checkpoint loads as a shipped one does.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from exo_tp.arch import table_for
from exo_tp.errors import ExoTpError
from exo_tp.plan.mtp import declared_mtp
from exo_tp.runtime.mtp.checkpoint import load_heads
from exo_tp.runtime.mtp.tap import HiddenTap
from exo_tp.shard.tree import get_path, has_path, set_path
from exo_tp.weights.build import read_header

# Qwen's zero-centred norms: shipped as weight - 1 (mlx-vlm's sanitize adds the 1 back).
_QWEN_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def shipped_heads(
    config: dict[str, Any], params: dict[str, mx.array], mlx_layout: bool = False
) -> dict[str, mx.array]:
    """mlx-vlm drafter parameters (its own names) in the checkpoint's: Qwen's top-level
    ``mtp.*`` block, or DeepSeek's and GLM's layer after the last."""
    if declared_mtp(config) and (config.get("text_config") or config).get("mtp_num_hidden_layers"):
        shift = 0 if mlx_layout else 1
        return {
            f"mtp.{name}": value - shift if name.endswith(_QWEN_NORMS) else value
            for name, value in params.items()
        }
    return _nextn_layer(config, {k.removeprefix("mtp."): v for k, v in params.items()})


def _nextn_layer(config: dict[str, Any], params: dict[str, mx.array]) -> dict[str, mx.array]:
    """The layer ``model.layers.<N>``: MLA's ``kv_b_proj`` fused again from the drafter's
    absorbed halves, the MoE's experts one tensor each, ``shared_head.norm``."""
    prefix = f"model.layers.{config['num_hidden_layers']}."
    params = dict(params)
    out: dict[str, mx.array] = {}
    embed_q = params.pop("self_attn.embed_q.weight", None)  # (heads, nope, kv_lora)
    unembed = params.pop("self_attn.unembed_out.weight", None)  # (heads, v, kv_lora)
    if embed_q is not None and unembed is not None:
        fused = mx.concatenate([embed_q.swapaxes(-1, -2), unembed], axis=1)
        out[f"{prefix}self_attn.kv_b_proj.weight"] = fused.reshape(-1, fused.shape[-1])
    for name, value in params.items():
        stacked = re.fullmatch(r"(.*)\.switch_mlp\.(\w+)\.weight", name)
        if stacked:
            for expert in range(value.shape[0]):
                out[f"{prefix}{stacked[1]}.experts.{expert}.{stacked[2]}.weight"] = value[expert]
            continue
        out[prefix + name.replace("shared_head_norm.", "shared_head.norm.")] = value
    return out


def write_heads(model_dir: Path, config: dict[str, Any], params: dict[str, mx.array]) -> None:
    """Drafter-layout ``params`` into the checkpoint's one safetensors file, in its names (an
    MLX-layout file keeps Qwen's norms as they are: mlx-vlm reads those unshifted)."""
    file = Path(model_dir) / "model.safetensors"
    _, header = read_header(file)
    layout = (header.get("__metadata__") or {}).get("format", "pt")
    weights = cast(dict[str, mx.array], mx.load(str(file)))
    weights.update(shipped_heads(config, params, mlx_layout=layout == "mlx"))
    mx.save_safetensors(str(file), weights, metadata={"format": layout})


def untrained_heads(config: dict[str, Any]) -> nn.Module:
    """The family's mlx-vlm drafter for ``config`` (its MTP layers), freshly initialised."""
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter
    from mlx_vlm.utils import get_model_and_args

    splitter = get_mtp_splitter(source_config=config)
    if splitter is None:
        raise ExoTpError(f"mlx-vlm has no MTP drafter for {config.get('model_type')}")
    arch, _ = get_model_and_args({"model_type": splitter.output_model_type})
    text = splitter.read_text_config(config)
    return cast(nn.Module, arch.Model(arch.ModelConfig.from_dict({"text_config": text})))


def add_random_heads(model_dir: Path, seed: int = 0) -> None:
    """Random MTP heads (norms near one, other weights small, as the test checkpoints draw
    theirs) written into a checkpoint whose config declares them."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    mx.random.seed(seed)
    params = {}
    fresh = cast(dict[str, mx.array], dict(tree_flatten(untrained_heads(config).parameters())))
    for name, value in fresh.items():
        if name.endswith("norm.weight") or ("norm_" in name and name.endswith(".weight")):
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
        else:
            params[name] = 0.08 * mx.random.normal(value.shape)
    write_heads(model_dir, config, params)


@dataclass(frozen=True)
class Trained:
    loss_before: float
    loss_after: float
    sequences: int
    positions: int
    seconds: float


def _continuations(model: nn.Module, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from mlx_lm.generate import generate_step

    out = []
    for prompt in prompts:
        steps = generate_step(
            mx.array(prompt), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)
        )
        out.append([*prompt, *(int(token) for token, _ in steps)])
    return out


def train_heads(
    model_dir: Path,
    config: dict[str, Any],
    prompts: list[list[int]],
    tokens: int = 64,
    steps: int = 150,
    learning_rate: float = 3e-3,
) -> Trained:
    """Train ``model_dir``'s MTP heads on the model's greedy continuations of ``prompts`` and
    write them back (float32; a single-file checkpoint)."""
    from mlx_lm import load

    started = time.perf_counter()
    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    model.freeze()
    table = table_for(config.get("model_type", ""))
    tap = HiddenTap(get_path(model, table.norm))
    set_path(model, table.norm, tap)
    data = []
    for sequence in _continuations(model, prompts, tokens):
        tap.clear()
        model(mx.array(sequence)[None])
        states = tap.take()
        assert states is not None
        data.append((mx.array(sequence, dtype=mx.int32), states))
    heads = load_heads(model_dir, mx.float32)
    embed = get_path(model, table.embedding)
    head = get_path(model, table.lm_head) if has_path(model, table.lm_head) else embed.as_linear
    target = SimpleNamespace(embed_tokens=embed, lm_head=head)
    target.model = target
    heads.bind(target)

    def loss(ids: mx.array, states: mx.array) -> mx.array:
        first = _chained(heads, ids[1:], states[:-1], 0)  # position p: ids[p + 2]
        second = _chained(heads, ids[2:-1], first[:-2], 1)  # on its own output: ids[p + 3]
        return (
            _cross_entropy(head(first[:-1]), ids[2:]) + _cross_entropy(head(second), ids[3:])
        ) / 2

    def total() -> float:
        return sum(cast(float, loss(ids, states).item()) for ids, states in data) / len(data)

    before = total()
    optimizer = optim.Adam(learning_rate=learning_rate)
    step = nn.value_and_grad(heads, loss)
    indexers = _hold_indexers(heads)
    for i in range(steps):
        ids, states = data[i % len(data)]
        _, grads = step(ids, states)
        optimizer.update(heads, grads)
        mx.eval(heads.parameters(), optimizer.state)
    for owner, indexer in indexers:
        owner.indexer = indexer
    after = total()
    flat = cast(dict[str, mx.array], dict(tree_flatten(heads.parameters())))
    write_heads(model_dir, config, {k: v for k, v in flat.items() if not k.startswith("_")})
    positions = sum(len(ids) for ids, _ in data)
    return Trained(before, after, len(data), positions, time.perf_counter() - started)


class _Held(nn.Module):
    """A sparse attention's indexer whose choice of keys passes no gradient (a top-k's
    indices have none; the keys it picks still learn through the attention)."""

    def __init__(self, indexer: nn.Module):
        super().__init__()
        self.indexer = indexer

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return mx.stop_gradient(self.indexer(*args, **kwargs))


def _hold_indexers(heads: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """DeepSeek's sparse attention (GLM-5's heads) in training: see _Held; the indexers are
    put back before the heads are written."""
    held = []
    for _, module in heads.named_modules():
        indexer = getattr(module, "indexer", None)
        if isinstance(indexer, nn.Module) and not isinstance(module, _Held):
            held.append((module, indexer))
    for owner, indexer in held:
        owner.indexer = _Held(indexer)
    return held


def _chained(heads: Any, ids: mx.array, hidden: mx.array, start: int) -> mx.array:
    """The heads over (ids[i], hidden[i]) pairs from position ``start``, a fresh cache."""
    heads._cache = heads.make_cache()
    if hasattr(heads, "_next_position"):
        heads._next_position = start
    return heads._forward_tokens(ids[None], hidden[None], mx.int32)[0]


def _cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    return nn.losses.cross_entropy(logits, targets, reduction="mean")
