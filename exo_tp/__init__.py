"""exo-tp: tensor parallelism of any shape for mlx-lm models."""

__version__ = "0.1.0"

# Before anything imports mlx-lm (and through it transformers): every exo-tp process reads
# transformers' table of lazy imports from disk instead of rebuilding it (~0.9 s of CPU each).
from exo_tp.process.import_index import install as _install_import_index  # noqa: E402

_install_import_index()

# Optional backends no exo-tp process uses are not imported in its own processes (trio).
from exo_tp.process.lean_imports import keep_out as _keep_out_unused  # noqa: E402

_keep_out_unused()
