"""JSON schemas whose `$ref` cycles leave no finite value: every value they allow holds another
(``{"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}``, or two such
alternatives). llguidance compiles them, and its compile-time probe (`compiler._probe`) catches
the cycles it forces, but where each turn of the cycle leaves the model a choice, nothing but
decoding would tell: the model would write until its token budget ran out.

The check is the least fixed point of "can end" over the schema's local references: a
reference can end once its target can, and a schema can end unless a reference it needs cannot
(its `$ref`, every `allOf`, one of its `anyOf` / `oneOf`, its required properties' schemas
when it is an object, its first `minItems` items when it is an array). It only ever says "no
end" where that is certain: any keyword it does not read is taken to allow an end."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MAX_REFS = 256  # schemas with more distinct references are left to llguidance's limits


def endless(schema: Any) -> bool:
    """Whether ``schema`` allows values but no finite one, because of a `$ref` cycle."""
    try:
        targets = {ref: _resolve(schema, ref) for ref in _refs(schema)}
        if len(targets) > MAX_REFS:
            return False
        ending: set[str] = set()
        grew = True
        while grew:
            grew = False
            for ref, target in targets.items():
                if ref not in ending and (target is None or _ends(target, ending)):
                    ending.add(ref)
                    grew = True
        return not _ends(schema, ending) and _ends(schema, set(targets))
    except RecursionError:  # nested past Python's stack: left to llguidance's limits
        return False


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    stack = [node]
    while stack and len(found) <= MAX_REFS:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found.add(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _resolve(schema: Any, ref: str) -> Any:
    """The local reference's target (a JSON pointer), or None where it names none."""
    node = schema
    for part in unquote(ref[1:]).split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _ends(node: Any, ending: set[str]) -> bool:
    """Whether ``node`` allows a finite value, given the references in ``ending`` do."""
    if not isinstance(node, dict):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in ending:
        return False
    if not all(_ends(part, ending) for part in _list(node, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        parts = _list(node, key)
        if parts and not any(_ends(part, ending) for part in parts):
            return False
    kind = node.get("type")
    if kind == "object" or kind == ["object"]:
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = [name for name in _list(node, "required") if isinstance(name, str)]
        return all(_ends(properties[name], ending) for name in required if name in properties)
    if kind == "array" or kind == ["array"]:
        return _items_end(node, ending)
    return True


def _items_end(node: dict[str, Any], ending: set[str]) -> bool:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) else 0
    prefix = _list(node, "prefixItems")
    if not all(_ends(part, ending) for part in prefix[:least]):
        return False
    items = node.get("items")
    return least <= len(prefix) or not isinstance(items, dict | bool) or _ends(items, ending)


def _list(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []
