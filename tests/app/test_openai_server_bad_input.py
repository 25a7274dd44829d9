"""Bad input to the server, in this process on the tiny Llama: every mistake is a 400 in
OpenAI's envelope naming the parameter (never a 500), and the server serves on."""

from __future__ import annotations

import httpx
import pytest
from openai_server_process import import_example, serve_in_thread

srv = import_example()

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tiny_loaded):
    config = srv.ServerConfig(model_name=MODEL, max_batch_size=4, max_queue=8, max_tokens=8,
                              enable_metrics=True)
    app = srv.create_app(tiny_loaded, config)
    with serve_in_thread(app) as url:
        yield app.state.server, url


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
