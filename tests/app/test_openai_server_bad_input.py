"""Bad input to the server, in this process on the tiny Llama: every mistake is a 400 in
OpenAI's envelope naming the parameter (never a 500), and the server serves on."""

from __future__ import annotations

import json

import httpx
import pytest
from openai_server_process import serve_tiny

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL) as served:
        yield served


@pytest.fixture
def url(served):
    return served[1]


def post(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def assert_400(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_serves_on(url: str) -> None:
    r = post(url, response_format={"type": "json_schema", "json_schema": {
        "name": "c", "schema": {"enum": ["a", "b"]}}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields", [{"seed": 2 ** 63}, {"seed": -(2 ** 63) - 1},
                                    {"seed": 2 ** 63 - 1, "n": 2}])  # choice 2 gets seed + 1
def test_a_seed_past_64_bits_is_a_400_naming_seed(url, fields):
    err = assert_400(post(url, temperature=1.0, **fields), "seed")
    assert "64-bit" in err["message"]
    assert_serves_on(url)


def post_raw(url: str, body: dict) -> httpx.Response:
    """``body`` as ASCII JSON: lone surrogates travel as \\ud800 escapes, as any client sends them."""
    return httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
    ({"messages": [{"role": "system", "content": "be \udcff"},
                   {"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud83d"}]}]}, "messages"),
    ({"response_format": rf({"type": "object", "properties": {"\ud800": {}}})},
     "response_format.json_schema.schema"),
    ({"response_format": rf({"enum": ["ok", "\udc80"]})}, "response_format.json_schema.schema"),
    ({"response_format": rf({"type": "string", "pattern": "a\ud800"})},
     "response_format.json_schema.schema"),
])
def test_text_that_is_not_unicode_is_a_400_not_a_500(url, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    err = assert_400(post_raw(url, body), param)
    assert "lone surrogate" in err["message"]
    assert_serves_on(url)


def test_bytes_that_are_not_utf8_are_a_400(url):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   content=b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}')
    assert_400(r, None)
    assert r.json()["error"]["code"] == "invalid_json"


def test_text_parts_are_joined_and_other_parts_are_refused(url):
    parts = [{"type": "text", "text": "Pick "}, {"type": "text", "text": "one."}]
    schema = rf({"enum": ["a", "b"]})
    r = post(url, messages=[{"role": "user", "content": parts}], response_format=schema)
    assert r.status_code == 200
    joined = post(url, messages=[{"role": "user", "content": "Pick one."}], response_format=schema)
    assert r.json()["choices"][0]["message"] == joined.json()["choices"][0]["message"]
    assert r.json()["usage"]["prompt_tokens"] == joined.json()["usage"]["prompt_tokens"]
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    assert_400(post(url, messages=[{"role": "user", "content": image}]), "messages.0.content")
    # content None (an assistant turn that only called tools, in OpenAI's API) is empty text
    r = post(url, messages=[{"role": "user", "content": "Pick one."},
                            {"role": "assistant", "content": None},
                            {"role": "user", "content": "Again."}], response_format=schema)
    assert r.status_code == 200


@pytest.mark.parametrize("name, value, code", [
    ("function_call", {"name": "f"}, "unsupported_parameter"),
    ("min_p", 0.1, "unsupported_parameter"),
    ("reasoning_effort", "low", "unsupported_parameter"),
    ("modalities", ["text", "audio"], "unsupported_parameter"),
    ("tempreature", 0.5, "unknown_parameter"),  # a misspelt parameter is not silently ignored
    ("top_n", 3, "unknown_parameter"),
])
def test_unknown_or_unimplemented_parameters_are_400_naming_them(url, name, value, code):
    err = assert_400(post(url, **{name: value}), name)
    assert err["code"] == code and name in err["message"]


@pytest.mark.parametrize("fields", [{"min_p": 0}, {"function_call": None}, {"user": "u-1"},
                                    {"metadata": {"k": "v"}}, {"modalities": ["text"]},
                                    {"tool_choice": "none"}])
def test_defaults_and_bookkeeping_parameters_are_accepted(url, fields):
    assert post(url, max_tokens=2, **fields).status_code == 200


def test_top_k_is_implemented(url):
    schema = rf({"enum": ["red", "green", "blue", "yellow"]})
    greedy = post(url, response_format=schema).json()["choices"][0]["message"]["content"]
    for seed in range(3):  # top_k 1 keeps the argmax only: sampling at any temperature is greedy
        r = post(url, response_format=schema, temperature=2.0, top_k=1, seed=seed)
        assert r.json()["choices"][0]["message"]["content"] == greedy
    assert post(url, response_format=schema, temperature=1.0, top_k=-1).status_code == 200
    assert_400(post(url, top_k=-2), "top_k")
    assert_400(post(url, top_k="3"), "top_k")


def test_internal_errors_are_counted_in_the_500_metric(served, url, monkeypatch):
    server, _ = served
    key = ("/v1/chat/completions", 500)
    before = server.config.http_responses[key]

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "build_requests", broken)
    r = post(url)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert server.config.http_responses[key] == before + 1
    monkeypatch.undo()
    metrics = httpx.get(f"{url}/metrics").text
    line = 'constrained_spec_http_responses_total{route="/v1/chat/completions",status="500"}'
    assert f"{line} {before + 1}.0" in metrics
    assert_serves_on(url)
