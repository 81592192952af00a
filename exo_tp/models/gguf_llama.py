"""Turn a llama-architecture GGUF file into mlx-lm model folders, offline.

Two outputs from one GGUF:
- float: every tensor dequantized to float32 (exact: Q4_1/Q8_0 values are fp16 scale x small int
  + fp16 bias, which float32 holds exactly);
- quantized: the GGUF's own quantization kept as MLX affine arrays (``mx.load`` reads Q4_1 as
  4-bit group-32 and Q8_0 as 8-bit group-32), so nothing is requantized.

llama.cpp permutes the rows of Q and K when it writes a GGUF (rope layout); both outputs undo it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from exo_tp.errors import ExoTpError
from exo_tp.models.gguf_tokenizer import write_tokenizer

# GGUF tensor name (after "blk.N.") -> mlx-lm llama parameter name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def mlx_name(gguf_base: str) -> str:
    """mlx-lm module path for a GGUF tensor base name such as ``blk.3.attn_q``."""
    if gguf_base.startswith("blk."):
        _, layer, rest = gguf_base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return _GLOBAL_NAMES[gguf_base]


def unpermute_rows(rows: np.ndarray | mx.array, n_head: int) -> Any:
    """Invert llama.cpp's Q/K row permutation (any array whose axis 0 is the output row)."""
    out = rows.shape[0]
    rest = tuple(rows.shape[1:])
    x = rows.reshape(n_head, out // n_head // 2, 2, *rest)
    return x.swapaxes(1, 2).reshape(out, *rest)


def _field(metadata: dict[str, Any], key: str) -> Any:
    value = metadata[key]
    if isinstance(value, mx.array):
        return value.item()
    return value


def _f32(value: float) -> float:
    """The shortest decimal that names this float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def llama_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """An HF-style config.json for mlx-lm's llama model from GGUF metadata."""
    if _field(metadata, "general.architecture") != "llama":
        raise ExoTpError("only llama-architecture GGUF files can be prepared")
    heads = int(_field(metadata, "llama.attention.head_count"))
    hidden = int(_field(metadata, "llama.embedding_length"))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_field(metadata, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(metadata, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(metadata, "llama.attention.head_count_kv")),
        "head_dim": int(_field(metadata, "llama.rope.dimension_count")),
        "rms_norm_eps": _f32(_field(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(metadata, "llama.rope.freq_base")),
        "max_position_embeddings": int(_field(metadata, "llama.context_length")),
        "vocab_size": int(_field(metadata, "llama.vocab_size")),
        "tie_word_embeddings": True,
        "bos_token_id": int(_field(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(metadata, "tokenizer.ggml.eos_token_id")),
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def _bits_of(packed_cols: int, in_features: int) -> int:
    return packed_cols * 32 // in_features


def convert(gguf_path: Path, out_float: Path, out_quantized: Path) -> None:
    """Write both model folders (config, safetensors, tokenizer) from ``gguf_path``."""
    loaded = mx.load(str(gguf_path), return_metadata=True)
    # (mlx's load returns one of several shapes: with return_metadata, this pair)
    arrays, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    config = llama_config(metadata)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if "output.weight" in arrays or "output.scales" in arrays:
        config["tie_word_embeddings"] = False

    float_weights: dict[str, mx.array] = {}
    quant_weights: dict[str, mx.array] = {}
    quant_overrides: dict[str, dict[str, int]] = {}
    bases = sorted({name.rsplit(".", 1)[0] for name in arrays})
    group_size, default_bits = 32, 4
    for base in bases:
        name = mlx_name(base)
        weight = arrays[f"{base}.weight"]
        n_head = heads if base.endswith("attn_q") else kv_heads if base.endswith("attn_k") else 0
        if f"{base}.scales" in arrays:
            scales = arrays[f"{base}.scales"]
            biases = arrays[f"{base}.biases"]
            in_features = scales.shape[-1] * group_size
            bits = _bits_of(weight.shape[-1], in_features)
            parts = {"weight": weight, "scales": scales, "biases": biases}
            if n_head:
                parts = {k: unpermute_rows(v, n_head) for k, v in parts.items()}
            for key, value in parts.items():
                quant_weights[f"{name}.{key}"] = value
            if bits != default_bits:
                quant_overrides[name] = {"group_size": group_size, "bits": bits}
            dense = mx.dequantize(
                parts["weight"],
                parts["scales"].astype(mx.float32),
                parts["biases"].astype(mx.float32),
                group_size=group_size,
                bits=bits,
            )
            float_weights[f"{name}.weight"] = dense
        else:
            dense = unpermute_rows(weight, n_head) if n_head else weight
            float_weights[f"{name}.weight"] = dense.astype(mx.float32)
            quant_weights[f"{name}.weight"] = dense.astype(mx.float32)

    quantization: dict[str, Any] = {"group_size": group_size, "bits": default_bits}
    quantization.update(quant_overrides)
    for folder, weights, extra in (
        (out_float, float_weights, {}),
        (
            out_quantized,
            quant_weights,
            {"quantization": quantization, "quantization_config": quantization},
        ),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        write_tokenizer(metadata, folder)
