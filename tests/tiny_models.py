"""Tiny random checkpoints with awkward shapes, laid out the way real ones are shipped.

The random weights come from mlx-lm's own classes; the file is then what a user downloads:

- float checkpoints in the family's Hugging Face layout: a tied LM head is omitted, MoE experts
  are stored one by one (Mistral 4's fused per layer), MLA families (DeepSeek V3 and kin) store
  kv_b_proj (mlx-lm splits it into embed_q and unembed_out), Step 3.5 stores zero-centred norms
  under StepFun's names, and Llama/Qwen2 keep the rotary ``inv_freq`` buffers old exports carry;
  mlx-lm's ``sanitize`` turns each of these into the model's parameters at load time;
- quantized checkpoints made from that float checkpoint by mlx-lm's own converter
  (``mlx_lm.convert -q``), so the layout and the per-layer ``quantization`` config are what
  mlx-lm writes;
- gpt-oss as OpenAI ships it (``openai_mxfp4``): MX-FP4 experts as ``*_blocks``/``*_scales``
  with gate and up interleaved, everything else float, and a ``quantization_config``;
- Kimi K2.5 as Moonshot ships it (``compressed_tensors``): routed experts in compressed-tensors
  int4 (``weight_packed``/``weight_scale``/``weight_shape``, symmetric, groups of 32), everything
  else float, and a ``quantization_config`` under ``text_config``.

``form="mlx"`` writes the parameters as mlx-lm holds them instead (an already converted model).
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.convert import convert
from mlx_lm.utils import _get_classes, quantize_model

Form = Literal["shipped", "mlx"]
# Multiplicative parameters, drawn near 1 (norms; Gemma 4's layer scalars and router scales,
# which near 0 would shrink every layer or flatten the routing into near-ties).
_NEAR_ONE = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")


def write_tiny_model(
    folder: Path,
    config: dict[str, Any],
    tokenizer_from: Path,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    quantize: dict[str, Any] | None = None,
    form: Form = "shipped",
) -> Path:
    """Random weights for ``config`` (scaled so activations stay O(1)), plus a real tokenizer.

    ``quantize`` ({"group_size": g, "bits": b, optional "mode"}) quantizes with mlx-lm's
    converter (modules whose input width is not a multiple of g stay float);
    ``{"openai_mxfp4": True}`` writes gpt-oss's own MX-FP4 layout instead,
    ``{"compressed_tensors": True}`` Kimi K2.5's int4 experts (both in the shipped layout,
    whatever ``form``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    model = model_class(args)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(_NEAR_ONE):
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
        else:
            params[name] = 0.08 * mx.random.normal(value.shape)
    if quantize and quantize.get("openai_mxfp4"):
        weights, config = _openai_mxfp4(params, config, dtype)
        _write(folder, weights, config, tokenizer_from)
        return folder
    if quantize and quantize.get("compressed_tensors"):
        weights, config = _compressed_tensors(_shipped(params, config, args), config)
        _write(folder, weights, config, tokenizer_from, dtype)
        return folder
    if form == "mlx":
        model.load_weights(list(params.items()))
        if quantize:
            model, config = quantize_model(
                model,
                config,
                quantize["group_size"],
                quantize["bits"],
                mode=quantize.get("mode", "affine"),
            )
        weights = dict(tree_flatten(model.parameters()))
        _write(folder, weights, config, tokenizer_from, dtype, layout="mlx")
        return folder
    if not quantize:
        _write(folder, _shipped(params, config, args), config, tokenizer_from, dtype)
        return folder
    # Quantized: the float checkpoint as shipped, through mlx-lm's converter (into a fresh
    # folder: convert refuses an existing one).
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        source = Path(tmp) / "hf"
        _write(source, _shipped(params, config, args), config, tokenizer_from, dtype)
        shutil.rmtree(folder)
        with redirect_stdout(StringIO()):
            convert(
                str(source),
                str(folder),
                quantize=True,
                q_group_size=quantize["group_size"],
                q_bits=quantize["bits"],
                q_mode=quantize.get("mode", "affine"),
            )
    return folder


