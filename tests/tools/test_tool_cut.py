"""A tool-call output cut by ``max_tokens`` in Python, as the server answers it: the complete
calls come back (``finish_reason`` "length"), the call that had begun is dropped and said so
(``GenerationResult.warnings`` and an `OutputWarning`); with no complete call it is an
incomplete output like any other."""

from __future__ import annotations

import warnings

import jsonschema
import pytest

from constrained_spec import Generator, IncompleteOutputError, OutputWarning, ToolCall

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris and in Rome right now?"}]


@pytest.mark.model
def test_a_call_cut_by_max_tokens_returns_the_complete_ones_and_says_so(embedded):
    one = Generator(embedded, tools=[WEATHER], tool_choice="required")(ASK, return_result=True)
    gen = Generator(embedded, tools=[WEATHER, SEARCH], tool_choice="required",
                    parallel_tool_calls=True, max_retries=0)
    cut_at = None
    for extra in range(4, 24, 4):  # a budget that ends inside a later call
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = gen(ASK, max_tokens=len(one.token_ids) + extra, return_result=True)
        # cut inside a later call (not in the last complete call's closing tag, which drops nothing)
        if result.finish_reason == "length" and result.text.count("<tool_call>") > len(result.value or []):
            cut_at = extra
            break
    if cut_at is None:
        pytest.skip("the model wrote one call and ended within every budget tried")
    assert isinstance(result.value, list) and result.value
    for call in result.value:
        assert isinstance(call, ToolCall)
        jsonschema.validate(call.arguments, {"get_weather": WEATHER, "search": SEARCH}[call.name]
                            ["function"]["parameters"])
    assert [w["type"] for w in result.warnings] == ["tool_call_dropped"]
    assert "max_tokens" in result.warnings[0]["message"]
    assert not [w for w in seen if issubclass(w.category, OutputWarning)]  # said on the result
    # the plain value: the warning is the only word of what was dropped
    with pytest.warns(OutputWarning, match="cut by max_tokens"):
        value = gen(ASK, max_tokens=len(one.token_ids) + cut_at)
    assert [c.to_json() for c in value] == [c.to_json() for c in result.value]


@pytest.mark.model
def test_a_cut_with_no_complete_call_is_still_an_incomplete_output(embedded):
    gen = Generator(embedded, tools=[WEATHER], tool_choice="required", max_retries=0)
    with pytest.raises(IncompleteOutputError):
        gen(ASK, max_tokens=6)
