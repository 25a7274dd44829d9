"""When the branches of a ``oneOf`` can never both match, so ``anyOf`` means the same.

Both backends generate ``oneOf`` as ``anyOf`` (xgrammar when it cannot prove the branches
disjoint itself, with a warning; outlines always). That is exact when no instance matches two
branches, which `one_of_disjoint` proves for the common shapes: branches of disjoint types,
disjoint ``const`` / ``enum`` values, or a required property every branch fixes to values no
other branch allows (a discriminator). The pre-flight reports a ``oneOf`` it cannot prove; the
xgrammar rewrite hands a proven one to xgrammar as ``anyOf`` (`backends`), which generates the
same grammar without the warning. (xgrammar's own proof, ``TryProvePairwiseDisjointOneOf`` in
its JSON Schema converter, is narrower: a branch with any keyword besides ``type``, or a
``$ref``, is never proven.)
"""

from __future__ import annotations

import json
from typing import Any

from .pointers import resolve_local_ref

__all__ = ["canon", "deref", "one_of_disjoint", "types_of", "types_overlap", "value_type"]


def types_of(node: dict) -> list[str] | None:
    """The type names a schema node states (None when it has no ``type``)."""
    t = node.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    return None


def value_type(value: Any) -> str:
    """The JSON Schema type of a JSON value (an integral float is an integer)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def types_overlap(a: set[str], b: set[str]) -> bool:
    def widen(s: set[str]) -> set[str]:
        return s | ({"integer"} if "number" in s else set())
    return bool(widen(a) & widen(b))


def canon(value: Any) -> str:
    """Equality key for JSON values (1 == 1.0, true != 1)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps([value_type(value), value], sort_keys=True)


def deref(node: Any, root: Any, depth: int = 8) -> Any:
    """`node` with local ``$ref`` s followed (at most `depth` hops; an unresolved one stays)."""
    while depth and isinstance(node, dict) and "$ref" in node:
        target = resolve_local_ref(root, node["$ref"])
        if target is None:
            return node
        node, depth = target[0], depth - 1
    return node


def one_of_disjoint(branches: Any, root: Any) -> bool:
    """Whether no instance can match two of `branches` (a ``oneOf`` list; references resolved
    in `root`), proven by types, values or a discriminator (see the module docstring)."""
    if not isinstance(branches, list):
        return False
    resolved = [deref(b, root) for b in branches]
    if len(resolved) < 2:
        return True
    if not all(isinstance(b, dict) for b in resolved):
        return False
    # per branch: ("values", its values, their types) or ("types", unused, its types)
    descs: list[tuple[str, set[str], set[str]]] = []
    for b in resolved:
        types = types_of(b)
        if "const" in b or "enum" in b:
            vals = [b["const"]] if "const" in b else b["enum"]
            if not isinstance(vals, list):
                break
            descs.append(("values", {canon(v) for v in vals}, {value_type(v) for v in vals}))
        elif types is not None:
            descs.append(("types", set(), set(types)))
        else:  # a branch that states neither: only a discriminator can tell it apart
            break
    else:
        ok = True
        for i in range(len(descs)):
            for j in range(i + 1, len(descs)):
                a, b = descs[i], descs[j]
                if a[0] == "values" and b[0] == "values":
                    ok &= not (a[1] & b[1])
                else:
                    ok &= not types_overlap(a[2], b[2])
        if ok:
            return True
    return _discriminated(resolved, root)


def _discriminated(branches: list[dict], root: Any) -> bool:
    common: set[str] | None = None
    for b in branches:
        req = b.get("required")
        req = req if isinstance(req, list) else []
        props = b.get("properties")
        props = props if isinstance(props, dict) else {}
        names = {r for r in req if isinstance(r, str) and r in props}
        common = names if common is None else common & names
    for name in sorted(common or ()):
        seen: set[str] = set()
        ok = True
        for b in branches:
            p = deref(b["properties"][name], root)
            vals = [p["const"]] if isinstance(p, dict) and "const" in p else (
                p.get("enum") if isinstance(p, dict) else None)
            if not isinstance(vals, list):
                ok = False
                break
            keys = {canon(v) for v in vals}
            if keys & seen:
                ok = False
                break
            seen |= keys
        if ok:
            return True
    return False
