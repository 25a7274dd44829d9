"""One client's schema cannot stall the others, over HTTP on the tiny Llama: the known bombs
are 400s before any compute, naming the limit; a grammar whose matcher work outgrows its bound
is stopped alone (400) while plain requests sent with it are served; a compile past its
timeout is stopped (400) and the server compiles on."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai_server_process import serve_tiny

from constrained_spec import api
from constrained_spec.generation import engine as engine_module
from constrained_spec.grammar import clear_compile_cache

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL, max_tokens=24) as (_, url):
        yield url


def chat(client: httpx.Client | None, url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": HI, **fields}
    post = client.post if client is not None else httpx.post
    return post(f"{url}/v1/chat/completions", json=body, timeout=120)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("fields, param, says", [
    ({"guided_regex": "((a{1,50}){1,50}){1,50}"}, "guided_regex", "125,000"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(b{1,100}){1,100}"}}}}}},
     "response_format", "/properties/s/pattern"),
    ({"guided_choice": [f"c{i}" for i in range(5001)]}, "guided_choice", "5,000"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 1000000}}}}, "max_tokens", "max_tokens=24"),
])
def test_a_known_bomb_is_a_400_before_any_compute(url, fields, param, says):
    with httpx.Client() as client:
        error = error_of(chat(client, url, **fields))
        assert error["param"].startswith(param) and says in error["message"], error
        assert chat(client, url, max_tokens=2).status_code == 200  # same connection, served on


def test_a_costly_grammar_is_stopped_alone_while_plain_requests_are_served(url, monkeypatch):
    # a bound every grammar crosses at its first token: the constrained request is the costly
    # one, the free-text ones have no grammar work to bound
    monkeypatch.setattr(engine_module, "GRAMMAR_GRACE_S", 0.0)
    monkeypatch.setattr(engine_module, "GRAMMAR_S_PER_CALL", 0.0)
    costly = {"guided_regex": r"(\w{1,20} ?){1,50}"}
    with ThreadPoolExecutor(4) as pool:
        bomb = pool.submit(chat, None, url, **costly)
        plain = [pool.submit(chat, None, url, max_tokens=6, temperature=0) for _ in range(3)]
        error = error_of(bomb.result())
        answers = [p.result() for p in plain]
    assert error["code"] == "invalid_schema" and "matcher work" in error["message"], error
    assert [a.status_code for a in answers] == [200] * 3
    monkeypatch.undo()
    assert chat(None, url, max_tokens=4, guided_regex="[a-z]+").status_code == 200


def test_a_compile_past_its_timeout_is_a_400_and_the_server_compiles_on(url, monkeypatch):
    clear_compile_cache()
    monkeypatch.setattr(api, "COMPILE_TIMEOUT_S", 1e-4)  # no compile is that fast
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    error = error_of(chat(None, url, response_format=fmt))
    assert error["param"].startswith("response_format") and "was stopped" in error["message"], error
    monkeypatch.undo()
    r = chat(None, url, response_format=fmt, max_tokens=24)
    assert r.status_code == 200, r.text


IF_THEN = {"type": "string", "enum": ["a", "b"], "if": {"type": "string"}, "then": {"const": "zzz"}}


def test_an_output_failing_an_unenforced_keyword_is_a_400_with_the_preflights_words(url):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": IF_THEN}}
    error = error_of(chat(None, url, response_format=fmt, max_retries=0, temperature=0))
    assert error["code"] == "schema_not_enforced" and error["param"] == "response_format", error
    assert "then at /then" in error["message"] and "strict: false" in error["message"], error


def test_a_tool_call_failing_an_unenforced_keyword_is_a_400_naming_the_tool(url):
    params = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(?=.*Z)[a-z]{1,3}$"}},
              "required": ["x"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "look", "parameters": params}}]
    r = chat(None, url, tools=tools, tool_choice="required", max_retries=0, temperature=0,
             max_tokens=80)
    error = error_of(r)
    assert error["code"] == "schema_not_enforced" and error["param"] == "tools", error
    assert "look: pattern at /properties/x/pattern" in error["message"], error
