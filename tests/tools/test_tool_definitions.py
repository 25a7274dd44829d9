"""Tools from typed functions, Pydantic models and OpenAI dicts: the schema, the description,
the checks on names and choices (no model: milliseconds)."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from constrained_spec.errors import ConfigError, SchemaError
from constrained_spec.frontend.tools import Tool, ToolSet, normalize_tools


def get_weather(city: str, unit: Literal["C", "F"] = "C",
                days: Annotated[int, Field(ge=1, le=7)] = 1) -> str:
    """Get the weather forecast for a city.

    More text that is not the summary.

    Parameters
    ----------
    city : str
        The city's name.
    unit : str
        Celsius or Fahrenheit.
    """
    return f"{city} {unit} {days}"


def book(room: str, people: int) -> None:
    """Book a room.

    Args:
        room (str): The room to book.
        people: How many people.
    """


class Search(BaseModel):
    """Search the web."""

    query: str
    limit: int = 5


OPENAI = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}


def test_a_function_signature_and_docstring_become_the_schema():
    [tool] = normalize_tools([get_weather])
    assert tool.name == "get_weather"
    assert tool.description == "Get the weather forecast for a city."
    props = tool.parameters["properties"]
    assert tool.parameters["required"] == ["city"]
    assert props["city"]["type"] == "string" and props["city"]["description"] == "The city's name."
    assert props["unit"]["enum"] == ["C", "F"] and props["unit"]["description"] == "Celsius or Fahrenheit."
    assert props["days"]["minimum"] == 1 and props["days"]["maximum"] == 7
    assert tool.function is get_weather


def test_google_style_docstrings_describe_the_parameters_too():
    [tool] = normalize_tools([book])
    props = tool.parameters["properties"]
    assert props["room"]["description"] == "The room to book."
    assert props["people"]["description"] == "How many people."


def test_function_arguments_are_typed_keyword_arguments_and_invoke_calls_the_function():
    [tool] = normalize_tools([get_weather])
    args = tool.arguments({"city": "Oslo", "days": 3})
    assert args == {"city": "Oslo", "unit": "C", "days": 3}
    from constrained_spec.frontend.tools import ToolCall

    assert ToolCall("get_weather", args, tool=tool).invoke() == "Oslo C 3"


def test_pydantic_and_openai_tools_keep_their_schema_and_type_the_arguments():
    search, lookup = normalize_tools([Search, OPENAI])
    assert (search.name, search.description) == ("Search", "Search the web.")
    assert search.arguments({"query": "x"}) == Search(query="x")
    assert (lookup.name, lookup.description) == ("lookup", "Look a word up.")
    assert lookup.arguments({"word": "w"}) == {"word": "w"}
    assert lookup.openai() == OPENAI
    # OpenAI's bare function dict and a function without parameters are tools too
    [bare] = normalize_tools([{"name": "ping"}])
    assert bare.parameters == {"type": "object", "properties": {}}


def test_invalid_arguments_fail_validation_with_the_tool_named():
    from constrained_spec.errors import OutputValidationError

    [tool] = normalize_tools([get_weather])
    with pytest.raises(OutputValidationError):
        tool.arguments({"city": "Oslo", "days": 9})


@pytest.mark.parametrize("tools, error", [
    ([], ConfigError),
    ([42], ConfigError),
    ([{"type": "function", "function": {"name": "bad name"}}], ConfigError),
    ([get_weather, get_weather], ConfigError),
    ([{"name": "f", "parameters": {"type": "string"}}], SchemaError),
    ([{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}],
     SchemaError),
])
def test_bad_tools_are_typed_errors_naming_the_option(tools, error):
    with pytest.raises(error) as info:
        normalize_tools(tools)
    if error is ConfigError:
        assert info.value.option == "tools"


def test_a_function_parameter_without_annotation_is_refused():
    def f(x):  # noqa: ANN001 - the point of the test
        """No types."""

    with pytest.raises(ConfigError, match="'x' has no type annotation"):
        normalize_tools([f])


def test_tool_choice_takes_modes_names_and_openais_dict_and_refuses_anything_else():
    tools = [get_weather, Search]
    assert ToolSet(tools, "required").choice == "required"
    assert ToolSet(tools, "Search").offered[0].name == "Search"
    named = ToolSet(tools, {"type": "function", "function": {"name": "get_weather"}})
    assert [t.name for t in named.offered] == ["get_weather"]
    assert not ToolSet(tools, "none").active
    for bad in ("sometimes", "nope", {"type": "function"}, 3):
        with pytest.raises(ConfigError) as info:
            ToolSet(tools, bad)
        assert info.value.option == "tool_choice"
    with pytest.raises(ConfigError):
        ToolSet(tools, "auto", parallel_tool_calls="yes")
    # parallel calls only where several calls are possible
    assert ToolSet(tools, "auto", True).parallel and not ToolSet(tools, "Search", True).parallel


def test_tools_pass_through_as_tool_objects():
    [tool] = normalize_tools([Search])
    assert normalize_tools([tool]) == [tool] and isinstance(tool, Tool)
