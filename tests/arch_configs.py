"""Tiny config.json of every supported architecture, with awkward head, KV-head and FFN counts.

Hidden sizes are multiples of 128 where the head count allows (transformers, which loads the
tokenizer, insists on hidden % heads == 0 for some types), so that quantization at group 32,
64 and 128 covers the input projections. FFN widths are awkward in float (not multiples of 32)
and multiples of 128 in quantized variants (``tiny_config(arch, quantized=True)``), so every
down projection gets quantized too.
The vocabulary is SmolLM2's (49152): the tiny models reuse its tokenizer.
"""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = dict(vocab_size=49152, num_hidden_layers=2, rms_norm_eps=1e-6,
                              rope_theta=10000.0, max_position_embeddings=512)

ARCHS: dict[str, dict[str, Any]] = {
    # GQA 2, head_dim 64 (group-128 o_proj cuts need 2-head units), biases on q/k/v/o and on
    # the MLP (o_proj and down_proj biases must be added once), tied embeddings.
    "llama": dict(model_type="llama", hidden_size=192, intermediate_size=200,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                  attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    # mistral (mlx-lm runs it as llama): GQA 5 over 2 KV heads, a sliding-window layer
    # (RotatingKVCache, window 8 < prompt length) then a full one.
    "mistral": dict(model_type="mistral", hidden_size=128, intermediate_size=232,
                    num_attention_heads=10, num_key_value_heads=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                    tie_word_embeddings=False),
    # 10 heads / 5 KV heads, q/k/v biases, untied head.
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=200,
                  num_attention_heads=10, num_key_value_heads=5, tie_word_embeddings=False),
    # 12 heads / 2 KV heads (GQA 6), per-head q/k norms.
    "qwen3": dict(model_type="qwen3", hidden_size=128, intermediate_size=328,
                  num_attention_heads=12, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True),
    # Attention-score and final-logit soft-capping (tight, so they matter), embedding scale.
    "gemma2": dict(model_type="gemma2", hidden_size=192, intermediate_size=200,
                   num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                   attn_logit_softcapping=10.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=32),
    # One KV head for 5 query heads (KV replicated on every rank), sliding window 8 on every
    # other layer, q/k norms, untied head (the checkpoint has lm_head).
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=160, intermediate_size=200,
                        num_attention_heads=5, num_key_value_heads=1, head_dim=32,
                        sliding_window=8, sliding_window_pattern=2,
                        query_pre_attn_scalar=32, rope_local_base_freq=10000.0),
    # Packed q|k|v and gate|up; head_dim = hidden / heads = 32.
    "phi3": dict(model_type="phi3", hidden_size=192, intermediate_size=200,
                 num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False),
    # 6 experts (top 2) of FFN 200 each; head_dim = hidden / heads = 16.
    "mixtral": dict(model_type="mixtral", hidden_size=128, intermediate_size=200,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=6,
                    num_experts_per_tok=2, tie_word_embeddings=False),
    # Layer 0 dense (FFN 200), layer 1 MoE: 5 experts (top 2) of FFN 104.
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=200,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                      num_experts=5, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[0], moe_intermediate_size=104, norm_topk_prob=True,
                      tie_word_embeddings=False),
    # 4 experts (top 2) of FFN 104 plus a sigmoid-gated shared expert of FFN 136.
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=192, intermediate_size=200,
                      num_attention_heads=6, num_key_value_heads=3, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=104,
                      shared_expert_intermediate_size=136, tie_word_embeddings=False),
    # MLA without q compression: 5 heads, per-head kv_b; layer 0 dense, layer 1 MoE with
    # 4 routed experts (top 2) and one shared expert.
    "deepseek_v2": dict(model_type="deepseek_v2", hidden_size=160, intermediate_size=200,
                        num_attention_heads=5, num_key_value_heads=5, q_lora_rank=None,
                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=104,
                        first_k_dense_replace=1, topk_method="greedy",
                        rope_scaling={"factor": 1.0, "original_max_position_embeddings": 512}),
    # MLA with q compression (q_a/q_b), latent cache, embed_q/unembed_out stacks; 6 heads.
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=128, intermediate_size=200,
                        num_attention_heads=6, num_key_value_heads=6, q_lora_rank=48,
                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=104,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
    # Attention sinks, biased q/k/v/o and experts, alternating sliding (window 8) / full.
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=128, intermediate_size=200,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}

# FFN widths that are multiples of 128, so that quantized variants quantize every down_proj.
_QUANTIZED_FFN = {"intermediate_size": 384, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256}


def tiny_config(arch: str, quantized: bool = False) -> dict[str, Any]:
    config = {**COMMON, **ARCHS[arch]}
    if quantized:
        config.update({k: v for k, v in _QUANTIZED_FFN.items() if k in config})
    return config
