"""The concise schema language of the ``llm`` command line, turned into JSON Schema.

    name, age int, bio: a short bio

is an object with three required properties: ``name`` (string), ``age`` (integer) and ``bio``
(string, described as "a short bio"). Fields are separated by commas, or by newlines when the
text has any (so descriptions may contain commas). A field is ``name [type][: description]``;
the type is one of ``int``, ``float``, ``bool``, ``str`` (the default). Every field is required,
as in ``llm``.
"""

from __future__ import annotations

from typing import Any

from constrained_spec.errors import SchemaError

__all__ = ["DSL_TYPES", "dsl_to_schema", "wrap_multi"]

#: DSL type name -> JSON Schema type.
DSL_TYPES: dict[str, str] = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}


def dsl_to_schema(text: str) -> dict[str, Any]:
    """Parse the concise schema language into a JSON Schema object.

    Raises
    ------
    SchemaError
        No fields, a field with an unknown type, more than ``name type`` before the colon, or
        the same field twice; the message names the field.
    """
    if not isinstance(text, str):
        raise SchemaError(f"a concise schema is a string, got {type(text).__name__}")
    separator = "\n" if "\n" in text else ","
    properties: dict[str, Any] = {}
    for raw in text.split(separator):
        field = raw.strip()
        if not field:
            continue
        head, _, description = field.partition(":")
        words = head.split()
        if not words:
            raise SchemaError(f"field {field!r} has no name; write 'name [type][: description]'")
        name = words[0]
        if len(words) > 2:
            raise SchemaError(
                f"field {head.strip()!r}: expected 'name [type]' before the colon, got {len(words)} "
                "words; field names have no spaces and a description goes after a colon")
        kind = words[1] if len(words) == 2 else "str"
        if kind not in DSL_TYPES:
            raise SchemaError(f"field {name!r} has unknown type {kind!r}; use one of "
                              f"{', '.join(DSL_TYPES)} (default str)")
        if name in properties:
            raise SchemaError(f"field {name!r} is given twice")
        prop: dict[str, Any] = {"type": DSL_TYPES[kind]}
        if description.strip():
            prop["description"] = description.strip()
        properties[name] = prop
    if not properties:
        raise SchemaError("the concise schema has no fields; write e.g. 'name, age int, bio: a short bio'")
    return {"type": "object", "properties": properties, "required": list(properties)}


def wrap_multi(schema: dict[str, Any]) -> dict[str, Any]:
    """An object whose ``items`` is an array of ``schema`` (``--schema-multi``, as in ``llm``).

    ``$defs`` / ``definitions`` move to the top, so the schema's ``#/$defs/...`` references
    (Pydantic's nested models) still resolve from the new root.
    """
    item = dict(schema)
    hoisted: dict[str, Any] = {key: item.pop(key) for key in ("$defs", "definitions") if key in item}
    for key in ("$schema", "$id"):  # root-only keywords stay at the root
        if key in item:
            hoisted[key] = item.pop(key)
    return {"type": "object", "properties": {"items": {"type": "array", "items": item}},
            "required": ["items"], **hoisted}
