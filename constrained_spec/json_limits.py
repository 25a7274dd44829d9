"""A nesting limit for JSON that comes from outside: checked before it is parsed.

Python's ``json`` module, ``copy.deepcopy``, jsonschema and the chat templates' ``tojson`` all
recurse once (or several times) per level of nesting, and Python stops at 1,000 frames: a
5,000-deep ``[[[[...]]]]`` of 10 KB is enough to turn any of them into a ``RecursionError``
(the server's 500, the command line's exit 1) from wherever it is walked next. So every reader
of untrusted JSON text (a request body, a ``--schema`` file, a ``--batch`` line, tool-call
arguments in a message history) calls :func:`loads` with a ``what`` naming where the text came
from, and every entry point for already-parsed values from a Python caller can call
:func:`check_depth`; both raise :class:`~constrained_spec.errors.JSONDepthError` naming the
limit, the source and the path to the first container past it.

The text is scanned, not parsed: strings are cut out and the brackets counted with ``re`` and
``bytes`` operations and C-level iterators, so the scan is linear whatever the text holds and
costs less than ``json.loads`` of the same text (a megabyte of text: under a millisecond when
it is mostly strings, tens of milliseconds when every byte is a bracket); the one Python-level
loop (the path of a refused text) runs over at most :data:`PATH_LEVELS` levels. A text the
scan passes cannot nest deeper than the limit in any prefix ``json.loads`` accepts, since both
read strings the same way up to the first error.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Iterator
from typing import Any

from constrained_spec.errors import JSONDepthError

#: The deepest nesting of JSON objects and arrays accepted from outside. Real documents stay
#: far below it: the deepest of JSONSchemaBench's 6,245 real-world schemas nests 63 levels, a
#: schema may nest at most ``schemas.MAX_SCHEMA_DEPTH`` (128) and sits 3 levels into a request
#: body (``response_format.json_schema.schema``; a tool's parameters 4), so 256 leaves a
#: schema's whole budget plus room. It also stays far below Python's recursion limit (1,000
#: frames) for the walkers that later take two or more frames per level (``deepcopy``: 2,
#: i.e. 512 frames; ``json`` and ``tojson``: 1) with a server's or a test runner's stack
#: (about 100 frames) underneath.
MAX_JSON_DEPTH = 256

#: How many levels of the path to the first too-deep container an error names (``messages[2]
#: .content[0].x``, then ``...``): enough to say which part of a request it is in.
PATH_LEVELS = 6

# A JSON string, escapes included, or an unterminated one running to the end of the text
# (json.loads stops there, so nothing after it is ever parsed): every '"' starts a match that
# cannot fail, so the scan stays linear whatever the text (a pattern that could fail would be
# retried from every later quote). DOTALL: a backslash pairs with whatever follows it.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
# once each string is one '"': every byte but the structural ones is deleted
_NOT_STRUCTURAL = bytes(sorted(set(range(256)) - set(b'[]{},:"')))
# byte -> step: an opening bracket 2, a closing one 0, anything else 1; the running sum less
# the position is then the depth after each byte (C-level itertools, no Python loop)
_STEP = bytes.maketrans(b'[{]},:"', b"\x02\x02\x00\x00\x01\x01\x01")
# byte -> 1 for a comma, else 0 (``itertools.compress`` keeps the depths at the commas)
_COMMA = bytes.maketrans(b'[{]},:"', b"\x00\x00\x00\x00\x01\x00\x00")


def loads(text: str | bytes | bytearray, *, what: str, limit: int = MAX_JSON_DEPTH,
          option: str | None = None) -> Any:
    """``json.loads(text)`` once :func:`check_text_depth` has passed it.

    ``what`` names the text in the error (``"the request body"``, ``"--schema file x.json"``,
    ``"--batch line 3"``); ``option`` is the error's option (the flag or parameter to fix).
    Malformed JSON raises ``json.JSONDecodeError`` as ``json.loads`` does (bytes that are not
    text: ``UnicodeDecodeError``); a text nesting deeper than ``limit`` raises
    :class:`~constrained_spec.errors.JSONDepthError` before anything parses it.
    """
    if isinstance(text, (bytes, bytearray)):
        # as json.loads decodes bytes: UTF-8, -16 or -32, told by the first bytes
        text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
    check_text_depth(text, what=what, limit=limit, option=option)
    return json.loads(text)


def check_text_depth(text: str, *, what: str, limit: int = MAX_JSON_DEPTH,
                     option: str | None = None) -> None:
    """Raise :class:`~constrained_spec.errors.JSONDepthError` when the JSON ``text`` nests
    objects / arrays deeper than ``limit`` (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") <= limit:  # too few brackets to nest that deep
        return
    structural = _STRING.sub('"', text).encode("utf-8", "surrogatepass").translate(
        None, _NOT_STRUCTURAL)
    brackets = structural.translate(None, b',:"')  # the depth needs only these
    if brackets.count(b"[") + brackets.count(b"{") <= limit or max(_depths(brackets)) <= limit:
        return
    # refused: the depth after every structural byte, for the path (the commas give indices)
    depths = list(_depths(structural))
    path = _text_path(structural, depths, depths.index(limit + 1), _STRING.findall(text))
    raise _error(what, limit, path, option)


def _depths(structural: bytes) -> Iterator[int]:
    """The nesting depth after each byte of ``structural`` (C-level iterators throughout)."""
    return map(operator.sub, itertools.accumulate(structural.translate(_STEP)),
               itertools.count(1))


def _text_path(compact: bytes, depths: list[int], at: int, strings: list[str]) -> list[Any]:
    """The keys and indices down to the container that opens at ``compact[at]``, the first past
    the limit: its first ``PATH_LEVELS`` steps, then ``...`` where it goes on. ``compact`` is
    the text's structural bytes (each string one '"'), ``depths`` the depth after each byte,
    ``strings`` the text's strings in order."""
    # the container of level d (depth d once open) opens just after the last byte before
    # ``at`` at depth d - 1 (none: the text's first byte); one reversed copy, and a C-level
    # index() per level, find them all
    before = depths[at - 1::-1] if at else []
    steps = min(PATH_LEVELS, depths[at] - 1)
    opens = []
    for level in range(1, steps + 2):
        try:
            opens.append(at - before.index(level - 1))
        except ValueError:
            opens.append(0)
    path: list[Any] = []
    for parent, child in zip(opens, opens[1:]):
        if compact[parent] == ord("{"):  # the key: the string before the ':' before the child
            path.append(_key(strings[compact.count(b'"', 0, child - 1) - 1])
                        if compact[child - 2:child] == b'":' else "?")
        else:  # the index: the commas at the array's own level before the child
            commas = itertools.compress(depths[parent + 1:child],
                                        compact[parent + 1:child].translate(_COMMA))
            path.append(list(commas).count(depths[parent]))
    return [*path, ...] if depths[at] - 1 > steps else path


def _key(token: str) -> str:
    try:
        key = json.loads(token)
    except ValueError:  # an unterminated or malformed string: json.loads will say so
        return token
    return key if isinstance(key, str) else token


def _error(what: str, limit: int, path: list[Any], option: str | None) -> JSONDepthError:
    where = f" (at {format_path(path)})" if path else ""
    return JSONDepthError(
        f"{what} nests JSON objects / arrays deeper than {limit} levels{where}, the limit for "
        "JSON from outside; flatten it", what=what, limit=limit, path=path, option=option)


def check_depth(value: Any, *, what: str, limit: int = MAX_JSON_DEPTH,
                option: str | None = None) -> None:
    """Raise :class:`~constrained_spec.errors.JSONDepthError` when a parsed value (dicts, lists
    and tuples inside each other, as a Python caller passes a schema or a message history)
    nests deeper than ``limit``. Iterative; shared and cyclic parts are walked once per depth
    they are reached at, so a value that refers to itself is refused, never looped over."""
    seen: dict[int, int] = {}
    # (value, depth of the containers it is in, parent entry, key in the parent)
    stack: list[tuple[Any, int, Any, Any]] = [(value, 0, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if not isinstance(item, (dict, list, tuple)):
            continue
        if depth + 1 > limit:
            raise _error(what, limit, _entry_path(entry), option)
        if seen.get(id(item), -1) >= depth:
            continue
        seen[id(item)] = depth
        children = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((v, depth + 1, entry, k) for k, v in children
                     if isinstance(v, (dict, list, tuple)))


def _entry_path(entry: Any) -> list[Any]:
    keys = []
    while entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    keys.reverse()
    return [*keys[:PATH_LEVELS], ...] if len(keys) > PATH_LEVELS else keys


def format_path(path: list[Any]) -> str:
    """``["messages", 2, "content"]`` -> ``messages[2].content`` (``...``: the path goes on)."""
    out = ""
    for step in path:
        if step is ...:
            out += "..."
        elif isinstance(step, int):
            out += f"[{step}]"
        else:
            out += f".{step}" if out else str(step)
    return out
