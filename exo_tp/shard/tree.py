"""Dotted paths into a module tree ("self_attn.q_proj", "model.layers.3")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def get_path(root: Any, path: str) -> Any:
    for key in path.split("."):
        root = root[int(key)] if isinstance(root, list) else getattr(root, key)
    return root


def has_path(root: Any, path: str) -> bool:
    try:
        return get_path(root, path) is not None
    except (AttributeError, IndexError, KeyError, ValueError):
        return False


def set_path(root: Any, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_path(root, parent) if parent else root, name, value)


def flat_items(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """mlx's ``tree_flatten``: the (dotted path, leaf) pairs, the list it returns without a
    ``destination`` (its annotation also allows the dict it fills with one)."""
    from mlx.utils import tree_flatten

    return tree_flatten(tree, is_leaf=is_leaf)  # type: ignore[return-value]
