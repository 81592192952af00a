"""Tiny config.json of every supported architecture, with awkward head, KV-head and FFN counts.

Attention widths (heads x head_dim, MLA's heads x v_head_dim) are multiples of 128 so that every
quantized variant, group 128 included, quantizes the row-parallel o_proj and the split lands on
group boundaries; hidden sizes are multiples of 128 (and of the head count: transformers, which
loads the tokenizer, checks hidden % heads for some types) so every other linear is quantized
too. FFN widths are awkward in float (not multiples of 32) and 5, 3 or 2 whole 128-groups in
quantized variants (``tiny_config(arch, quantized=True)``), so every down projection is
quantized and split unevenly. The vocabulary is the first 512 ids of SmolLM2's
tokenizer (tests/tiny_models.py trims it): tiny models get a tiny embedding.
"""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = dict(
    vocab_size=512,
    num_hidden_layers=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
)
# Qwen 3.5's partial, multi-section rotary (its dense and MoE text models alike)
QWEN35_ROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 3, 3],
}

ARCHS: dict[str, dict[str, Any]] = {
    # GQA 2 over 3 KV heads, head_dim 64, biases on q/k/v/o and on the MLP (o_proj and
    # down_proj biases must be added once), tied embeddings.
    "llama": dict(
        model_type="llama",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=64,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    # mistral (mlx-lm runs it as llama): GQA 5 over 2 KV heads, a sliding-window layer
    # (RotatingKVCache, window 8 < prompt length) then a full one.
    "mistral": dict(
        model_type="mistral",
        hidden_size=128,
        intermediate_size=232,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        tie_word_embeddings=False,
    ),
    # 6 heads / 3 KV heads (head_dim = hidden / heads = 64), q/k/v biases, untied head.
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=3,
        tie_word_embeddings=False,
    ),
    # 12 heads / 2 KV heads (GQA 6), per-head q/k norms.
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        intermediate_size=328,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # Attention-score and final-logit soft-capping (tight, so they matter), embedding scale.
    "gemma2": dict(
        model_type="gemma2",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=64,
        attn_logit_softcapping=10.0,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=64,
    ),
    # One KV head for 5 query heads (KV replicated on every rank), sliding window 8 on every
    # other layer, q/k norms, tied head as Google ships Gemma 3 (the file has no lm_head:
    # mlx-lm's sanitize removes the model's lm_head module then).
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=640,
        intermediate_size=200,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=128,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=128,
        rope_local_base_freq=10000.0,
        tie_word_embeddings=True,
    ),
    # Gemma 3 as its vision checkpoints hold it: the same text model under language_model.
    "gemma3": dict(
        model_type="gemma3",
        vocab_size=COMMON["vocab_size"],
        text_config=dict(
            COMMON,
            model_type="gemma3_text",
            hidden_size=640,
            intermediate_size=200,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=128,
            sliding_window=8,
            sliding_window_pattern=2,
            query_pre_attn_scalar=128,
            rope_local_base_freq=10000.0,
            tie_word_embeddings=True,
        ),
    ),
    # Packed q|k|v and gate|up; head_dim = hidden / heads = 64.
    "phi3": dict(
        model_type="phi3",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=3,
        tie_word_embeddings=False,
    ),
    # 12 heads / 3 KV heads (head_dim = hidden / heads = 32); 6 experts (top 2) of FFN 200.
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=12,
        num_key_value_heads=3,
        num_local_experts=6,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    # Layer 0 dense (FFN 200), layer 1 MoE: 5 experts (top 2) of FFN 104.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=5,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        moe_intermediate_size=104,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # 4 experts (top 2) of FFN 104 plus a sigmoid-gated shared expert of FFN 136.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=104,
        shared_expert_intermediate_size=136,
        tie_word_embeddings=False,
    ),
    # MLA without q compression: 5 heads, per-head kv_b (nope 32 + v 128); layer 0 dense,
    # layer 1 MoE with 4 routed experts (top 2) and one shared expert.
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        hidden_size=640,
        intermediate_size=200,
        num_attention_heads=5,
        num_key_value_heads=5,
        q_lora_rank=None,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        topk_method="greedy",
        rope_scaling={"factor": 1.0, "original_max_position_embeddings": 512},
        tie_word_embeddings=False,
    ),
    # MLA with q compression (q_a/q_b), latent cache, embed_q/unembed_out stacks; 6 heads.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
    ),
    # Attention sinks, biased q/k/v/o and experts, alternating sliding (window 8) / full;
    # 4 experts (top 2) of FFN 200.
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        tie_word_embeddings=False,
    ),
    # GQA 3 over 2 KV heads (more ranks than KV heads from N=3), head_dim 64 with half of it
    # rotary, per-head q/k norms, biased q/k/v; layer 0 dense (FFN 200), layer 1 MoE: 4
    # experts (top 2, sigmoid router with a correction bias) of FFN 104 plus one shared expert.
    "glm4_moe": dict(
        model_type="glm4_moe",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_scaling=None,
        tie_word_embeddings=False,
    ),
    # GLM-4.7-Flash: DeepSeek V3's MLA (q_a/q_b, latent cache) with 5 heads of v 128, and its
    # MoE (layer 0 dense, layer 1: 4 experts top 2 + a shared expert).
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite",
        hidden_size=640,
        intermediate_size=200,
        num_attention_heads=5,
        num_key_value_heads=5,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=32,
        v_head_dim=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        routed_scaling_factor=1.8,
        tie_word_embeddings=False,
    ),
    # Mistral 4: MLA with 6 heads of v 64, a softmax router, yarn rope and the llama-4 query
    # scale (original context 8: the prompt crosses it).
    "mistral4": dict(
        model_type="mistral4",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 64.0,  # max_position_embeddings / original, as transformers expects
            "original_max_position_embeddings": 8,
            "llama_4_scaling_beta": 0.1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        tie_word_embeddings=False,
    ),
    # Kimi K2.5: a DeepSeek V3 text model (5 heads, q compression, latent cache) nested under
    # text_config of a multimodal wrapper.
    "kimi_k25": dict(
        model_type="kimi_k25",
        text_config=dict(
            COMMON,
            model_type="kimi_k2",
            hidden_size=640,
            intermediate_size=200,
            num_attention_heads=5,
            num_key_value_heads=5,
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=128,
            qk_rope_head_dim=32,
            v_head_dim=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=104,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            tie_word_embeddings=False,
        ),
    ),
    # Kimi K3: Kimi Delta Attention (3 heads of 128: 4+ ranks leave one without any) in layers
    # 0 and 1, MLA (5 heads, q compression, sigmoid output gate) in layer 2; layer 0 dense, then
    # 4 experts top 2 + a shared expert, the routed ones through a 128-wide latent with a norm of
    # their sum; attention residuals in blocks of 2 layers; all under text_config.
    "kimi_k3": dict(
        model_type="kimi_k3",
        text_config=dict(
            COMMON,
            model_type="kimi_linear",
            num_hidden_layers=3,
            hidden_size=384,
            intermediate_size=200,
            num_attention_heads=5,
            num_key_value_heads=5,
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=128,
            qk_rope_head_dim=32,
            v_head_dim=128,
            mla_use_output_gate=True,
            linear_attn_config=dict(
                num_heads=3, head_dim=128, short_conv_kernel_size=4, kda_layers=[1, 2]
            ),
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_intermediate_size=104,
            routed_expert_hidden_size=128,
            latent_moe_use_norm=True,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            attn_res_block_size=2,
            tie_word_embeddings=False,
        ),
    ),
    # Kimi K2 (mlx-lm runs it as deepseek_v3): 3 heads of v 128, so 4+ ranks leave a rank
    # without heads; layer 0 dense, layer 1: 4 experts top 2 + a shared expert.
    "kimi_k2": dict(
        model_type="kimi_k2",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        tie_word_embeddings=False,
    ),
    # DeepSeek V3.2: MLA (6 heads) plus the sparse-attention indexer (3 heads of 32, top 4 keys:
    # shorter than the prompt, so the selection matters), latent + indexer caches per layer.
    "deepseek_v32": dict(
        model_type="deepseek_v32",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=32,
        v_head_dim=64,
        index_n_heads=3,
        index_head_dim=64,
        index_topk=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
    ),
    # GLM-5: DeepSeek V3.2's model with rope_parameters and an interleaved indexer rope; 5 heads.
    "glm_moe_dsa": dict(
        model_type="glm_moe_dsa",
        hidden_size=640,
        intermediate_size=200,
        num_attention_heads=5,
        num_key_value_heads=5,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=32,
        v_head_dim=128,
        index_n_heads=2,
        index_head_dim=64,
        index_topk=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    # Step 3.5: 8 query heads over 2 KV heads (x 64) in full-attention layers, 12 in sliding
    # ones (window 8; 64 and 96 over 8 in the real model, the same ratio), per-head q/k norms, a
    # head-wise gate, half rotary on the full layer; layer 0 dense (clamped SwiGLU), layer 1
    # MoE: 4 experts (top 2, sigmoid router with a bias) + a shared expert of FFN 136.
    "step3p5": dict(
        model_type="step3p5",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=8,
        num_attention_groups=2,
        head_dim=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        attention_other_setting={
            "attention_type": "sliding_attention",
            "num_attention_heads": 12,
            "num_attention_groups": 2,
            "head_dim": 64,
            "true_head_dim": 64,
        },
        partial_rotary_factors=[1.0, 0.5],
        use_head_wise_attn_gate=True,
        moe_num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=104,
        share_expert_dim=136,
        moe_layers_enum="1",
        moe_router_scaling_factor=3.0,
        norm_expert_weight=True,
        swiglu_limits=[0.0, 7.0],
        swiglu_limits_shared=[7.0, 16.0],
        tie_word_embeddings=False,
    ),
    # Layer 0 dense, layer 1 MoE (moe_layer_start_index 1): 4 experts (top 2) of FFN 104 and an
    # ungated shared expert; 6 heads / 2 KV heads, tied embeddings.
    "ernie4_5_moe": dict(
        model_type="ernie4_5_moe",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        use_bias=False,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=104,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        tie_word_embeddings=True,
    ),
    # 10 heads / 2 KV heads with per-head q/k norms, a sliding-window layer (window 8, rope)
    # then a global one (no rope); layer 1 MoE: grouped sigmoid router with a score-correction
    # bias, 4 experts (top 2) of FFN 104 and a shared expert.
    "exaone_moe": dict(
        model_type="exaone_moe",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        is_moe_layer=[False, True],
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=104,
        tie_word_embeddings=False,
    ),
    # Packed, biased query_key_value with per-head q/k norms, 5 heads / 1 KV head (replicated
    # on every rank), half-rotary heads; layer 0 dense, layer 1 MoE: sigmoid router with an
    # expert bias, 4 experts (top 2) plus a shared expert; a normalised LM head (norm_head).
    "bailing_moe": dict(
        model_type="bailing_moe",
        hidden_size=640,
        intermediate_size=200,
        num_attention_heads=5,
        num_key_value_heads=1,
        use_qkv_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=104,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        norm_head=True,
        tie_word_embeddings=False,
    ),
    # Full-width q/k norms (over all heads), 6 heads / 2 KV heads (GQA 3, so more than 2 ranks
    # replicate KV heads and the k norm must count each once), partial rotary (32 of 64);
    # 5 experts (top 2) of FFN 200, sigmoid router with a score-correction bias.
    "minimax": dict(
        model_type="minimax",
        hidden_size=256,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        rotary_dim=32,
        num_local_experts=5,
        num_experts_per_tok=2,
        shared_intermediate_size=0,
        scoring_func="sigmoid",
        use_qk_norm=True,
        tie_word_embeddings=False,
    ),
    # Full-width q/k norms, 10 heads / 5 KV heads (GQA 2), a sliding-window layer (window 8)
    # then a full one, untied head.
    "olmo3": dict(
        model_type="olmo3",
        hidden_size=256,
        intermediate_size=232,
        num_attention_heads=10,
        num_key_value_heads=5,
        head_dim=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    ),
    # Gemma 4 (2B/4B-like): sliding layers of head_dim 64, global layers of head_dim 128 (two
    # head widths in one plan), the last two layers attend with layers 0/1's keys and values
    # (KV sharing) through a double-wide MLP, per-layer input embeddings (vocab-split), tied.
    "gemma4_text": dict(
        model_type="gemma4_text",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        global_head_dim=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=64,
        vocab_size_per_layer_input=512,
        use_double_wide_mlp=True,
        final_logit_softcapping=10.0,
        tie_word_embeddings=True,
    ),
    # Gemma 4 checkpoint (26B-A4B-like) as shipped: the text model nested in text_config;
    # global layers with K = V and 1 KV head (sliding: 3), an MoE block beside the MLP.
    "gemma4": dict(
        model_type="gemma4",
        text_config=dict(
            model_type="gemma4_text",
            hidden_size=256,
            num_hidden_layers=2,
            intermediate_size=200,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=64,
            global_head_dim=128,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=104,
            final_logit_softcapping=10.0,
            vocab_size=512,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        tie_word_embeddings=True,
    ),
    # SmolLM3: llama whose every second layer has no rotary embedding; GQA 3 over 2 KV heads.
    "smollm3": dict(
        model_type="smollm3",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        no_rope_layer_interval=2,
        tie_word_embeddings=True,
    ),
    # Seed-OSS: q/k/v and o biases (o's added once), 10 heads / 2 KV heads; tied head in float,
    # which mlx-lm computes from the embedding's weight (untied when quantized: see
    # _UNTIED_WHEN_QUANTIZED).
    "seed_oss": dict(
        model_type="seed_oss",
        hidden_size=256,
        intermediate_size=200,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=64,
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=False,
        tie_word_embeddings=True,
    ),
    # EXAONE 4: per-head q/k norms, post-norms, a sliding layer (window 8) with rotary
    # embeddings then a global one without; 8 heads / 2 KV heads of 32.
    "exaone4": dict(
        model_type="exaone4",
        hidden_size=256,
        intermediate_size=200,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=8,
        sliding_window_pattern="LG",
        layer_types=["sliding_attention", "full_attention"],  # as shipped (transformers reads)
        rope_scaling=None,
        tie_word_embeddings=False,
    ),
    # Ministral 3: llama-4 query scaling, a sliding layer then a full one; 12 heads / 4 KV
    # heads (head_dim = hidden / heads = 32).
    "ministral3": dict(
        model_type="ministral3",
        hidden_size=384,
        intermediate_size=200,
        num_attention_heads=12,
        num_key_value_heads=4,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4,
        },
        tie_word_embeddings=True,
    ),
    # Mistral 3 (a vision checkpoint's top-level type): Ministral 3 nested under text_config.
    "mistral3": dict(
        model_type="mistral3",
        text_config=dict(
            COMMON,
            model_type="ministral3",
            hidden_size=384,
            intermediate_size=200,
            num_attention_heads=12,
            num_key_value_heads=4,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": 4,
            },
            tie_word_embeddings=True,
        ),
    ),
    # mlx-lm's llama4_text (dense): weightless q/k norms, layer 1 without rotary embedding,
    # 6 heads / 3 KV heads; tied in float (mlx-lm reads the embedding's weight for it).
    "llama4_text": dict(
        model_type="llama4_text",
        hidden_size=256,
        intermediate_size=200,
        intermediate_size_mlp=232,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=64,
        no_rope_layers=[1, 0],
        use_qk_norm=True,
        tie_word_embeddings=True,
    ),
    # Qwen3-VL checkpoint (text model nested, multimodal rotary sections): 10 heads / 5 KV
    # heads of 64, tied head.
    "qwen3_vl": dict(
        model_type="qwen3_vl",
        text_config=dict(
            model_type="qwen3_vl_text",
            hidden_size=256,
            num_hidden_layers=2,
            intermediate_size=200,
            num_attention_heads=10,
            num_key_value_heads=5,
            head_dim=64,
            rms_norm_eps=1e-6,
            vocab_size=512,
            max_position_embeddings=512,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12]},
            tie_word_embeddings=True,
        ),
        tie_word_embeddings=True,
    ),
    # Qwen3-VL-MoE checkpoint: layer 0 dense (FFN 200), layer 1 MoE (5 experts, top 2, FFN
    # 104) as Qwen3-MoE; experts shipped fused and transposed; untied head.
    "qwen3_vl_moe": dict(
        model_type="qwen3_vl_moe",
        text_config=dict(
            model_type="qwen3_vl_moe_text",
            hidden_size=128,
            num_hidden_layers=2,
            intermediate_size=200,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=5,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            moe_intermediate_size=104,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            vocab_size=512,
            max_position_embeddings=512,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12]},
            tie_word_embeddings=False,
        ),
        tie_word_embeddings=False,
    ),
    # DeepSeek V4.1: 6 heads of 72 in 2 output groups of 3 (a low-rank grouped output
    # projection: o_a per group, o_b over all groups), one shared latent key/value (MQA, 72)
    # with a sliding window of 4 (< prompt), 3 hyper-connection streams. Layer 0 attends the
    # window only; layer 1 compresses every 2 tokens, indexes them and picks candidate blocks;
    # layer 2 attends to layer 1's compressed KV with layer 1's selection; layer 3 indexes layer
    # 1's keys among its candidates. The matrix's staged run cuts after layer 2, so the stage
    # boundary hands over all four kinds of shared state. Every layer MoE: 4 experts top 2
    # (sqrt-softplus router) + a shared expert of FFN 104. Head and index widths of 72 and 40
    # are off the blocks of 32 and 16 mlx-lm rounds latents, queries and keys to fp8/fp4 in
    # (simulating the reference's kernels: only whole blocks are rounded), so every variant is
    # checked at 1e-4: where they round, an all-reduce's last-bit difference can land in another
    # step (docs/planner.md). Quantized, o_a (input 3 x 72) and the indexer's k_proj (input 72)
    # stay float at every group size; the rest is quantized.
    "deepseek_v41": dict(
        model_type="deepseek_v41",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=6,
        head_dim=72,
        q_lora_rank=128,
        qk_rope_head_dim=32,
        o_groups=2,
        o_lora_rank=128,
        moe_intermediate_size=104,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        sliding_window=4,
        compress_ratios=[0, 2, 2, 2],
        kv_source_layer_ids=[1],
        index_source_layer_ids=[1, 3],
        candidate_source_layer_id=1,
        candidate_topk_blocks=2,
        candidate_block_size=2,
        index_n_heads=2,
        index_head_dim=40,
        index_topk=3,
        hc_mult=3,
        hc_sinkhorn_iters=5,
        tie_word_embeddings=False,
    ),
    # Nemotron-H: Mamba-2, attention, MLP and MoE layers by hybrid_override_pattern. 6 Mamba
    # heads in 3 groups of 2 (head_dim 64: 128 channels a group, state 16, conv kernel 4), so
    # ranks beyond 3 hold no Mamba-2 group; 4 heads / 2 KV heads x 32; a relu2 MLP; 4 experts
    # top-2 + a shared expert; untied head; HF layout (conv1d (C, 1, K), experts one by one).
    "nemotron_h": dict(
        model_type="nemotron_h",
        hybrid_override_pattern="M*M-E",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=False,
        mamba_num_heads=6,
        mamba_head_dim=64,
        n_groups=3,
        ssm_state_size=16,
        conv_kernel=4,
        mamba_proj_bias=False,
        use_conv_bias=True,
        use_bias=False,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        moe_intermediate_size=104,
        moe_shared_expert_intermediate_size=256,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        tie_word_embeddings=False,
    ),
    # LFM2: short-conv layers (kernel 3, biased) around a full-attention layer, split by
    # channels (128); 4 heads / 2 KV x 32 with q/k layernorms; SwiGLU MLP; tied head
    "lfm2": dict(
        model_type="lfm2",
        hidden_size=128,
        num_hidden_layers=3,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=2,
        full_attn_idxs=[1],
        conv_L_cache=3,
        conv_bias=True,
        norm_eps=1e-5,
        block_dim=128,
        block_multiple_of=8,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
    ),
    # Qwen 3.5 (dense), nested under text_config as shipped: Gated DeltaNet in layers 0 and 2
    # (3 key heads of 32, each with 2 value heads of 64: 5 ranks leave two without any; a key
    # head's 128 out_proj columns fill a group of 128), gated full attention (4 heads / 2 KV x
    # 64, q_proj twice as wide: queries and their gate) in layers 1 and 3; tied embeddings.
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            COMMON,
            model_type="qwen3_5_text",
            num_hidden_layers=4,
            full_attention_interval=2,
            hidden_size=256,
            intermediate_size=200,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=3,
            linear_num_value_heads=6,
            linear_key_head_dim=32,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            rope_parameters=QWEN35_ROPE,
            tie_word_embeddings=True,
        ),
        tie_word_embeddings=True,
    ),
    # Qwen 3.5 MoE: Gated DeltaNet in layer 0 (2 key heads of 32, 2 value heads of 64 each),
    # gated attention in layer 1; every layer 4 experts top 2 + a sigmoid-gated shared expert;
    # experts shipped fused (experts.gate_up_proj, experts.down_proj).
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        text_config=dict(
            COMMON,
            model_type="qwen3_5_moe_text",
            num_hidden_layers=2,
            full_attention_interval=2,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=104,
            shared_expert_intermediate_size=136,
            rope_parameters=QWEN35_ROPE,
            tie_word_embeddings=False,
        ),
        tie_word_embeddings=False,
    ),
    # Qwen3-Next: Gated DeltaNet in layers 0 and 2 (2 key heads of 32, each with 3 value heads
    # of 64; q|k|v|z and b|a interleaved per key head as shipped), gated attention in layers 1
    # and 3 (4 heads / 2 KV x 64, partial rotary); layer 0 dense, the others 4 experts top 2 +
    # a sigmoid-gated shared expert, stored one by one.
    "qwen3_next": dict(
        model_type="qwen3_next",
        num_hidden_layers=4,
        full_attention_interval=2,
        hidden_size=256,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        moe_intermediate_size=104,
        shared_expert_intermediate_size=136,
        partial_rotary_factor=0.25,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}

