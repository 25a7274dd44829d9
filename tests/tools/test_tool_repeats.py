"""Tool calls that repeat, and outputs cut during the calls: what is kept, what is dropped and
said so (``ToolParser.read``, ``StreamingToolParser``), on texts written here (no model)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from constrained_spec.errors import ConfigError, OutputValidationError
from constrained_spec.frontend.tools import (
    DEFAULT_FORMAT,
    FORMATS,
    StreamingToolParser,
    ToolParser,
    ToolSet,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
PARIS, ROME, CATS = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}), \
    ("search", {"q": "cats"})


def parser(choice: str = "required", fmt=DEFAULT_FORMAT) -> ToolParser:
    return ToolParser(ToolSet([WEATHER, SEARCH], choice, True), fmt)


def names_args(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments_json)) for c in calls]


@pytest.mark.parametrize("fmt", [DEFAULT_FORMAT, FORMATS["llama3"], FORMATS["mistral"]],
                         ids=lambda f: f.name)
def test_a_call_identical_to_an_earlier_one_ends_the_calls(fmt):
    text = fmt.write([PARIS, CATS, PARIS, ROME])
    reading = parser(fmt=fmt).read(text)
    assert names_args(reading.calls) == [PARIS, CATS]  # the repeat and what follows: dropped
    assert reading.repeated == (2, 0, "get_weather")
    [note] = reading.notes()
    assert note["type"] == "tool_call_repeated" and "tool call 2" in note["message"]
    assert names_args(parser(fmt=fmt).split(text)[1]) == [PARIS, CATS]


def test_the_same_tool_with_other_arguments_is_a_new_call():
    reading = parser().read(DEFAULT_FORMAT.write([PARIS, ROME, CATS]))
    assert names_args(reading.calls) == [PARIS, ROME, CATS]
    assert reading.repeated is None and reading.notes() == []


def test_a_cut_output_keeps_its_complete_calls_and_drops_the_one_cut():
    whole = DEFAULT_FORMAT.write([PARIS, CATS])
    cut = whole[:whole.rindex('"cats"') + 3]  # inside the second call's arguments
    reading = parser().read(cut, complete=False)
    assert names_args(reading.calls) == [PARIS]
    assert reading.cut == (1, "search") and reading.content == ""
    [note] = reading.notes("max_tokens")
    assert note["type"] == "tool_call_dropped" and "search" in note["message"]
    with pytest.raises(OutputValidationError, match="do not end"):
        parser().read(cut)  # a finished output may not end inside a call


def test_a_call_whose_name_was_still_being_written_is_dropped_and_said_so():
    one = DEFAULT_FORMAT.write([PARIS])
    for tail in ("\n<tool_ca", '\n<tool_call>\n{"name": "sea'):
        reading = parser().read(one + tail, complete=False)
        assert names_args(reading.calls) == [PARIS] and reading.cut == (1, "")
    reading = parser().read(one, complete=False)  # ended with the call: nothing dropped
    assert reading.cut is None and reading.notes() == []


def test_a_cut_output_never_gives_call_markup_as_content():
    whole = DEFAULT_FORMAT.write([PARIS])
    args_end = whole.index('"}') + 2  # a call is complete once its arguments' JSON is
    for n in range(len(whole)):  # cut at every character of a required call
        reading = parser().read(whole[:n], complete=False)
        assert reading.content == ""
        assert len(reading.calls) == (n >= args_end)
        assert (reading.cut is not None) == (0 < n < args_end)
    auto = parser("auto")
    text = "Let me look." + "\n" + whole
    for n in range(len(text)):  # under auto: the text before the calls, never their markup
        reading = auto.read(text[:n], complete=False)
        assert "<" not in reading.content and reading.content.strip() in "Let me look."


def test_repeats_sees_only_a_complete_identical_call():
    p = parser()
    text = DEFAULT_FORMAT.write([PARIS, CATS, PARIS])
    ends = [n for n in range(len(text) + 1) if p.repeats(text[:n])]
    # from the end of the repeated call's arguments on, and not a character before
    assert ends[0] == text.rindex('"}') + 2 and ends[-1] == len(text)
    assert not p.repeats(DEFAULT_FORMAT.write([PARIS, ROME, CATS]))


def _stream(p: StreamingToolParser, text: str) -> list[tuple[str, dict]]:
    """Feed ``text`` one character at a time; the calls as a client reassembles them."""
    calls: dict[int, dict] = {}
    for n in range(1, len(text) + 1):
        _, deltas = p.feed(text[:n], final=n == len(text))
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("calls", [[PARIS, PARIS], [PARIS, ROME, PARIS, CATS], [PARIS, CATS],
                                   [PARIS, ("get_weather", {"city": "Parisian"})], [CATS, CATS, CATS]],
                         ids=["repeat", "repeat-later", "distinct", "shared-prefix", "three"])
def test_streamed_and_whole_outputs_carry_the_same_calls(calls):
    text = DEFAULT_FORMAT.write(calls)
    whole = names_args(parser().read(text).calls)
    streamed = _stream(StreamingToolParser(ToolSet([WEATHER, SEARCH], "required", True),
                                           DEFAULT_FORMAT), text)
    assert streamed == whole
    assert len({json.dumps(c, sort_keys=True) for c in streamed}) == len(streamed)


class Person(BaseModel):
    """A person to record."""

    name: str
    age: int


def test_invoke_on_a_pydantic_tool_returns_the_validated_model():
    p = ToolParser(ToolSet([Person], "required"), DEFAULT_FORMAT)
    call = p.value(DEFAULT_FORMAT.write([("Person", {"name": "Ada", "age": 36})]))
    assert call.invoke() == Person(name="Ada", age=36)
    dict_call = parser().read(DEFAULT_FORMAT.write([PARIS])).calls[0]
    with pytest.raises(ConfigError, match="OpenAI tool dict"):
        dict_call.invoke()


def test_tool_call_is_importable_from_the_package():
    import constrained_spec
    from constrained_spec.frontend.tools import ToolCall

    assert constrained_spec.ToolCall is ToolCall and "ToolCall" in constrained_spec.__all__
