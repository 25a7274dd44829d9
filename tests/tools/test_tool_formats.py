"""The tool-call grammar of each format and tool_choice, format detection from chat templates,
and reading calls back (whole and streamed). The grammars are checked on strings (no model)."""

from __future__ import annotations

import json

import pytest

from constrained_spec.errors import OutputValidationError, SchemaError
from constrained_spec.frontend.tools import (
    DEFAULT_FORMAT,
    FORMATS,
    StreamingToolParser,
    ToolSet,
    detect_format,
)
from constrained_spec.schemas.validate import _grammar_accepts

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}
SEARCH = {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"],
    "additionalProperties": False}}
TOOLS = [WEATHER, SEARCH]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
CATS = ("search", {"q": "cats"})


def accepts(toolset: ToolSet, fmt, text: str) -> bool:
    return _grammar_accepts(toolset.spec(fmt), text)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_required_allows_well_formed_calls_to_the_given_tools_and_nothing_else(fmt):
    one, many = ToolSet(TOOLS, "required"), ToolSet(TOOLS, "required", True)
    call, two = fmt.write([PARIS]), fmt.write([PARIS, CATS])
    assert accepts(one, fmt, call) and accepts(many, fmt, call) and accepts(many, fmt, two)
    assert not accepts(one, fmt, two)  # no parallel calls unless allowed
    bad = [
        "hello",  # text
        "",  # nothing
        fmt.write([("other", {"q": "x"})]),  # not a tool
        fmt.write([("search", {"q": 1})]),  # arguments against the schema
        fmt.write([("get_weather", {"days": 2})]),  # a required argument missing
        fmt.write([("search", {"q": "x", "extra": 1})]),
        fmt.write([PARIS]).replace('": ', '":'),  # another layout than the grammar's
        "Sure. " + call,  # text before the calls
        call + " done",  # text after them
    ]
    for text in bad:
        assert not accepts(many, fmt, text), text


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_named_choice_allows_exactly_one_call_to_that_tool(fmt):
    named = ToolSet(TOOLS, "search", True)
    assert accepts(named, fmt, fmt.write([CATS]))
    assert not accepts(named, fmt, fmt.write([PARIS]))
    assert not accepts(named, fmt, fmt.write([CATS, CATS]))


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_auto_allows_text_or_text_then_calls_and_every_call_is_well_formed(fmt):
    auto = ToolSet(TOOLS, "auto", True)
    call = fmt.write([PARIS, CATS])
    for text in ("It is sunny.", "", call, "Let me check.\n" + call):
        assert accepts(auto, fmt, text), text
    for text in (call + " and more text", fmt.trigger + " not a call",
                 fmt.write([("other", {"q": "x"})])):
        assert not accepts(auto, fmt, text), text


def test_the_outlines_backend_is_refused_with_a_typed_error_naming_it():
    with pytest.raises(SchemaError) as info:
        ToolSet(TOOLS, "required").spec(DEFAULT_FORMAT, backend="outlines")
    assert info.value.backend == "outlines"


class _Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("template, name", [
    (None, "hermes"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # no tools: the default
    ("{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]", "mistral"),
    ('{% if tools %}{"name": ..., "parameters": ...}<|python_tag|>{% endif %}', "llama3"),
])
def test_the_call_format_follows_the_chat_template(template, name):
    fmt = detect_format(_Tok(template))
    assert fmt.name == name
    assert fmt.default == (template is None or "tools" not in template)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_parsing_returns_the_calls_with_typed_arguments_and_their_exact_text(fmt):
    auto = ToolSet(TOOLS, "auto", True)
    content, calls = auto.parse("Checking.\n" + fmt.write([PARIS, CATS]), fmt)
    assert content == "Checking."
    assert [(c.name, c.arguments) for c in calls] == [PARIS, CATS]
    assert [json.loads(c.arguments_json) for c in calls] == [PARIS[1], CATS[1]]
    assert calls[0].id != calls[1].id
    if fmt.id_style == "mistral":  # Mistral's templates take 9 letters and digits, nothing else
        assert all(c.id.isalnum() and len(c.id) == 9 for c in calls)
    else:
        assert all(c.id.startswith("call_") for c in calls)
    assert auto.parse("just text", fmt) == ("just text", [])
    with pytest.raises(OutputValidationError):
        auto.parse(fmt.write([("search", {"q": 3})]), fmt)
    with pytest.raises(OutputValidationError):
        auto.parse(fmt.write([("other", {"q": "x"})]), fmt)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_reassemble_to_the_parsed_calls(fmt, step):
    auto = ToolSet(TOOLS, "auto", True)
    args = {"city": 'Pa"ri}s {x}', "days": 2}  # quotes and braces inside a string
    text = "Let me see. " + fmt.write([("get_weather", args), CATS])
    parser = StreamingToolParser(auto, fmt)
    content, calls = "", {}
    for end in [*range(step, len(text), step), len(text)]:
        new, deltas = parser.feed(text[:end], final=end == len(text))
        content += new
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None  # id, type and name come once, first
                call.update(id=d["id"], name=d["function"]["name"])
                assert d["type"] == "function"
            call["arguments"] += d["function"]["arguments"]
    assert content.strip() == "Let me see."
    _, parsed = auto.parse(text, fmt)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.name, json.loads(c.arguments_json)) for c in parsed]


def test_streamed_text_holds_back_a_possible_trigger_until_it_is_not():
    fmt = FORMATS["hermes"]
    parser = StreamingToolParser(ToolSet(TOOLS, "auto"), fmt)
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("a <tools are") == ("<tools are", [])
    assert parser.feed("a <tools are", final=True) == ("", [])


def test_the_default_system_message_lists_the_tools_and_shows_the_call_form():
    text = ToolSet(TOOLS, "search").describe(DEFAULT_FORMAT)
    assert '"name": "search"' in text and "get_weather" not in text
    assert "<tool_call>" in text and "call to search" in text
    assert len(ToolSet(TOOLS, "auto").describe(DEFAULT_FORMAT, 2)) < len(
        ToolSet(TOOLS, "auto").describe(DEFAULT_FORMAT, 1)) < len(
        ToolSet(TOOLS, "auto").describe(DEFAULT_FORMAT, 0))


def test_the_grammar_of_equal_tool_sets_is_built_once():
    a, b = ToolSet(TOOLS, "required"), ToolSet([dict(t) for t in TOOLS], "required")
    fmt = FORMATS["hermes"]
    assert a.spec(fmt) is b.spec(fmt)
    assert ToolSet(TOOLS, "auto").spec(fmt) is not a.spec(fmt)
    assert a.spec(FORMATS["llama3"]) is not a.spec(fmt)


def test_the_opt_in_bounds_apply_to_the_arguments_in_the_grammar():
    toolset, fmt = ToolSet([SEARCH], "required"), FORMATS["hermes"]
    long = fmt.write([("search", {"q": "x" * 30})])
    assert accepts(toolset, fmt, long)
    assert not _grammar_accepts(toolset.spec(fmt, max_string_length=8), long)
    assert _grammar_accepts(toolset.spec(fmt, max_string_length=8), fmt.write([CATS]))
    # the calls are still validated against the tool's own schema
    assert toolset.parse(long, fmt)[1][0].arguments == {"q": "x" * 30}
