"""The nesting limit of JSON from outside (`constrained_spec.json_limits`), as the attacks on it:
text nested past the limit is refused before ``json`` parses it, whatever hides brackets or
quotes, and the error names the limit, the source and the path; parsed values from Python
callers are walked without recursion, cycles and shared parts included."""

from __future__ import annotations

import copy
import json
import random
import sys

import pytest

from constrained_spec import json_limits
from constrained_spec.errors import ConfigError, JSONDepthError
from constrained_spec.json_limits import (
    MAX_JSON_DEPTH,
    check_depth,
    check_text_depth,
    format_path,
    loads,
)


def nested(depth: int, leaf: str = "1") -> str:
    """``depth`` containers inside each other, objects and arrays in turn."""
    text = leaf
    for level in range(depth):
        text = f'{{"k{level}": {text}}}' if level % 2 else f"[{text}]"
    return text


def real_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(real_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(real_depth, value), default=0)
    return 0


def random_document(rng: random.Random, depth: int):
    """A JSON value whose strings are full of brackets, quotes and escapes."""
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(["[", "]{", '"}', "\\", '\\"[', "}}]]", "a\u00e9\U0001f600", 1, 2.5,
                           None, True, "\\u005b"])
    if rng.random() < 0.5:
        return [random_document(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "[", '"{', "\\"]) + str(i): random_document(rng, depth - 1)
            for i in range(rng.randint(0, 3))}


def test_the_scan_measures_exactly_the_depth_json_parses_on_random_documents():
    rng = random.Random(7)
    for _ in range(300):
        value = random_document(rng, rng.randint(0, 9))
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        depth = real_depth(value)
        check_text_depth(text, what="t", limit=depth)  # exactly at the limit: accepted
        if depth:
            with pytest.raises(JSONDepthError):
                check_text_depth(text, what="t", limit=depth - 1)


def test_brackets_inside_strings_and_escaped_quotes_do_not_count():
    hidden = json.dumps(["[" * 1000 + '\\"{' * 1000 + "{" * 1000])
    assert loads(hidden, what="t", limit=1) == json.loads(hidden)


def test_a_text_one_level_past_the_limit_is_refused_before_json_parses_it(monkeypatch):
    parse = json.loads

    def no_parse(text, *a, **k):  # a key's string may be decoded for the path, not the text
        assert not text.startswith(("[", "{")), "json.loads ran on text past the limit"
        return parse(text, *a, **k)

    assert loads(nested(MAX_JSON_DEPTH), what="t") is not None
    monkeypatch.setattr(json_limits.json, "loads", no_parse)
    with pytest.raises(JSONDepthError) as err:
        loads(nested(MAX_JSON_DEPTH + 1), what="t")
    assert err.value.limit == MAX_JSON_DEPTH


def test_a_5000_deep_text_is_a_typed_error_naming_the_limit_the_source_and_the_path():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "extra": "DEEP"}]}]}).replace('"DEEP"', nested(5000))
    with pytest.raises(JSONDepthError) as err:
        loads(body, what="the request body")
    e = err.value
    assert isinstance(e, ConfigError) and e.what == "the request body"
    assert e.path[:6] == ["messages", 0, "content", 0, "extra", "k4999"] and e.path[-1] is ...
    assert f"deeper than {MAX_JSON_DEPTH} levels" in str(e)
    assert "the request body" in str(e) and "messages[0].content[0].extra.k4999..." in str(e)


def test_the_path_counts_array_items_at_their_own_level_only():
    # the commas of the earlier items' own arrays are not items of the outer array
    deep = "[" * 40 + "]" * 40
    text = f'[[1, 2, [3, 4]], {{"a": [5, 6], "b,": 1}}, "x,y", 7, [0, [1, 2], {deep}]]'
    with pytest.raises(JSONDepthError) as err:
        check_text_depth(text, what="t", limit=20)
    assert err.value.path[:3] == [4, 2, 0]


@pytest.mark.parametrize("text", [
    '"' + '\\"' * 200_000,                      # one unterminated string of escaped quotes
    '["' + '\\"[' * 100_000,                    # brackets after it
    '[' * 300 + '"' + '\\' * 100_001,           # ending on a lone backslash
])
def test_an_unterminated_string_hides_what_follows_as_json_would(text):
    # json.loads stops at the unterminated string, so nothing after it is counted; the
    # brackets before it are (300 > the limit in the last case)
    if text.startswith("[" * 300):
        with pytest.raises(JSONDepthError):
            check_text_depth(text, what="t")
    else:
        check_text_depth(text, what="t")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text[:2000])


def test_a_string_match_starts_at_every_quote_so_the_scan_never_backtracks_over_the_text():
    # a string pattern that could fail would be retried from each later quote: quadratic
    rng = random.Random(3)
    for _ in range(200):
        text = "".join(rng.choice('"\\[]{}a,:') for _ in range(rng.randint(1, 40)))
        for i, ch in enumerate(text):
            if ch == '"':
                assert json_limits._STRING.match(text, i) is not None, (text, i)


def test_bytes_are_decoded_as_json_loads_decodes_them():
    value = {"k": ["é", {"x": [1]}]}
    for encoding in ("utf-8", "utf-16", "utf-32"):
        raw = json.dumps(value, ensure_ascii=False).encode(encoding)
        assert loads(raw, what="t") == json.loads(raw) == value
    with pytest.raises(JSONDepthError):
        loads(nested(300).encode("utf-16"), what="t")
    with pytest.raises(UnicodeDecodeError):
        loads(b'{"a": "\xff"}', what="t")


