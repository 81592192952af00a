"""A stages-only table for an mlx-lm architecture without a tensor-parallel table.

Pure Python: mlx-lm's model module is read as source (``ast``), never imported, so the planner
(which must not import MLX) can ask it too. Nothing is split inside a layer (no linears, no
branches): each pipeline stage is one rank holding whole layers, the first embeds, the last
normalises and projects. A stage boundary is safe only where the model's layer stack is the
plain loop `exo_tp.shard` relies on::

    h = self.<embedding>(inputs)            # optionally: unless input_embeddings is given
    mask = create_attention_mask(h, cache[0])   # anything not reading the model's state
    for layer, c in zip(self.layers, cache):
        h = layer(h, mask, c)                # hidden state, locals made above, its cache
    return self.<norm>(h)

Anything else (the embedding scaled in the forward pass, layers given their index or
per-layer inputs, masks from model attributes such as a first-sliding-layer index, layers
reading each other's outputs, caches made per layer index) is refused with the first such
reason found, and the model runs whole on one node.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

from exo_tp.arch.table import ArchTable


class _Refused(Exception):
    """Why a model's layer stack cannot be cut into stages."""


def _models_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def _remapped(models: Path, model_type: str) -> str:
    """mlx-lm's own model-type remapping (MODEL_REMAPPING in mlx_lm/utils.py)."""
    try:
        tree = ast.parse((models.parent / "utils.py").read_text())
    except OSError:
        return model_type
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in node.targets
        ):
            remap = ast.literal_eval(node.value)
            return str(remap.get(model_type, model_type))
    return model_type


