"""A node's part in fine-tuning jobs: the jobs it leads, its rank of one, their records and
requests."""
