"""exo-tp: tensor parallelism of any shape for mlx-lm models."""

__version__ = "0.1.0"
