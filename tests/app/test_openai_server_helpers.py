"""The OpenAI server's pure parts, without a model: stop strings over streamed text, request
parsing, the error envelope and the key / size guard (milliseconds each)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from constrained_spec.errors import ConfigError, SchemaError
from constrained_spec.generation.serving import QueueFullError
from constrained_spec.server.app import Guard
from constrained_spec.server.choices import ChoiceText
from constrained_spec.server.protocol import (
    APIError,
    api_error,
    chat_prompt,
    parse_body,
    schema_of,
    stop_strings,
)
from constrained_spec.server.state import ServerConfig

VOCAB = ["Hello", " E", "N", "D", " more", "é"[:1], "\ufffd"]


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def test_stop_string_cuts_the_text_and_never_leaks_its_start():
    text = ChoiceText(decode, ["END"])
    sent = text.feed([0]) + text.feed([1])  # "Hello E": "E" may begin "END"
    assert sent == "Hello "
    assert text.feed([2]) == ""  # "EN" still may
    assert text.feed([3, 4]) == ""  # "END" found: cut before it, the rest dropped
    assert text.stopped and text.text == "Hello "
    assert text.finish("ignored once stopped") == ""


def test_held_back_text_is_released_when_no_stop_follows():
    text = ChoiceText(decode, ["END"])
    assert text.feed([0, 1]) == "Hello "
    assert text.feed([4]) == "E more"
    assert not text.stopped
    assert text.finish("Hello E more!") == "!"


def test_an_incomplete_character_waits_for_its_last_byte():
    text = ChoiceText(decode)
    assert text.feed([0, 6]) == "Hello"  # U+FFFD at the end: the rest of a UTF-8 sequence is due
    assert text.feed([4]) == "\ufffd more"  # not at the end any more: it was the text


def test_response_format_maps_to_schema_and_preflight_mode():
    schema = {"type": "object"}
    assert schema_of(None) == (None, "default")
    assert schema_of({"type": "text"}) == (None, "default")
    assert schema_of({"type": "json_object"}) == ({"type": "object"}, "default")
    for strict, mode in ((True, "strict"), (False, "lenient"), (None, "default")):
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        assert schema_of(rf) == (schema, mode)
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(APIError) as info:
            schema_of(bad)
        assert info.value.status == 400 and info.value.param.startswith("response_format")


def test_request_bodies_are_checked_with_the_parameter_named():
    ok = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}'
    body = parse_body(ok)
    assert chat_prompt(body.messages) == [{"role": "user", "content": "hi"}]
    cases = {
        b"{nope": None,
        b'{"model": "m", "messages": []}': "messages",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}': "n",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{}]}': "functions",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}':
            "tool_choice",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": 1}':
            "parallel_tool_calls",
        b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}': "messages.0.role",
    }
    for raw, param in cases.items():
        with pytest.raises(APIError) as info:
            parse_body(raw)
        assert info.value.status == 400 and info.value.param == param, raw
    with pytest.raises(APIError):
        stop_strings(["a", "b", "c", "d", "e"])
    assert stop_strings(["", "x"]) == ["x"]


def test_library_errors_map_to_openai_statuses_and_codes():
    e = api_error(SchemaError("bad", keyword="type", pointer="/a"))
    assert (e.status, e.code, e.param) == (400, "invalid_schema", "response_format")
    assert "keyword 'type'" in e.message and "/a" in e.message
    e = api_error(ConfigError("too hot", option="temperature"))
    assert (e.status, e.param) == (400, "temperature")
    e = api_error(QueueFullError("full"))
    assert (e.status, e.code) == (429, "queue_full")
    assert e.response().headers["retry-after"] == "1"
    assert api_error(RuntimeError("x")).status == 500


def test_guard_checks_the_key_on_v1_routes_and_the_declared_size():
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    config = ServerConfig(model_name="m", api_key="k", max_request_bytes=10)
    guard = Guard(ok, config)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as c:
            r401 = await c.get("/v1/models")
            r200 = await c.get("/v1/models", headers={"Authorization": "Bearer k"})
            health = await c.get("/health")
            r413 = await c.post("/v1/chat/completions", content=b"x" * 11,
                                headers={"Authorization": "Bearer k"})
            return r401, r200, health, r413

    r401, r200, health, r413 = asyncio.run(main())
    assert r401.status_code == 401 and r401.json()["error"]["code"] == "invalid_api_key"
    assert r200.status_code == health.status_code == 200
    assert r413.status_code == 413 and r413.json()["error"]["code"] == "request_too_large"
    assert config.http_responses[("/v1/models", 401)] == 1