def _write(
    folder: Path,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    tokenizer_from: Path,
    dtype: mx.Dtype | None = None,
    layout: str = "pt",
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": layout})
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_from / "tokenizer_config.json", folder / "tokenizer_config.json")
    write_tokenizer(
        folder / "tokenizer.json",
        tokenizer_from / "tokenizer.json",
        config.get("vocab_size") or config["text_config"]["vocab_size"],
    )


def tied(config: dict[str, Any], args: Any) -> bool:
    """Whether the checkpoint ties its LM head: config.json says so, or else mlx-lm's default
    for the family (families without the setting keep their head)."""
    return bool(config.get("tie_word_embeddings", getattr(args, "tie_word_embeddings", False)))


# Per-expert names in the Hugging Face checkpoints: (stacked module, per-expert module format,
# {stacked projection: per-expert projection}).
_GLU = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
# Most families: experts under mlp.experts.<e> with the usual projection names; Mixtral and
# MiniMax: under block_sparse_moe with w1/w2/w3.
_MLP_EXPERTS = ("mlp.switch_mlp", "mlp.experts.{e}", _GLU)
_BLOCK_SPARSE_EXPERTS = (
    "block_sparse_moe.switch_mlp",
    "block_sparse_moe.experts.{e}",
    {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
)
_EXPERTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "mixtral": _BLOCK_SPARSE_EXPERTS,
    "minimax": _BLOCK_SPARSE_EXPERTS,
    "qwen3_moe": _MLP_EXPERTS,
    "qwen2_moe": _MLP_EXPERTS,
    "deepseek_v2": _MLP_EXPERTS,
    "deepseek_v3": _MLP_EXPERTS,
    "ernie4_5_moe": _MLP_EXPERTS,
    "bailing_moe": _MLP_EXPERTS,
    "exaone_moe": _MLP_EXPERTS,
    "glm4_moe": _MLP_EXPERTS,
    "glm4_moe_lite": _MLP_EXPERTS,
    "kimi_k2": _MLP_EXPERTS,
    "kimi_k25": _MLP_EXPERTS,
    "deepseek_v32": _MLP_EXPERTS,
    "glm_moe_dsa": _MLP_EXPERTS,
    "qwen3_next": _MLP_EXPERTS,
    # Kimi K3 stores its MoE blocks under block_sparse_moe with w1/w2/w3 (its dense MLP stays mlp)
    # Nemotron-H: non-gated experts (fc1 up, fc2 down) under the layer's mixer
    "nemotron_h": ("mixer.switch_mlp", "mixer.experts.{e}", {"fc1": "up_proj", "fc2": "down_proj"}),
    "kimi_k3": (
        "mlp.switch_mlp",
        "block_sparse_moe.experts.{e}",
        {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    ),
}
# Families storing each MLA layer's kv_b_proj, which mlx-lm splits into embed_q and unembed_out.
_KV_B = {
    "deepseek_v3",
    "glm4_moe_lite",
    "mistral4",
    "kimi_k2",
    "kimi_k25",
    "deepseek_v32",
    "glm_moe_dsa",
    "kimi_k3",
}
# Families whose Hugging Face exports may carry rotary inv_freq buffers (mlx-lm drops them).
_INV_FREQ = {"llama", "mistral", "qwen2"}


def _shipped(params: dict[str, mx.array], config: dict[str, Any], args: Any) -> dict[str, mx.array]:
    """mlx-lm's parameters in the family's Hugging Face checkpoint layout (what mlx-lm's
    ``sanitize`` undoes)."""
    arch = config["model_type"]
    out: dict[str, mx.array] = {}
    for name, value in params.items():
        if name.startswith("lm_head.") and tied(config, args):
            continue  # a tied head is not stored
        out[name] = value
    if arch in _EXPERTS:
        stacked, single, names = _EXPERTS[arch]
        for name in [n for n in out if f".{stacked}." in n]:
            layer, _, rest = name.partition(f".{stacked}.")
            proj, _, part = rest.partition(".")
            value = out.pop(name)
            for e in range(value.shape[0]):
                out[f"{layer}.{single.format(e=e)}.{names[proj]}.{part}"] = value[e]
    if arch in ("nemotron_h", "lfm2"):  # depthwise convs as Hugging Face ships them: (C, 1, K)
        for name in [n for n in out if n.endswith(("conv1d.weight", "conv.conv.weight"))]:
            out[name] = out[name].moveaxis(2, 1)
    if arch == "mistral4":
        # Mistral 4 stores each MoE layer's experts fused (transformers' Mistral4NaiveMoe):
        # experts.gate_up_proj (E, 2 * ffn, hidden), gate rows first, and experts.down_proj.
        for name in [n for n in out if n.endswith(".mlp.switch_mlp.gate_proj.weight")]:
            prefix = name.removesuffix(".switch_mlp.gate_proj.weight")
            gate = out.pop(name)
            up = out.pop(f"{prefix}.switch_mlp.up_proj.weight")
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
            out[f"{prefix}.experts.down_proj"] = out.pop(f"{prefix}.switch_mlp.down_proj.weight")
    if arch in _KV_B:
        # kv_b_proj: per head, nope rows of keys then v_head_dim rows of values, over the latent.
        for name in [n for n in out if n.endswith(".self_attn.embed_q.weight")]:
            prefix = name.removesuffix(".embed_q.weight")
            wk = out.pop(name).swapaxes(-1, -2)  # (heads, nope, latent)
            wv = out.pop(f"{prefix}.unembed_out.weight")  # (heads, v, latent)
            kv_b = mx.concatenate([wk, wv], axis=1)
            out[f"{prefix}.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    if arch == "exaone_moe":  # the router's score correction is stored beside the gate
        for name in [n for n in out if n.endswith(".mlp.gate.e_score_correction_bias")]:
            out[name.replace(".gate.", ".")] = out.pop(name)
    if arch == "bailing_moe":  # the router's linear is stored as the gate itself
        for name in [n for n in out if ".mlp.gate.gate_proj." in n]:
            out[name.replace(".mlp.gate.gate_proj.", ".mlp.gate.")] = out.pop(name)
    if arch == "step3p5":
        # StepFun's names (experts stacked under moe, the router and its bias beside them, the
        # shared expert outside mlp) and zero-centred norms (stored as weight - 1).
        renames = (
            (".mlp.switch_mlp.", ".moe."),
            (".mlp.gate.gate.", ".moe.gate."),
            (".mlp.gate.router_bias", ".moe.router_bias"),
            (".mlp.share_expert.", ".share_expert."),
        )
        for name in list(out):
            value = out.pop(name)
            if name.endswith(".weight") and "norm" in name:
                value = value - 1
            for src, dst in renames:
                if src in name:
                    name = name.replace(src, dst)
                    break
            out[name] = value
    if arch == "kimi_k3":
        out = _kimi_k3_shipped(out)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        out = _qwen3_vl_shipped(out)
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        out = _qwen_gated_deltanet_shipped(out)
    if arch in ("gemma4", "gemma4_text"):
        out = _gemma4_shipped(out, config)
    if arch == "deepseek_v41":
        out = _deepseek_v41_shipped(out)
    if arch in _INV_FREQ:
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        theta = config.get("rope_theta", 10000.0)
        inv_freq = 1.0 / (theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
        for i in range(config["num_hidden_layers"]):
            out[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq
    return out


# DeepSeek's own names for mlx-lm's DeepSeek V4.1 parameters (mlx-lm's _rename undone), most
# specific first: a shared expert's gate_proj is w1, the compressor's is wgate.
_V41_NAMES = (
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".indexer.k_proj.", ".indexer.wk."),
    (".gate.e_score_correction_bias", ".gate.bias"),
)


def _deepseek_v41_shipped(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """DeepSeek V4.1 as DeepSeek names it (no ``model.`` prefix, ``attn``/``ffn``, ``wq_a``...,
    experts one by one as w1/w2/w3, the block-diagonal wo_a as one (groups x rank, in) matrix);
    float, so mlx-lm's sanitize only renames and restacks."""
    out: dict[str, mx.array] = {}
    experts = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for name, value in params.items():
        if name == "model.embed_tokens.weight":
            out["embed.weight"] = value
            continue
        if name == "lm_head.weight":
            out["head.weight"] = value
            continue
        name = name.removeprefix("model.")
        if ".mlp.experts.switch_mlp." in name:
            layer, _, rest = name.partition(".mlp.experts.switch_mlp.")
            proj, _, part = rest.partition(".")
            for e in range(value.shape[0]):
                out[f"{layer}.ffn.experts.{e}.{experts[proj]}.{part}"] = value[e]
            continue
        if ".o_a_proj." in name:
            value = value.reshape(-1, value.shape[-1])
        for src, dst in _V41_NAMES:
            name = name.replace(src, dst)
        out[name] = value
    return out


def _qwen3_vl_shipped(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """Qwen3-VL as Qwen ships it (newer checkpoints): the text model under
    ``model.language_model``, ``lm_head`` at the top, MoE experts fused and transposed
    (``experts.gate_up_proj`` (E, hidden, 2 x ffn), ``experts.down_proj`` (E, ffn, hidden))."""
    out: dict[str, mx.array] = {}
    for name, value in params.items():
        if name.endswith(".switch_mlp.gate_proj.weight"):
            base = name.removesuffix(".switch_mlp.gate_proj.weight")
            up = params[f"{base}.switch_mlp.up_proj.weight"]
            down = params[f"{base}.switch_mlp.down_proj.weight"]
            value = mx.concatenate([value.swapaxes(1, 2), up.swapaxes(1, 2)], axis=-1)
            out[f"{base}.experts.gate_up_proj"] = value
            out[f"{base}.experts.down_proj"] = down.swapaxes(1, 2)
        elif ".switch_mlp." not in name:
            out[name] = value
    return _language_model_at_top(out)


# Qwen's zero-centred norms (stored as weight - 1, mlx-lm's sanitize adds 1); the gated norm
# of the linear-attention layers is stored as it is used.
_QWEN_SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _qwen_gated_deltanet_shipped(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """Qwen 3.5 and Qwen3-Next as Qwen ships them: convs as (channels, 1, kernel), norms
    zero-centred; Qwen 3.5's text model under ``model.language_model`` with ``lm_head`` at the
    top and its MoE experts fused (``experts.gate_up_proj`` (E, 2 x ffn, hidden), gate rows
    first, and ``experts.down_proj``, no ``.weight``)."""
    out: dict[str, mx.array] = {}
    for name, value in params.items():
        if name.endswith(".conv1d.weight"):
            value = value.swapaxes(1, 2)
        if name.endswith(_QWEN_SHIFTED_NORMS):
            value = value - 1
        if name.endswith(".switch_mlp.gate_proj.weight"):
            base = name.removesuffix(".switch_mlp.gate_proj.weight")
            up = params[f"{base}.switch_mlp.up_proj.weight"]
            out[f"{base}.experts.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
            out[f"{base}.experts.down_proj"] = params[f"{base}.switch_mlp.down_proj.weight"]
            continue
        if ".switch_mlp." in name:
            continue
        out[name] = value
    return _language_model_at_top(out)


def _kimi_k3_shipped(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """Kimi K3 as Moonshot ships it: the linear-attention layers' q/k/v projections and their
    short convs apart (convs as (channels, 1, kernel)), the MoE blocks' router, score correction,
    shared experts and latent projections under block_sparse_moe, attention residuals'
    projections and norms as ``*_res.proj_weight`` / ``*_res.norm_weight``."""
    out: dict[str, mx.array] = {}
    for name, value in params.items():
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name.removesuffix(".qkv_proj.weight")
            for part, w in zip("qkv", mx.split(value, 3, axis=0), strict=True):
                out[f"{prefix}.{part}_proj.weight"] = w
            continue
        if name.endswith(".self_attn.qkv_conv.conv.weight"):
            prefix = name.removesuffix(".qkv_conv.conv.weight")
            for part, w in zip("qkv", mx.split(value, 3, axis=0), strict=True):
                out[f"{prefix}.{part}_conv1d.weight"] = w.moveaxis(1, 2)
            continue
        for src, dst in (
            (".mlp.gate.", ".block_sparse_moe.gate."),
            (".mlp.e_score_correction_bias", ".block_sparse_moe.gate.e_score_correction_bias"),
            (".mlp.shared_experts.", ".block_sparse_moe.shared_experts."),
            (".mlp.routed_expert_", ".block_sparse_moe.routed_expert_"),
        ):
            name = name.replace(src, dst)
        for res in ("self_attention_res", "mlp_res", "output_attn_res"):
            for part in ("proj", "norm"):
                name = name.replace(f"{res}_{part}.weight", f"{res}.{part}_weight")
        out[name] = value
    return out


def _gemma4_shipped(params: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """Gemma 4 as Google ships it: experts fused (gate|up in one ``experts.gate_up_proj``, no
    ``.weight``), KV-shared layers still carrying k/v projections and k norm (mlx-lm drops
    them), and in the multimodal checkpoint the text model under ``model.language_model``."""
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    first_shared = layers - text.get("num_kv_shared_layers", 0)
    types = text["layer_types"]
    out: dict[str, mx.array] = {}
    for name, value in params.items():
        if name.endswith(".experts.switch_glu.gate_proj.weight"):
            base = name.removesuffix(".switch_glu.gate_proj.weight")
            up = params[f"{base}.switch_glu.up_proj.weight"]
            out[f"{base}.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
        elif name.endswith(".experts.switch_glu.down_proj.weight"):
            out[name.removesuffix(".switch_glu.down_proj.weight") + ".down_proj"] = value
        elif not name.endswith(".experts.switch_glu.up_proj.weight"):
            out[name] = value
    prefix = "language_model.model.layers" if "text_config" in config else "model.layers"
    for j in range(max(first_shared, 0), layers):
        source = max(i for i in range(first_shared) if types[i] == types[j])
        for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            stored = out.get(f"{prefix}.{source}.self_attn.{part}")
            if stored is not None:
                out[f"{prefix}.{j}.self_attn.{part}"] = mx.random.normal(stored.shape)
    if "text_config" in config:
        out = {
            f"model.{k.replace('language_model.model.', 'language_model.', 1)}": v
            for k, v in out.items()
        }
    return out


def _openai_mxfp4(
    params: dict[str, mx.array], config: dict[str, Any], dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """gpt-oss as OpenAI ships it: experts in MX-FP4 (uint8 blocks of 16 bytes and uint8
    scales per 32 inputs), gate and up interleaved row by row in one gate_up_proj."""
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[str, mx.array]] = {}
    for name, value in params.items():
        if ".mlp.experts." in name:
            prefix, _, rest = name.partition(".mlp.experts.")
            experts.setdefault(f"{prefix}.mlp.experts", {})[rest] = value
        else:
            out[name] = value.astype(dtype)

    def blocks(w: mx.array, key: str) -> None:
        q, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
        out[f"{key}_blocks"] = q.view(mx.uint8).reshape(*w.shape[:-1], w.shape[-1] // 32, 16)
        out[f"{key}_scales"] = scales

    for prefix, p in experts.items():
        gate, up = p["gate_proj.weight"], p["up_proj.weight"]
        gate_up = mx.stack([gate, up], axis=-2).reshape(gate.shape[0], -1, gate.shape[-1])
        blocks(gate_up, f"{prefix}.gate_up_proj")
        bias = mx.stack([p["gate_proj.bias"], p["up_proj.bias"]], axis=-1)
        out[f"{prefix}.gate_up_proj_bias"] = bias.reshape(bias.shape[0], -1).astype(dtype)
        blocks(p["down_proj.weight"], f"{prefix}.down_proj")
        out[f"{prefix}.down_proj_bias"] = p["down_proj.bias"].astype(dtype)
    config = {
        **config,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
        },
    }
    return out, config


def _compressed_tensors(
    weights: dict[str, mx.array], config: dict[str, Any]
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Routed experts in compressed-tensors int4 "pack-quantized": per group of 32 inputs a
    scale s = max|w| / 7, q = round(w / s) in [-8, 7] stored as q + 8, eight 4-bit values per
    int32 (lowest bits first); mlx-lm reads them as affine 4-bit with biases -8 s."""
    group = 32
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if ".mlp.experts." not in name or not name.endswith(".weight"):
            out[name] = w
            continue
        base = name.removesuffix("weight")
        rows, cols = w.shape
        grouped = w.astype(mx.float32).reshape(rows, cols // group, group)
        scale = mx.maximum(mx.abs(grouped).max(axis=-1, keepdims=True) / 7, 1e-8)
        q = (mx.clip(mx.round(grouped / scale), -8, 7) + 8).astype(mx.uint32)
        nibbles = q.reshape(rows, cols // 8, 8) << (4 * mx.arange(8, dtype=mx.uint32))
        packed = mx.sum(nibbles, axis=-1).astype(mx.uint32)
        out[f"{base}weight_packed"] = packed.view(mx.int32)
        out[f"{base}weight_scale"] = scale.squeeze(-1)
        out[f"{base}weight_shape"] = mx.array([rows, cols], dtype=mx.int32)
    quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": group},
            }
        },
    }
    text = {**config["text_config"], "quantization_config": quantization_config}
    return out, {**config, "text_config": text}


# SmolLM2-135M's shape where the tests lean on it (9 query heads in 3 KV groups, tied head, its
# whole 49,152-token vocabulary, template and end tokens), ~1/15 of its compute: a float32 decode
# step of SmolLM2 took 110 ms alone and 270 ms for 32 rows on this 2-core VM, this one 10 and 13.
TINY_SMOLLM2 = {
    "hidden_size": 144,
    "head_dim": 16,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
}


def write_tiny_smollm2(folder: Path, smollm2: Path) -> Path:
    """Random weights in SmolLM2's family and head groups, with its tokenizer files: for cluster
    and API tests that compare with single-device mlx-lm on the same folder (exact for any
    weights) and do not need the model to answer sensibly."""
    config = {**json.loads((smollm2 / "config.json").read_text()), **TINY_SMOLLM2}
    return write_tiny_model(folder, config, smollm2)  # its tokenizer files, template included


def write_tokenizer(path: Path, source: Path, vocab_size: int) -> None:
    """The source BPE tokenizer, cut to its first ``vocab_size`` ids if it has more.

    Keeping the merges whose parts and result all survive is still a valid BPE over every byte
    (byte-level tokens come first), so any text encodes to ids below ``vocab_size``: tiny
    models get a tiny embedding.
    """
    stat = source.stat()
    path.write_text(_cut_tokenizer(source, stat.st_mtime_ns, stat.st_size, vocab_size))


@functools.lru_cache(maxsize=8)
def _cut_tokenizer(source: Path, mtime_ns: int, size: int, vocab_size: int) -> str:
    """`write_tokenizer`'s text, cut once per source file and size: parsing and cutting
    SmolLM2's 49k-token tokenizer took ~0.55 s, paid by every tiny model a test writes (the
    architecture matrix writes ~90). ``mtime_ns`` and ``size`` key the cache to the file's
    contents."""
    tokenizer = json.loads(source.read_text())
    bpe = tokenizer["model"]
    if len(bpe["vocab"]) > vocab_size:
        vocab = {token: i for token, i in bpe["vocab"].items() if i < vocab_size}
        bpe["vocab"] = vocab
        bpe["merges"] = [m for m in bpe["merges"] if all(t in vocab for t in (*m, "".join(m)))]
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < vocab_size]
    return json.dumps(tokenizer)


def _language_model_at_top(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """A multimodal checkpoint's text model as shipped: under ``model.language_model``, with
    ``lm_head`` at the top."""
    return {
        k.replace("language_model.model.", "model.language_model.", 1).replace(
            "language_model.lm_head", "lm_head", 1
        ): v
        for k, v in params.items()
    }
