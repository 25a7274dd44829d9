"""References stay inside the schema document: nothing a schema names is ever fetched.

Left to its defaults, jsonschema resolves a ``$ref`` it cannot find in the document by
downloading it (a deprecated fallback: ``urllib`` on ``http://``, ``https://`` and ``file://``
URIs), so an untrusted schema could make the library read local files, call internal hosts or
hang on a host that never answers. Two rules close that, in every schema mode:

* `check_refs` runs while a JSON Schema is normalised (before pre-flight, a model load or any
  generation) and raises `SchemaError`, with the JSON pointer of the reference, for every
  ``$ref`` / ``$dynamicRef`` / ``$recursiveRef`` that does not resolve inside the document. It
  also refuses a ``"#/..."`` reference that a nested ``$id`` makes resolve elsewhere than
  from the document root: the grammar backends resolve it from the root, jsonschema from the
  nested ``$id``, so generation and final validation would disagree (or final validation
  would fail on a pointer to nowhere after the tokens were paid for).
* every jsonschema validator the library builds (`validator`) gets `REGISTRY`, whose
  ``retrieve`` refuses, so jsonschema never falls back to its ``urlopen`` even on a path
  `check_refs` did not foresee.

Resolution itself is the ``referencing`` library's, the one jsonschema uses, so the check
follows ``$id`` base URIs, anchors and drafts exactly as final validation will.
"""

from __future__ import annotations

from typing import Any

from constrained_spec.errors import SchemaError

from .pointers import resolve_local_ref, to_pointer

__all__ = ["REGISTRY", "REF_KEYWORDS", "check_refs", "validator", "validator_class"]

#: The keywords whose value is a reference jsonschema resolves.
REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


def _refuse_retrieval(uri: str) -> Any:
    """The registry's ``retrieve``: a reference outside the document is never fetched."""
    from referencing.exceptions import NoSuchResource

    # referencing's attrs stub marks its classes with a pre-PEP 681 decorator mypy does not
    # read, so their generated __init__ (ref, retrieve) is unknown to it
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


def _registry() -> Any:
    import referencing
    from jsonschema_specifications import REGISTRY as SPECIFICATIONS

    # the draft meta-schemas jsonschema ships stay resolvable (they are bundled, not fetched)
    return SPECIFICATIONS.combine(referencing.Registry(retrieve=_refuse_retrieval))  # type: ignore[call-arg]


#: The registry every jsonschema validator of the library resolves references in.
REGISTRY = _registry()


def validator_class(schema: Any) -> Any:
    """The jsonschema validator class of `schema`'s ``$schema`` draft (default 2020-12)."""
    import jsonschema
    from jsonschema.validators import validator_for

    return validator_for(schema, default=jsonschema.Draft202012Validator)


def validator(schema: Any, *, cls: Any = None, format_checker: Any = None) -> Any:
    """A jsonschema validator for `schema` that never retrieves a reference (see module doc)."""
    cls = cls or validator_class(schema)
    return cls(schema, format_checker=format_checker, registry=REGISTRY)


def _has_refs(js: Any) -> bool:
    stack = [js]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(k in node for k in REF_KEYWORDS):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _paths(js: Any) -> dict[int, list[Any]]:
    """id() of every object / array in the document -> its path (the first one found)."""
    out: dict[int, list[Any]] = {}
    stack: list[tuple[Any, list[Any]]] = [(js, [])]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            out.setdefault(id(node), path)
            stack.extend((v, path + [k]) for k, v in node.items())
        elif isinstance(node, list):
            out.setdefault(id(node), path)
            stack.extend((v, path + [i]) for i, v in enumerate(node))
    return out


def check_refs(js: dict) -> None:
    """Raise `SchemaError` (keyword + JSON pointer) for a reference of `js` that does not
    resolve inside `js`, or that resolves elsewhere than the grammar backends resolve it.

    Every subschema jsonschema can reach is visited: the in-place subschemas of each draft
    (``referencing``'s own list) and the targets of references, each with the base URI
    jsonschema would use there.
    """
    if not _has_refs(js):
        return
    import referencing.jsonschema
    from referencing.exceptions import Unresolvable

    cls = validator_class(js)
    spec = referencing.jsonschema.specification_with(
        cls.ID_OF(cls.META_SCHEMA), default=referencing.jsonschema.DRAFT202012)
    paths = _paths(js)

    def enclosing_id(path: list[Any]) -> str:
        """Where the nearest nested (non-root) $id above `path` is, for the message."""
        node, found = js, ""
        for i, part in enumerate(path):
            node = node[part]
            if isinstance(node, dict) and spec.id_of(node) is not None:
                found = to_pointer(path[:i + 1] + ["$id" if "$id" in node else "id"])
        return found

    visited: set[int] = set()
    # (subschema, the resolver jsonschema uses at it, its path)
    stack: list[tuple[Any, Any, list[Any]]] = [
        (js, REGISTRY.resolver_with_root(spec.create_resource(js)), [])]
    while stack:
        node, resolver, path = stack.pop()
        if not isinstance(node, dict) or id(node) in visited:
            continue
        visited.add(id(node))
        for keyword in REF_KEYWORDS:
            ref = node.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolved = resolver.lookup(ref)
            except Unresolvable:
                resolved = None
            target = None if resolved is None else resolved.contents
            # a boolean schema has no identity to compare; it holds no further references
            inside = resolved is not None and (isinstance(target, bool) or id(target) in paths)
            problem = None
            if ref == "#" or ref.startswith("#/"):
                local = resolve_local_ref(js, ref)
                same = inside and local is not None and (target is local[0] or isinstance(target, bool))
                if not same:
                    nested = enclosing_id(path)
                    if nested:
                        problem = (f"resolves from the document root for the grammar but from "
                                   f"the nested $id at {nested} for final validation"
                                   + ("" if local is not None else ", and points nowhere from the root")
                                   + "; remove the nested $id, or refer to the schema from the root")
                    else:
                        problem = "points nowhere in this schema"
            elif not inside:
                problem = ("is not a local JSON pointer ('#/...') and names nothing in this schema: "
                           "references outside the schema are never fetched (no network or file "
                           "access); inline the referenced schema under $defs and refer to it as "
                           "'#/$defs/NAME'")
            if problem is not None:
                raise SchemaError(f"{keyword} {ref!r} {problem}", keyword=keyword,
                                  pointer=to_pointer(path + [keyword]))
            if isinstance(target, dict) and id(target) not in visited:
                stack.append((target, resolved.resolver, paths[id(target)]))
        for sub in spec.subresources_of(node):
            if isinstance(sub, dict) and id(sub) in paths:
                stack.append((sub, resolver.in_subresource(spec.create_resource(sub)),
                              paths[id(sub)]))
