"""Manifests of llama-shaped models without files, for pure planning tests (digests unused)."""

from __future__ import annotations

import math

from exo_tp.arch import table_for
from exo_tp.plan.spec import ModelSpec, Quantization
from exo_tp.weights.describe import describe
from exo_tp.weights.manifest import ITEMSIZE, ModelManifest, TensorEntry


def llama_spec(
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    ffn: int,
    vocab: int,
    layers: int,
    tied: bool,
    quant: tuple[int, int] | None,
) -> ModelSpec:
    return ModelSpec(
        model_type="llama",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_sizes={"ffn": ffn},
        vocab_size=vocab,
        tie_word_embeddings=tied,
        dtype_bytes=4,
        quantization=Quantization(group_size=quant[0], bits=quant[1]) if quant else None,
    )


def synthetic_manifest(
    spec: ModelSpec, quant: tuple[int, int] | None, sanitized_extra: bool = False
) -> ModelManifest:
    """Every tensor mlx-lm's llama has for ``spec`` (quantized if ``quant``); with
    ``sanitized_extra`` each layer also has a tensor sanitize() would transform (moved whole)."""
    table = table_for("llama")
    entries: list[TensorEntry] = []
    params: list[str] = []
    offset = 0

    def tensor(name: str, dtype: str, shape: tuple[int, ...], param: bool = True) -> None:
        nonlocal offset
        entry = describe(name, "model.safetensors", offset, dtype, shape, param, spec, table)
        entries.append(entry.model_copy(update={"digests": ("0" * 32,) * (len(entry.cuts) - 1)}))
        offset += ITEMSIZE[dtype] * math.prod(shape)
        if param:
            params.append(name)

    def linear(name: str, out: int, inp: int) -> None:
        if quant:
            group, bits = quant
            tensor(f"{name}.weight", "U32", (out, inp * bits // 32))
            tensor(f"{name}.scales", "F16", (out, inp // group))
            tensor(f"{name}.biases", "F16", (out, inp // group))
        else:
            tensor(f"{name}.weight", "F32", (out, inp))

    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    linear("model.embed_tokens", spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        tensor(f"{p}.input_layernorm.weight", "F32", (h,))
        linear(f"{p}.self_attn.q_proj", q, h)
        linear(f"{p}.self_attn.k_proj", kv, h)
        linear(f"{p}.self_attn.v_proj", kv, h)
        linear(f"{p}.self_attn.o_proj", h, q)
        tensor(f"{p}.post_attention_layernorm.weight", "F32", (h,))
        linear(f"{p}.mlp.gate_proj", spec.ffn_sizes["ffn"], h)
        linear(f"{p}.mlp.up_proj", spec.ffn_sizes["ffn"], h)
        linear(f"{p}.mlp.down_proj", h, spec.ffn_sizes["ffn"])
        if sanitized_extra:
            tensor(f"{p}.mlp.experts.0.w1.weight", "F32", (3, h), param=False)
    tensor("model.norm.weight", "F32", (h,))
    if not spec.tie_word_embeddings:
        linear("lm_head", spec.vocab_size, h)
    return ModelManifest(
        identity="synthetic",
        model_type="llama",
        weight_files=(),
        extra_files=(),
        tensors=tuple(entries),
        parameters=tuple(params),
    )
