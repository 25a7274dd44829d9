"""The chat template's time and size bounds over HTTP (in this process, on the tiny Llama): a
request whose ``chat_template_kwargs`` drive the model's template into a loop that would run for
hours, or into a text of terabytes, is a 400 naming what to change, and the client's keep-alive
connection serves on (`constrained_spec.frontend.render`)."""

from __future__ import annotations

import httpx
import pytest
from cs_testlib import byte_level_bpe, tiny_loaded_model
from openai_server_process import serve_tiny

from constrained_spec.frontend import render

MODEL = "tiny"
USER = {"role": "user", "content": "hi"}
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    # 10^15 steps that write nothing, and 10^10 copies of pad, as the request's variables say
    "{% for i in range(spin or 0) %}{% for j in range(spin) %}{% for k in range(spin) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
    "{% for i in range(grow or 0) %}{% for j in range(grow) %}{{ pad }}{% endfor %}{% endfor %}"
    # and a message that drives a loop itself (what /tokenize, which takes no variables, renders)
    "{% if messages[0].content == 'spin' %}{% for i in range(10**5) %}{% for j in range(10**5) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[0].content == 'refuse' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def url():
    tok = byte_level_bpe()
    tok.chat_template = TEMPLATE
    with serve_tiny(tiny_loaded_model(tok=tok), MODEL) as (_, url):
        yield url


def post(client: httpx.Client, url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [USER], "max_tokens": 2, **fields}
    return client.post(f"{url}/v1/chat/completions", json=body)


def client_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def error_of(r: httpx.Response, code: str, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), err
    return err["message"]


def refused_between_two_served(url: str, fields: dict, code: str, param: str) -> str:
    """The 400's message for ``fields``, sent between two plain requests that are served on
    the same keep-alive connection."""
    with httpx.Client(timeout=120) as client:
        first = post(client, url)
        assert first.status_code == 200, first.text
        message = error_of(post(client, url, **fields), code, param)
        after = post(client, url)
        assert after.status_code == 200, after.text
        assert client_port(first) == client_port(after)  # one connection throughout
    return message


def test_a_template_loop_driven_by_chat_template_kwargs_is_a_400_and_the_connection_serves_on(
        url, monkeypatch):
    monkeypatch.setattr(render, "RENDER_TIMEOUT_S", 0.3)  # the server renders in this process
    message = refused_between_two_served(url, {"chat_template_kwargs": {"spin": 100_000}},
                                         "invalid_value", "chat_template_kwargs")
    assert "took longer than 0.3 s to render" in message and "chat_template_kwargs" in message


def test_a_template_writing_terabytes_is_a_400_context_length_exceeded_and_serves_on(
        url, monkeypatch):
    monkeypatch.setattr(render, "RENDER_TIMEOUT_S", 600)  # the size bound alone stops it
    message = refused_between_two_served(
        url, {"chat_template_kwargs": {"grow": 100_000, "pad": "x" * 1000}},
        "context_length_exceeded", "messages")
    assert "the chat template rendered more than" in message and "tokens" in message


def test_tokenize_renders_within_the_same_bound_and_serves_on(url, monkeypatch):
    monkeypatch.setattr(render, "RENDER_TIMEOUT_S", 0.3)
    with httpx.Client(timeout=120) as client:
        spin = {"model": MODEL, "messages": [{"role": "user", "content": "spin"}]}
        message = error_of(client.post(f"{url}/tokenize", json=spin), "invalid_value", "messages")
        assert "took longer than 0.3 s to render" in message
        ok = client.post(f"{url}/tokenize", json={"model": MODEL, "messages": [USER]})
        assert ok.status_code == 200 and ok.json()["count"] > 0, ok.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_template_that_refuses_the_messages_is_a_400_naming_them(url, route):
    with httpx.Client(timeout=120) as client:
        bad = {"model": MODEL, "messages": [{"role": "user", "content": "refuse"}],
               **({"max_tokens": 2} if route != "/tokenize" else {})}
        message = error_of(client.post(f"{url}{route}", json=bad), "invalid_value", "messages")
        assert "roles must alternate" in message
        assert client.post(f"{url}{route}", json={**bad, "messages": [USER]}).status_code == 200