def _code(node: ast.AST, limit: int = 90) -> str:
    """A node's source on one line, shortened: a reason is one readable line."""
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _self_attr(node: ast.AST) -> str | None:
    """``X`` for ``self.X``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr if node.value.id == "self" else None
    return None


def _assigned(fn: ast.FunctionDef | None) -> dict[str, ast.expr]:
    """``self.X = value`` anywhere in a method (branches included): X -> value."""
    out: dict[str, ast.expr] = {}
    for node in ast.walk(fn) if fn else ():
        if isinstance(node, ast.Assign):
            for target in node.targets:
                attr = _self_attr(target)
                if attr:
                    out.setdefault(attr, node.value)
    return out


def _called_name(value: ast.expr) -> str:
    """``nn.Linear`` for ``nn.Linear(...)``."""
    return ast.unparse(value.func) if isinstance(value, ast.Call) else ""


def _self_reads(node: ast.AST) -> list[str]:
    return [a for n in ast.walk(node) if (a := _self_attr(n))]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _Stack:
    """The layer stack's forward pass, checked statement by statement (see the module doc)."""

    def __init__(self, fn: ast.FunctionDef):
        params = [a.arg for a in fn.args.args[1:]]
        if not params or "cache" not in params + [a.arg for a in fn.args.kwonlyargs]:
            raise _Refused("its layer stack takes no cache argument")
        self.inputs = params[0]
        self.hidden: str | None = None
        self.embedding: str | None = None
        self.locals: set[str] = set()
        self.norm = ""
        body = [s for s in fn.body if not _docstring(s)]
        loop = next((i for i, s in enumerate(body) if isinstance(s, ast.For)), None)
        if loop is None:
            raise _Refused("its layer stack has no loop over its layers")
        for statement in body[:loop]:
            self._before(statement)
        if self.embedding is None or self.hidden is None:
            raise _Refused("its layer stack does not start by embedding its tokens")
        self._loop(body[loop])
        self._end(body[loop + 1 :])

    def _embeds(self, node: ast.AST) -> str | None:
        """The embedding attribute if ``node`` is ``self.E(inputs)``."""
        if (
            isinstance(node, ast.Call)
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == self.inputs
        ):
            return _self_attr(node.func)
        return None

    def _before(self, statement: ast.stmt) -> None:
        if isinstance(statement, ast.If) and "input_embeddings" in _names(statement.test):
            for node in ast.walk(statement):
                if not isinstance(node, ast.Assign):
                    continue
                if e := self._embeds(node.value):
                    self.embedding, self.hidden = e, ast.unparse(node.targets[0])
                elif ast.unparse(node.value) != "input_embeddings":
                    raise _Refused(
                        f"its forward pass changes the embedding's output before the first "
                        f"layer ({_code(node)}), which a later stage would apply again"
                    )
            return
        if isinstance(statement, ast.If) and ast.unparse(statement.test) == "cache is None":
            return
        if isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names = {n for t in targets for n in _names(t)}
            value = statement.value
            if value is not None and self.hidden is None and (e := self._embeds(value)):
                self.embedding, self.hidden = e, ast.unparse(targets[0])
                return
            embeds = any(self._embeds(n) for n in ast.walk(statement))
            if self.hidden in names or embeds:
                raise _Refused(
                    f"its forward pass changes the embedding's output before the first layer "
                    f"({_code(statement)}), which a later stage would apply again"
                )
            if any(
                isinstance(n, ast.Subscript)
                and ast.unparse(n.value) == "cache"
                and ast.unparse(n.slice) != "0"
                for n in ast.walk(statement)
            ):
                raise _Refused(
                    f"its masks come from a cache other than the first ({_code(statement)}), "
                    "whose index a layer slice would have to follow"
                )
            if reads := [a for a in _self_reads(statement) if a != "layers"]:
                raise _Refused(
                    f"its masks or layer inputs depend on the model's own state (self.{reads[0]}),"
                    " which a layer slice would have to follow"
                )
            self.locals |= names
            return
        raise _Refused(f"its layer stack does more before its layers ({_code(statement)})")

    def _loop(self, loop: ast.For) -> None:
        it = loop.iter
        plain = (
            isinstance(it, ast.Call)
            and ast.unparse(it.func) == "zip"
            and len(it.args) == 2
            and _self_attr(it.args[0]) == "layers"
            and isinstance(loop.target, ast.Tuple)
            and len(loop.target.elts) == 2
        )
        if not plain:
            raise _Refused(f"its layers are run by index or with per-layer inputs ({_code(it)})")
        assert isinstance(loop.target, ast.Tuple)  # checked in `plain` above
        layer, own_cache = (ast.unparse(e) for e in loop.target.elts)
        call = loop.body[0].value if len(loop.body) == 1 else None  # type: ignore[attr-defined]
        if not (
            isinstance(loop.body[0], ast.Assign)
            and ast.unparse(loop.body[0].targets[0]) == self.hidden
            and isinstance(call, ast.Call)
            and ast.unparse(call.func) == layer
        ):
            raise _Refused(
                "its layer loop does more than run each layer on the hidden state "
                f"({_code(loop.body[0])})"
            )
        allowed = {self.hidden, own_cache, *self.locals, "None", "True", "False"}
        args = [*call.args, *(k.value for k in call.keywords)]
        if any(not isinstance(a, ast.Name | ast.Constant) for a in args) or not (
            _names(call) - {layer} <= allowed
        ):
            raise _Refused(f"its layers take per-layer inputs ({_code(call)})")

    def _end(self, rest: list[ast.stmt]) -> None:
        last = rest[0] if len(rest) == 1 else None
        value = last.value if isinstance(last, ast.Return) else None
        if not (
            isinstance(value, ast.Call)
            and len(value.args) == 1
            and ast.unparse(value.args[0]) == self.hidden
            and _self_attr(value.func)
        ):
            raise _Refused("its layer stack does not end with one final norm of the hidden state")
        self.norm = _self_attr(value.func) or ""


def _docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def _tie_default(classes: dict[str, ast.ClassDef], has_head: bool) -> bool:
    """mlx-lm's default for a config without tie_word_embeddings (its ModelArgs field); a
    model without a separate head is always tied."""
    args = classes.get("ModelArgs")
    for node in args.body if args else ():
        if (
            isinstance(node, ast.AnnAssign)
            and ast.unparse(node.target) == "tie_word_embeddings"
            and isinstance(node.value, ast.Constant)
        ):
            return bool(node.value.value)
    return not has_head


