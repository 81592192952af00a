"""The model as mlx-lm builds it: parameter names, and which file tensors the loader may slice
on disk (MLX; only the node computing a manifest needs it)."""

from __future__ import annotations

from pathlib import Path

from exo_tp.errors import ExoTpError


def model_structure(model_dir: Path) -> tuple[tuple[str, ...], frozenset[str]]:
    """(parameter names of the built model, file tensors read straight from the files).

    The model is built lazily, as the loader builds it (nothing is read), and the second set is
    exactly what exo_tp.shard.slicing.WeightSlicer reads on disk: tensors mlx-lm's own load
    (sanitize() included, called once as mlx-lm calls it) leaves as they are, stored with the
    parameter's shape and dtype.
    """
    from mlx.utils import tree_flatten

    from exo_tp.shard.slicing import load_lazily

    try:
        model, _, slicer = load_lazily(Path(model_dir))
    except (FileNotFoundError, ValueError) as bad:
        raise ExoTpError(f"{model_dir}: mlx-lm cannot build the model: {bad}") from None
    params = dict(tree_flatten(model.parameters()))
    sliceable = {
        name
        for name, array in params.items()
        if name in slicer.direct and slicer.files.matches(name, array)
    }
    return tuple(params), frozenset(sliceable)