# FFN widths of quantized variants: 5, 3 and 2 groups of 128 (10, 6, 4 of 64; ...).
_QUANTIZED_FFN = {
    "intermediate_size": 640,
    "intermediate_size_mlp": 640,  # llama4_text's MLP
    "moe_intermediate_size": 384,
    "shared_expert_intermediate_size": 256,
    "share_expert_dim": 256,  # step3p5's name for it
}
# Where intermediate_size is the experts' width, the smaller one.
_EXPERT_SIZED = {"mixtral", "gpt_oss", "minimax"}


# mlx-lm's tied Seed-OSS head multiplies by the embedding's weight, which a quantized
# embedding cannot do (mlx-lm itself fails): quantized variants keep an untied head.
_UNTIED_WHEN_QUANTIZED = {"seed_oss", "llama4_text"}


def tiny_config(arch: str, quantized: bool = False) -> dict[str, Any]:
    config = {**COMMON, **ARCHS[arch]}
    if "text_config" in config:  # nested text models (gemma4, kimi_k25): their sizes live there
        config["text_config"] = dict(config["text_config"])
    if quantized:
        text = config.get("text_config", config)
        config.update({k: v for k, v in _QUANTIZED_FFN.items() if k in config})
        text.update({k: v for k, v in _QUANTIZED_FFN.items() if k in text})
        if arch in _UNTIED_WHEN_QUANTIZED:
            config["tie_word_embeddings"] = False
        if arch in _EXPERT_SIZED:
            text["intermediate_size"] = _QUANTIZED_FFN["moe_intermediate_size"]
    return config


# mlx-lm architectures without a tensor-parallel table (exo_tp.arch.generic): run as pipeline
# stages of whole layers, or whole on one node where their layer stack does not allow stages
# (tests/ranks/test_generic_stages.py). Awkward layer counts, so stage shares are uneven.
GENERIC_ARCHS: dict[str, dict[str, Any]] = {
    # LayerNorms with biases, biased attention and MLP, tied head.
    "starcoder2": dict(
        model_type="starcoder2",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=5,
        tie_word_embeddings=True,
    ),
    # Parallel attention and MLP, the head always tied, logits scaled after it (last stage only).
    "cohere": dict(
        model_type="cohere",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=4,
        logit_scale=0.5,
    ),
    # Its own names: tok_embeddings, packed wqkv, an untied head called `output`.
    "internlm2": dict(
        model_type="internlm2",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        tie_word_embeddings=False,
    ),
    # Refused as stages (its forward pass scales the embedding's output): whole on one node.
    "gemma": dict(
        model_type="gemma",
        hidden_size=128,
        intermediate_size=200,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=3,
    ),
}


def generic_config(arch: str) -> dict[str, Any]:
    return {**COMMON, **GENERIC_ARCHS[arch]}
