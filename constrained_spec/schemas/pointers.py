"""JSON pointers (RFC 6901) into a schema document: writing one for a path, resolving a local
``$ref``. A leaf module: everything that reports a place in a schema uses it, and it uses
nothing of the package."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["resolve_local_ref", "to_pointer"]


def to_pointer(parts: Iterable[Any]) -> str:
    """RFC 6901 JSON pointer for a path of keys / indices ("" is the document root)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def resolve_local_ref(root: Any, ref: Any) -> tuple[Any, list[Any]] | None:
    """Target and document path of a local ``$ref`` ("#", "#/a/b") in ``root``; None when the
    ref is not local or points nowhere."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node: Any = root
    path: list[Any] = []
    for raw in ref[2:].split("/") if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
            path.append(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            path.append(int(part))
        else:
            return None
    return node, path
