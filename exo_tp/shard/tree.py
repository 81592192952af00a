"""Dotted paths into a module tree ("self_attn.q_proj", "model.layers.3")."""

from __future__ import annotations

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