def _head(classes: dict[str, ast.ClassDef]) -> dict[str, Any]:
    """The LM head (a Linear of Model, e.g. InternLM 2's ``output``) and the tie default."""
    built = _assigned(_method(classes["Model"], "__init__"))
    heads = [a for a, v in built.items() if _called_name(v) in ("nn.Linear", "Linear")]
    return {
        "lm_head": heads[0] if heads else "lm_head",
        "tie_default": _tie_default(classes, bool(heads)),
    }


def _describe(classes: dict[str, ast.ClassDef], model_type: str) -> dict[str, Any]:
    """The stack's paths where stages of whole layers are safe (else `_Refused`, why not)."""
    model = classes["Model"]
    built = _assigned(_method(model, "__init__"))
    if "layers" in built:
        raise _Refused("its Model runs its layers itself, with no separate layer stack")
    stacks = [
        (attr, classes[name])
        for attr, value in built.items()
        if (name := _called_name(value)) in classes
        and "layers" in _assigned(_method(classes[name], "__init__"))
    ]
    if len(stacks) != 1:
        raise _Refused("no single layer stack (a module holding `layers`) was found")
    attr, cls = stacks[0]
    forward = _method(cls, "__call__")
    if forward is None:
        raise _Refused("its layer stack has no forward pass")
    stack = _Stack(forward)
    call = _method(model, "__call__")
    calls = (
        [n for n in ast.walk(call) if isinstance(n, ast.Call) and _self_attr(n.func) == attr]
        if call
        else []
    )
    first_param = call.args.args[1].arg if call and len(call.args.args) > 1 else None
    if not calls or not (
        calls[0].args
        and isinstance(calls[0].args[0], ast.Name)
        and calls[0].args[0].id == first_param
    ):
        raise _Refused("its Model does not hand its tokens straight to its layer stack")
    make_cache = _method(model, "make_cache")
    if make_cache is not None and "self.layers" not in ast.unparse(make_cache):
        raise _Refused("its make_cache counts layers from its config, not from the layers held")
    if make_cache is not None and any(
        (isinstance(n, ast.Name) and n.id == "enumerate")
        or (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Name))
        for n in ast.walk(make_cache)
    ):
        raise _Refused("its caches are made by layer index (make_cache)")
    return {
        "layers": f"{attr}.layers",
        "embedding": f"{attr}.{stack.embedding}",
        "norm": f"{attr}.{stack.norm}",
        "stages": True,
        "why": (
            f"no tensor-parallel table for {model_type}; its layer stack embeds, runs each "
            "layer on the hidden state alone and normalises, so stages of whole layers work"
        ),
    }


@cache
def generic_table(model_type: str) -> ArchTable | None:
    """The stages-only table of an mlx-lm model type without a tensor-parallel table (stages
    refused where its layer stack does not allow them, ``why`` saying so); None where
    mlx-lm has no such model type."""
    models = _models_dir()
    if models is None or not model_type.replace("-", "_").replace("_", "a").isalnum():
        return None
    source = models / f"{_remapped(models, model_type)}.py"
    if not source.is_file():
        return None
    tree = ast.parse(source.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if "Model" not in classes:
        return None  # a helper module (cache, switch_layers ...), not a model type
    # ArchTable's keyword arguments, of mixed types (pydantic checks them when it is built)
    common: dict[str, Any] = {
        "model_types": (model_type,),
        "linears": (),
        "branches": (),
        "counts": (),
    }
    common |= {"split": False, **_head(classes)}
    try:
        return ArchTable(**common, **_describe(classes, model_type))
    except _Refused as refused:
        why = f"no tensor-parallel table for {model_type}, and no pipeline stages: {refused}"
        return ArchTable(**common, stages=False, why=why)