def test_a_value_at_the_limit_survives_the_recursive_walkers_under_a_deep_caller_stack():
    """The limit's reason: json, deepcopy and json.dumps still work at MAX_JSON_DEPTH with
    a server's worth of frames (200) already on the stack."""
    text = nested(MAX_JSON_DEPTH)

    def under(frames: int):
        if frames:
            return under(frames - 1)
        value = loads(text, what="t")
        return json.dumps(copy.deepcopy(value))

    assert sys.getrecursionlimit() >= 1000
    assert json.loads(under(200)) == json.loads(text)


def deep_dict(depth: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(depth):
        node["a"] = [{}]
        node = node["a"][0]
    return root


def test_a_5000_deep_python_value_is_a_typed_error_with_its_path_not_recursion():
    with pytest.raises(JSONDepthError) as err:
        check_depth(deep_dict(5000), what="the schema")
    assert err.value.path[:4] == ["a", 0, "a", 0] and err.value.path[-1] is ...
    check_depth(deep_dict(127), what="the schema")  # 255 containers inside each other
    with pytest.raises(JSONDepthError):
        check_depth(deep_dict(128), what="the schema")  # 257


def test_a_value_that_contains_itself_is_refused_not_walked_forever():
    loop: list = []
    loop.append(loop)
    with pytest.raises(JSONDepthError):
        check_depth(loop, what="t")
    cyclic: dict = {"x": 1}
    cyclic["self"] = {"again": cyclic}
    with pytest.raises(JSONDepthError):
        check_depth(cyclic, what="t")


def test_shared_parts_are_walked_once_per_depth_not_once_per_path():
    # 200 levels of [x, x]: 2**200 paths, 200 distinct lists
    value: list = []
    for _ in range(200):
        value = [value, value]
    check_depth(value, what="t")
    for _ in range(100):
        value = [value, value, value]
    with pytest.raises(JSONDepthError):
        check_depth(value, what="t")


def test_paths_are_written_as_a_reader_writes_them():
    assert format_path(["messages", 2, "content", 0, ...]) == "messages[2].content[0]..."
    assert format_path([0, "a"]) == "[0].a"
    assert format_path([]) == ""


# -- where values from Python callers enter the library ----------------------------------------

def test_a_5000_deep_schema_dict_from_python_is_a_schema_error():
    from constrained_spec.errors import SchemaError
    from constrained_spec.schemas import normalize_schema

    with pytest.raises(SchemaError, match="deeper than 128 levels"):
        normalize_schema(deep_dict(5000))
    with pytest.raises(SchemaError, match="deeper than 128 levels"):
        normalize_schema('{"a": [' * 5000 + "{}" + "]}" * 5000)  # text: refused unparsed


@pytest.mark.parametrize("where", ["parameters", "elsewhere"])
def test_a_5000_deep_tool_dict_from_python_is_a_schema_error(where):
    from constrained_spec.errors import SchemaError
    from constrained_spec.frontend.tools import ToolSet

    # elsewhere: no name, so the error message quotes the dict (a repr recurses too)
    fn = {"name": "f", "parameters": deep_dict(5000)} if where == "parameters" else \
        {"description": "d", "x": deep_dict(5000)}
    with pytest.raises(SchemaError, match=r"deeper than (128|256) levels"):
        ToolSet([{"type": "function", "function": fn}])


def test_a_5000_deep_tool_choice_from_python_is_a_config_error():
    from constrained_spec.frontend.tools import ToolSet

    with pytest.raises(JSONDepthError) as err:
        ToolSet([{"type": "function", "function": {"name": "f"}}],
                 tool_choice={"type": "function", "function": {"name": deep_dict(5000)}})
    assert err.value.option == "tool_choice"


def test_deep_tool_call_arguments_in_an_output_are_an_output_validation_error():
    from constrained_spec.errors import OutputValidationError
    from constrained_spec.frontend.tools import DEFAULT_FORMAT, ToolSet

    tools = ToolSet([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object"}}}], "required")
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"a": {nested(5000)}}}}}\n</tool_call>'
    with pytest.raises(OutputValidationError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        tools.parse(text, DEFAULT_FORMAT)


def test_deep_tool_call_arguments_in_a_history_are_named_by_message_and_call():
    from constrained_spec.frontend.tools import check_history_arguments

    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"function": {"name": "f", "arguments": "{}"}},
                   {"function": {"name": "g", "arguments": nested(5000)}}]}]
    with pytest.raises(JSONDepthError) as err:
        check_history_arguments(history)
    assert "tool call 1 in messages[1]" in str(err.value) and err.value.option == "prompt"
    check_history_arguments(history[:1] + [{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("where", ["content", "arguments"])
def test_a_5000_deep_history_from_python_is_a_config_error_not_recursion(where):
    from constrained_spec.frontend.prompts import encode_prompt

    if where == "content":  # a parsed value nested inside a message
        history = [{"role": "user", "content": deep_dict(5000)}]
    else:  # tool-call arguments given as JSON text, parsed when the template needs them
        history = [{"role": "user", "content": "a"},
                   {"role": "assistant", "tool_calls": [
                       {"function": {"name": "f", "arguments": nested(5000)}}]}]
    with pytest.raises(JSONDepthError) as err:
        encode_prompt(None, history, None)
    assert err.value.option == "prompt" and f"{MAX_JSON_DEPTH} levels" in str(err.value)
