"""Tool calls end to end on the embedded model (SmolLM2-135M, whose template has no tool
section: the default Hermes format): the library and the server with the ``openai`` client."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest

from constrained_spec import generate
from constrained_spec.frontend.tools import ToolCall

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
from openai_server_process import serve_in_thread  # noqa: E402

pytestmark = pytest.mark.model


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city.

    Parameters
    ----------
    city : str
        The city, e.g. Paris.
    unit : str
        The temperature unit.
    """
    return f"{city}: 21 {unit}"


def get_time(timezone: str) -> str:
    """Get the current time in a time zone."""
    return f"12:00 {timezone}"


def test_the_embedded_model_calls_a_tool_with_speculation_and_forced_tags(embedded):
    result = generate(embedded, "What is the weather like in Paris right now?",
                      tools=[get_weather, get_time], tool_choice="required", max_tokens=80,
                      return_result=True)
    call = result.value
    assert isinstance(call, ToolCall) and call.name in ("get_weather", "get_time")
    assert result.text.startswith('<tool_call>\n{"name": "')
    # tags and names are forced drafts: well above one token per target forward
    assert result.stats.acceptance_length > 2.0
    if call.name == "get_weather":
        assert call.invoke().endswith(call.arguments["unit"])


def test_the_embedded_model_behind_the_server_answers_the_openai_client(embedded):
    from constrained_spec.server import ServerConfig, create_app

    app = create_app(embedded, ServerConfig(model_name="smol", max_tokens=80))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}}]
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smol", tools=tools, tool_choice="required",
            messages=[{"role": "user", "content": "What is the weather in Rome?"}])
        calls = r.choices[0].message.tool_calls  # parallel calls are on by default, as OpenAI's
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments),
                                tools[0]["function"]["parameters"])
