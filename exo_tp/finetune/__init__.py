"""`exo-tp finetune`: LoRA fine-tuning across uneven local ranks, the frozen base sharded by
rows and gathered just in time (see docs/finetune.md)."""
