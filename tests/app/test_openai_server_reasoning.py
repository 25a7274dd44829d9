"""A reasoning model through the OpenAI-compatible server, with the official ``openai`` client:
the thinking comes back apart as ``reasoning_content`` (whole, and streamed as its own
deltas before the answer's), the answer as ``content``, ``max_reasoning_tokens`` bounds the
thinking, and ``reasoning_effort`` is a 400 that says what to use instead. The model: a bigram
Llama over a byte-level BPE with ``<think>`` / ``</think>`` tokens whose chat template opens
the block; it thinks "abab..." until its budget forces the end marker, then answers "c"."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_server_process import serve_tiny  # noqa: E402
from test_reasoning import LOOPING, OPEN, think_loaded  # noqa: E402

ASK = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def served():
    with serve_tiny(think_loaded(OPEN, LOOPING), max_tokens=40) as (server, url):
        yield server, url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="none", max_retries=0, timeout=120)


def test_reasoning_content_and_the_answer_come_back_apart(client):
    done = client.chat.completions.create(model="tiny", messages=ASK,
                                          extra_body={"max_reasoning_tokens": 6})
    message = done.choices[0].message
    assert message.reasoning_content == "ababab"
    assert message.content == "c" and done.choices[0].finish_reason == "stop"


def test_streamed_reasoning_deltas_come_first_and_reassemble_to_the_same_texts(client):
    kinds, thought, answer = [], "", ""
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, stream=True,
                                                extra_body={"max_reasoning_tokens": 6}):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        part = getattr(delta, "reasoning_content", None)
        if part:
            kinds.append("reasoning")
            thought += part
        if delta.content:
            kinds.append("content")
            answer += delta.content
    assert thought == "ababab" and answer == "c"
    assert "think>" not in thought + answer  # neither marker leaks into a delta
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # no thinking after the answer


def test_without_a_budget_a_looping_thought_ends_at_max_tokens_with_only_the_answer_as_content(
        client):
    done = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12,
                                          extra_body={"max_retries": 0})
    choice = done.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.reasoning_content.startswith("abab") and choice.message.content == ""


@pytest.mark.parametrize("fields, param, says", [
    ({"reasoning_effort": "low"}, "reasoning_effort", "max_reasoning_tokens"),
    ({"max_reasoning_tokens": -1}, "max_reasoning_tokens", ""),
    ({"max_reasoning_tokens": "4"}, "max_reasoning_tokens", ""),
])
def test_bad_reasoning_fields_are_400_naming_the_field(served, fields, param, says):
    body = {"model": "tiny", "messages": ASK, **fields}
    r = httpx.post(f"{served[1]}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]
