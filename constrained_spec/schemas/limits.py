"""Up-front limits on what a schema asks of the grammar matcher and of ``max_tokens``.

Three known ways for one request to cost far more than its size, each refused before any
compute with the limit named (docs/security.md, "Limits"):

* **nested counted repetitions** in a regular expression (``((a{1,50}){1,50}){1,50}``): the
  matcher (xgrammar's Earley parser) keeps one state per combination of the counters, so its
  work per token grows with the product of the nested upper bounds and with every token. Those
  whose bounds multiply to `MAX_NESTED_REPETITION` or more are refused. What the rule misses
  (an ambiguous pattern under the limit) the engine's grammar-work bound stops at run time
  (`generation.engine.check_grammar_work`);
* **huge choice lists**: compiling N choices takes time and memory growing faster than N
  (20,000 took 3.6 s and 95 MB); more than `MAX_CHOICES` are refused;
* **outputs longer than max_tokens can hold** (``{"type": "string", "minLength": 1000000}``):
  `shortest_output` is a lower bound on the characters of any output a schema allows; when even
  the model's longest token repeated ``max_tokens`` times is shorter, no attempt can complete, and
  the request is refused instead of generating ``max_tokens`` tokens once per retry.

A leaf module: it reads regexes with Python's own parser (the reference: final validation uses
``re``) and JSON Schema documents as plain data.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from typing import Any

from constrained_spec.errors import SchemaError

# Python's own regex parser (``re._parser`` from 3.11, ``sre_parse`` before)
_sre_parse: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")

__all__ = ["MAX_CHOICES", "MAX_NESTED_REPETITION", "check_choice_count", "check_pattern_cost",
           "nested_repetition", "shortest_output"]

MAX_NESTED_REPETITION = 10_000
MAX_CHOICES = 5_000

_REPEATS = {_sre_parse.MAX_REPEAT, _sre_parse.MIN_REPEAT}
if hasattr(_sre_parse, "POSSESSIVE_REPEAT"):
    _REPEATS.add(_sre_parse.POSSESSIVE_REPEAT)


def nested_repetition(pattern: str) -> int:
    """The largest product of the upper bounds of counted repetitions (``{m,n}``, n > 1) nested
    inside each other in ``pattern``; 1 when none nests in another. Unbounded ones (``*``,
    ``+``) are loops without a counter and count 1. ``pattern`` must compile."""
    return _worst(_sre_parse.parse(pattern), 1, 0)[0]


def _worst(sub: Any, product: int, depth: int) -> tuple[int, int]:
    """(the largest product below ``sub`` at nesting depth >= 2, or 1; the deepest depth)."""
    best, deepest = 1, depth
    for op, args in sub:
        inner_product, inner_depth = product, depth
        if op in _REPEATS:
            _, high, body = args
            if high is not _sre_parse.MAXREPEAT and high > 1:
                inner_product, inner_depth = product * high, depth + 1
                if inner_depth >= 2:
                    best = max(best, inner_product)
            children = [body]
        else:
            children = _subpatterns(args)
        for child in children:
            b, d = _worst(child, inner_product, inner_depth)
            best, deepest = max(best, b), max(deepest, d)
    return best, deepest


def _subpatterns(args: Any) -> list[Any]:
    """The sub-patterns among an opcode's arguments (groups, branches, look-arounds)."""
    if isinstance(args, _sre_parse.SubPattern):
        return [args]
    if isinstance(args, (tuple, list)):
        return [s for a in args for s in _subpatterns(a)]
    return []


def check_pattern_cost(pattern: str, *, what: str, keyword: str | None = None,
                       pointer: str | None = None) -> None:
    """Raise `SchemaError` when ``pattern`` nests counted repetitions past the limit."""
    product = nested_repetition(pattern)
    if product >= MAX_NESTED_REPETITION:
        raise SchemaError(
            f"{what} {pattern!r:.80} nests counted repetitions whose upper bounds multiply to "
            f"{product:,} (the limit is {MAX_NESTED_REPETITION - 1:,}): the grammar matcher's "
            "work per token grows with that product; bound the outer repetition by the total "
            "length instead (e.g. 'a{1,2500}' for '(a{1,50}){1,50}') or lower the bounds",
            keyword=keyword, pointer=pointer)


