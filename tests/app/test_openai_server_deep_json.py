"""Deeply nested JSON against the server, as an attacker sends it (in this process, on the tiny
Llama): a body, a schema, tool parameters or tool-call arguments nested past the limit of
`constrained_spec.json_limits` are a 400 in OpenAI's envelope naming the limit and the place,
never a 500, and the client's keep-alive connection serves on. Unknown fields inside a message
are refused as unknown fields of the request are, and the fields clients echo back from a
response stay accepted."""

from __future__ import annotations

import json

import httpx
import pytest
from openai_server_process import serve_tiny

from constrained_spec.json_limits import MAX_JSON_DEPTH
from constrained_spec.schemas.spec import MAX_SCHEMA_DEPTH

MODEL = "tiny"
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL) as (_, url):
        yield url


def arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def schema(depth: int) -> dict:
    """A JSON Schema of ``depth`` nested objects (arrays of arrays of ... strings)."""
    node: dict = {"type": "string"}
    for _ in range(depth - 1):
        node = {"type": "array", "items": node}
    return node


def body_text(deep_at: str, depth: int, **fields) -> bytes:
    """The request as JSON text, ``"DEEP"`` (at ``deep_at`` in ``fields``) replaced by
    ``depth`` arrays inside each other: 5,000 levels are 10 KB, far under the size limit."""
    text = json.dumps({"model": MODEL, "messages": [USER], **fields})
    assert deep_at in text
    return text.replace(deep_at, arrays(depth)).encode()


def post(client: httpx.Client, url: str, content: bytes) -> httpx.Response:
    return client.post(f"{url}/v1/chat/completions", content=content,
                       headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response, code: str, param: str | None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), err
    return err["message"]


def client_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def ok_request() -> bytes:
    return json.dumps({"model": MODEL, "messages": [USER], "max_tokens": 2}).encode()


def test_a_5000_deep_body_is_a_400_and_the_keep_alive_connection_serves_on(url):
    with httpx.Client(timeout=60) as client:
        first = post(client, url, ok_request())
        assert first.status_code == 200, first.text
        deep = body_text('"DEEP"', 5000, metadata={"x": "DEEP"})
        assert len(deep) < 20_000
        message = error_of(post(client, url, deep), "invalid_json", "metadata.x.0")
        assert f"deeper than {MAX_JSON_DEPTH} levels" in message and "request body" in message
        after = post(client, url, ok_request())
        assert after.status_code == 200, after.text
        # one connection throughout: the refusal did not close it
        assert client_port(first) == client_port(after)


def test_a_body_just_under_the_limit_is_served(url):
    # response_format and tools sit 3 to 4 levels in: a whole schema's depth fits
    assert MAX_JSON_DEPTH >= MAX_SCHEMA_DEPTH + 4
    deep = body_text('"DEEP"', MAX_JSON_DEPTH - 2, metadata={"x": "DEEP"}, max_tokens=2)
    with httpx.Client(timeout=60) as client:
        r = post(client, url, deep)
    assert r.status_code == 200, r.text


def test_a_deep_schema_in_response_format_is_a_400_invalid_schema(url):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": "DEEP"}}
    with httpx.Client(timeout=60) as client:
        # past the body's limit: refused by the scan, named as the schema it is in
        message = error_of(post(client, url, body_text('"DEEP"', 5000, response_format=rf)),
                           "invalid_schema", "response_format.json_schema.schema")
        assert f"deeper than {MAX_JSON_DEPTH} levels" in message
        # within the body's limit, past the schema's: the schema check refuses it
        rf["json_schema"]["schema"] = schema(MAX_SCHEMA_DEPTH + 40)
        r = post(client, url, json.dumps({"model": MODEL, "messages": [USER],
                                          "response_format": rf}).encode())
        message = error_of(r, "invalid_schema", "response_format.json_schema.schema")
        assert f"deeper than {MAX_SCHEMA_DEPTH} levels" in message


def test_deep_tool_parameters_are_a_400_invalid_schema(url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": "DEEP"}}}}}]
    with httpx.Client(timeout=60) as client:
        r = post(client, url, body_text('"DEEP"', 5000, tools=tools))
    assert f"deeper than {MAX_JSON_DEPTH}" in error_of(r, "invalid_schema", "tools")


def history(arguments: str) -> list[dict]:
    return [USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
            {"role": "user", "content": "and now?"}]


def test_deep_tool_call_arguments_in_the_history_are_a_400_naming_the_message(url):
    body = {"model": MODEL, "messages": history(arrays(5000)), "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        r = post(client, url, json.dumps(body).encode())
        message = error_of(r, "invalid_json", "messages.1.tool_calls.0.function.arguments")
        assert f"deeper than {MAX_JSON_DEPTH} levels" in message and "messages[1]" in message
        body["messages"] = history(json.dumps({"x": [1, {"y": 2}]}))  # the same, shallow: served
        r = post(client, url, json.dumps(body).encode())
        assert r.status_code == 200, r.text


def test_a_deep_body_over_the_size_limit_is_still_413(url):
    big = body_text('"DEEP"', 5000, metadata={"x": "DEEP", "pad": "p" * (2 << 20)})

    def chunks():  # no Content-Length: the body reader's own count must refuse it
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    with httpx.Client(timeout=60) as client:
        assert post(client, url, big).status_code == 413
        r = client.post(f"{url}/v1/chat/completions", content=chunks(),
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_an_unknown_field_inside_a_message_is_refused_like_an_unknown_request_field(url):
    with httpx.Client(timeout=60) as client:
        top = post(client, url, json.dumps({"model": MODEL, "messages": [USER],
                                            "bogus": 1}).encode())
        error_of(top, "unknown_parameter", "bogus")
        inner = post(client, url, json.dumps({"model": MODEL, "messages": [
            USER, {"role": "assistant", "content": "x"}, {**USER, "bogus": 1}]}).encode())
        assert "bogus" in error_of(inner, "unknown_parameter", "messages.2.bogus")


@pytest.mark.parametrize("field, value", [("audio", {"id": "audio_1"}),
                                          ("function_call", {"name": "f", "arguments": "{}"})])
def test_message_fields_for_what_the_server_does_not_do_are_refused_unless_empty(url, field, value):
    with httpx.Client(timeout=60) as client:
        r = post(client, url, json.dumps({"model": MODEL, "messages": [
            USER, {"role": "assistant", "content": "x", field: value}, USER]}).encode())
        error_of(r, "unsupported_parameter", f"messages.1.{field}")
        r = post(client, url, json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
            USER, {"role": "assistant", "content": "x", field: None}, USER]}).encode())
        assert r.status_code == 200, r.text


def test_the_message_fields_clients_echo_back_from_a_response_stay_accepted(url):
    with httpx.Client(timeout=60) as client:
        r = post(client, url, ok_request())
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]  # our own response message, as it came
        echoed = {**answer, "reasoning_content": "thought", "reasoning": "thought",
                  "annotations": [], "audio": None, "function_call": None, "refusal": None}
        messages = [{**USER, "name": "ada"}, echoed,
                    {"role": "user", "content": [{"type": "text", "text": "more"}]}]
        r = post(client, url, json.dumps({"model": MODEL, "messages": messages,
                                          "max_tokens": 2}).encode())
        assert r.status_code == 200, r.text
        calls = [USER, {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "ok", "name": "f"}, USER]
        r = post(client, url, json.dumps({"model": MODEL, "messages": calls,
                                          "max_tokens": 2}).encode())
        assert r.status_code == 200, r.text
