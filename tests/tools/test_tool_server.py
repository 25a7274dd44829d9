"""Tool calls through the OpenAI-compatible server, with the official ``openai`` client: the
tiny random Llama served in this process on a loopback port (required, named, auto, parallel,
streaming reassembly, a multi-turn exchange with tool results, and the 400s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
from openai_server_process import serve_tiny  # noqa: E402

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
SEARCH: dict[str, Any] = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"enum": ["cats", "dogs"]}},
                                     "required": ["q"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_loaded):
    with serve_tiny(tiny_loaded, max_tokens=200) as (server, url):
        yield server, url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="none", max_retries=0, timeout=120)


def assert_valid_calls(message, names=None):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_one_valid_call_with_finish_reason_tool_calls(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message)


def test_a_named_tool_choice_calls_that_tool(client):
    for choice in ({"type": "function", "function": {"name": "search"}}, "search"):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice=choice)
        assert_valid_calls(r.choices[0].message, names=["search"])


def test_parallel_calls_and_auto_give_valid_calls_or_text(client):
    # parallel: the random model may add calls until max_tokens; whatever completes is valid
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=1.0, seed=0,
                                       max_tokens=120, extra_body={"max_retries": 0})
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    if r.choices[0].finish_reason == "tool_calls":
        assert_valid_calls(r.choices[0].message)
    for seed in range(2):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed,
                                           temperature=1.0, max_tokens=30)  # auto by default
        message = r.choices[0].message
        if r.choices[0].finish_reason == "tool_calls":
            assert_valid_calls(message)
        else:
            assert isinstance(message.content, str) and not message.tool_calls


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name,
                                                  "arguments": ""})
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_multi_turn_exchange_with_tool_results(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice="get_weather").choices[0].message
    [call] = first.tool_calls
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                       tool_choice="search")
    assert_valid_calls(r.choices[0].message, names=["search"])
    # the history grew the prompt by the call and the result
    assert r.usage.prompt_tokens > client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="search").usage.prompt_tokens
    # with tool_choice "none" the answer is text
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                       tool_choice="none", max_tokens=3)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": "nope"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400_naming_the_field(served, fields, param):
    r = httpx.post(f"{served[1]}/v1/chat/completions",
                   json={"model": "tiny", "messages": ASK, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