def check_choice_count(count: int, *, what: str) -> None:
    if count > MAX_CHOICES:
        raise SchemaError(f"{what}: {count:,} choices (the limit is {MAX_CHOICES:,}; compile time "
                          "and memory grow faster than the list): use a pattern or a schema "
                          "that describes them")


_DATA = ("const", "enum", "default", "examples")  # JSON values, not schemas


def json_patterns(schema: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, str, list[Any]]]:
    """Every regular expression of a JSON Schema document: (pattern, keyword, path), for
    ``pattern`` values and ``patternProperties`` keys (the document is already bounded in
    depth and size: `spec.check_json_document`)."""
    out: list[tuple[str, str, list[Any]]] = []
    stack: list[tuple[Any, list[Any]]] = [(schema, list(path))]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                out.append((node["pattern"], "pattern", where + ["pattern"]))
            props = node.get("patternProperties")
            if isinstance(props, dict):
                out.extend((k, "patternProperties", where + ["patternProperties", k])
                           for k in props)
            stack.extend((v, where + [k]) for k, v in node.items() if k not in _DATA)
        elif isinstance(node, list):
            stack.extend((v, where + [i]) for i, v in enumerate(node))
    return out


# -- the shortest output --------------------------------------------------------------------

def shortest_output(spec: Any) -> tuple[int, str]:
    """A lower bound on the characters of any output ``spec`` (a `SchemaSpec`) allows, and what
    sets it (for the error). Conservative: what it cannot bound cheaply counts 0."""
    if spec.kind in ("regex", "choice") and spec.regex is not None:
        try:
            low = _sre_parse.parse(spec.regex).getwidth()[0]
        except (re.error, RecursionError, OverflowError):
            return 0, ""
        return int(low), "the regular expression"
    if spec.kind == "json_schema" and isinstance(spec.json_schema, dict):
        low, where = _json_low(spec.json_schema, 0, "")
        return low, f"the schema at {where or '/'}"
    return 0, ""


_MAX_WALK = 64  # levels followed; deeper counts 0 (a lower bound stays a lower bound)


def _json_low(node: Any, depth: int, where: str) -> tuple[int, str]:
    """(a lower bound on the characters of a JSON value ``node`` allows, the pointer of the
    keyword that sets most of it)."""
    if not isinstance(node, dict) or depth > _MAX_WALK or "$ref" in node:
        return 0, where
    if "const" in node:
        return len(json.dumps(node["const"], separators=(",", ":"))), where + "/const"
    if isinstance(node.get("enum"), list) and node["enum"]:
        return min(len(json.dumps(v, separators=(",", ":"))) for v in node["enum"]), where + "/enum"
    lows = [_typed_low(node, depth, where)]
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            lows.append(min((_json_low(b, depth + 1, f"{where}/{key}/{i}")
                             for i, b in enumerate(branches)), key=lambda x: x[0]))
    if isinstance(node.get("allOf"), list):
        lows.extend(_json_low(b, depth + 1, f"{where}/allOf/{i}") for i, b in enumerate(node["allOf"]))
    return max(lows, key=lambda x: x[0])


def _count(node: dict[str, Any], key: str) -> int:
    value = node.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _typed_low(node: dict[str, Any], depth: int, where: str) -> tuple[int, str]:
    """The lower bound from the node's own type keywords (a node of several types: the least)."""
    types = node.get("type")
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if not kinds or not all(isinstance(k, str) for k in kinds):
        return 0, where
    lows = []
    for kind in kinds:
        if kind == "string":
            lows.append((2 + _count(node, "minLength"), where + "/minLength"))
        elif kind == "array":
            items = node.get("items") if isinstance(node.get("items"), dict) else {}
            item, _ = _json_low(items, depth + 1, where + "/items")
            n = _count(node, "minItems")
            lows.append((2 + n * (item + 1) - (1 if n else 0), where + "/minItems"))
        elif kind == "object":
            props = node.get("properties")
            props = props if isinstance(props, dict) else {}
            required = node.get("required")
            names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            total = 2 + max(len(names) - 1, 0)  # the braces and the commas
            for name in names:
                value, _ = _json_low(props.get(name, {}), depth + 1, f"{where}/properties/{name}")
                total += len(json.dumps(name)) + 1 + value  # the key, ':' and the value
            members = _count(node, "minProperties")  # each at least '"":0' and a separator
            lows.append(max((total, where), (1 + 5 * members, where + "/minProperties")))
        else:
            lows.append((1, where))  # a number, true, false, null
    return min(lows, key=lambda x: x[0])
