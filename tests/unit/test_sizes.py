"""The house's sizes, kept: no module of exo_tp/ over 450 lines and no function over 80
(argparse builders and nested functions included), so that a later change cannot regrow one
silently. Split by meaning before a limit is reached (DEVELOPERS' guide)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "exo_tp"
MODULE_LINES = 450
FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_found() -> None:
    assert len(_modules()) > 100  # a moved package must not make the checks below vacuous


def test_no_module_is_over_450_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = lines
    assert long == {}
