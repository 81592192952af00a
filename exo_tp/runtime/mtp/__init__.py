"""The checkpoint's own multi-token-prediction (MTP) heads as the drafter of speculative
decoding (issue #61).

Qwen 3.5/3.6 and Qwen3-Next ship a top-level ``mtp.*`` block, DeepSeek V3 and GLM-5 one
decoder layer more than they run (``num_nextn_predict_layers``): a head that predicts the token
after next from the model's last hidden state and the next token's embedding. mlx-lm drops
those weights; mlx-vlm's MTP drafters (`mlx_vlm.speculative.drafters`) and its splitters load
them, and are reused here as they are: `checkpoint` finds and loads them, `tap` records the
last stage's hidden state per position, `drafter` feeds the heads and drafts, `on_rank` sets it
up on the last stage's ranks.
"""
