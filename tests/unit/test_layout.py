"""The package's shape, read from the source (no import runs): no import cycles between modules
or between packages, and planning stays pure (no MLX)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "exo_tp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: module level, outside `if TYPE_CHECKING:`
    (imports inside functions run later and cannot form an import-time cycle)."""
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.Try) or (
            isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test)
        ):
            yield from (n for n in node.body if isinstance(n, ast.Import | ast.ImportFrom))


def _graph() -> dict[str, set[str]]:
    """Each exo_tp module -> the exo_tp modules its import runs."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` if it has any (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    """exo_tp.<package> for modules in a subpackage; top-level modules are their own."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules() -> None:
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_no_import_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        mine = _package(module)
        packages.setdefault(mine, set()).update(_package(t) for t in targets if _package(t) != mine)
    cycle = _cycle(packages)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_planning_imports_no_mlx() -> None:
    for path in (ROOT / "plan").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "mlx" or n.startswith(("mlx.", "mlx_lm")) for n in names), path
