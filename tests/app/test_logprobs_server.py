"""logprobs over HTTP: OpenAI's chat shape (``logprobs`` + ``top_logprobs``) and the legacy
completions shape (``logprobs: k``), streamed and not, the same values as the library's."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from openai_server_process import serve_tiny

from constrained_spec import Generator, Regex

MODEL = "tiny"
REGEX = {"structured_outputs": {"regex": "[a-z]{4} [0-9]{3}"}}


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL, max_tokens=12) as (_, url):
        yield url


def _chat(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("constraint", [{}, REGEX], ids=["free", "regex"])
def test_chat_logprobs_cover_the_content_token_by_token_streamed_and_not(url, constraint):
    fields = {"logprobs": True, "top_logprobs": 3, **constraint}
    choice = _chat(url, **fields).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    content = choice["message"]["content"]
    assert entries and bytes(b for e in entries for b in e["bytes"]).decode("utf-8", "replace").startswith(content)
    for e in entries:
        assert e["logprob"] <= 0 and 1 <= len(e["top_logprobs"]) <= 3
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6  # the most likely first
        assert sum(math.exp(t["logprob"]) for t in e["top_logprobs"]) <= 1 + 1e-5
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    streamed = [e for c in _events(url, "/v1/chat/completions", body) for ch in c["choices"]
                if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert streamed == entries


def test_chat_logprobs_are_the_librarys_masked_values(url, tiny_loaded):
    choice = _chat(url, logprobs=True, **REGEX).json()["choices"][0]
    gen = Generator(tiny_loaded, schema=Regex("[a-z]{4} [0-9]{3}"), max_tokens=12)
    res = gen([{"role": "user", "content": "hi"}], return_result=True, logprobs=0)
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        [e.logprob for e in res.logprobs], abs=1e-5)
    raw = _chat(url, logprobs=True, logprobs_mode="raw", **REGEX).json()["choices"][0]
    assert all(r["logprob"] <= m["logprob"] + 1e-6 for r, m in
               zip(raw["logprobs"]["content"], choice["logprobs"]["content"]))


def test_completions_logprobs_in_the_legacy_shape_with_text_offsets(url):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 6, "logprobs": 2, "echo": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    assert lp["text_offset"][0] == len("Once")  # after the echoed prompt
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][off:off + len(tok)] == tok or "\ufffd" in tok
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"])
    streamed = [ch["logprobs"] for c in _events(url, "/v1/completions", body)
                for ch in c["choices"] if ch.get("logprobs")]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "logprobs_mode": "processed"}, "logprobs_mode"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_logprobs_fields_are_a_400_naming_the_field(url, fields, param):
    r = _chat(url, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
