"""The OpenAI server's output-quality parameters, in this process on a model that loops.

A bigram Llama (``cs_testlib.bigram_llama``) writes ``{"a": "abab...`` until ``max_tokens``
runs out under greedy decoding. The vLLM-style extra parameters ``repetition_penalty`` and
``no_repeat_ngram_size`` break the loop, retries (on by default, ``max_retries`` to change
them) return a valid retry (never with ``stream``, where an explicit count is refused); bad
values are 400s naming the parameter, with the library's limits; OpenAI's
additive penalties stay refused, pointing to ``repetition_penalty``.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from cs_testlib import bigram_loaded
from openai_server_process import serve_tiny

from constrained_spec.server import MAX_RETRIES

MODEL = "loop"
# inside the string a -> b (5) -> a (5) -> ...; after a, c comes second (4) and the closing
# quote third (3); after c the quote (5). Greedy never closes the string.
# The space before the value's quote prefers the quote (else a penalty on the quote, once
# written, would favour the byte-level token '":' there).
LOOP_EDGES = {("Ġ", '"'): 5.0, ('"', "a"): 5.0, ("a", "b"): 5.0, ("b", "a"): 5.0,
              ("a", "c"): 4.0, ("a", '"'): 3.0, ("b", '"'): 3.0, ("c", '"'): 5.0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
          "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def looping():
    return bigram_loaded(LOOP_EDGES)


@pytest.fixture(scope="module")
def served(looping):
    with serve_tiny(looping, MODEL, max_queue=16, max_tokens=40, enable_metrics=False) as served:
        yield served


@pytest.fixture
def url(served):
    server, url = served
    yield url
    end = time.monotonic() + 30
    while server.loop.running or server.loop.waiting:
        assert time.monotonic() < end, "requests still running"
        time.sleep(0.01)
    assert server.loop.slots_in_use == 0  # retries and refusals leak no KV-cache slot


def complete(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "response_format": RESPONSE_FORMAT, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def choice(r: httpx.Response) -> tuple[str, str]:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["message"]["content"], c["finish_reason"]


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_without_retries_or_a_lever_the_loop_runs_out_of_max_tokens(url):
    text, finish = choice(complete(url, max_retries=0))
    assert finish == "length" and text.startswith('{"a": "ababab')


def test_retries_are_on_by_default_and_off_for_a_streamed_request(served, url):
    server, _ = served
    before = server.retries
    text, finish = choice(complete(url))
    assert finish == "stop" and set(json.loads(text)) == {"a"}
    assert server.retries > before  # the greedy attempt looped: retried
    before = server.retries
    r = complete(url, stream=True)
    assert r.status_code == 200, r.text
    assert '"finish_reason":"length"' in r.text and server.retries == before


@pytest.mark.parametrize("lever, value", [
    ({"no_repeat_ngram_size": 3}, "abab"),  # a third "aba" is banned: the quote comes next
    ({"repetition_penalty": 2.0}, "abac"),  # b, once written, falls below c
    ({"repetition_penalty": 2}, "abac"),  # an integer is a number, as in JSON
])
def test_the_repetition_guard_parameters_break_the_loop(url, lever, value):
    assert choice(complete(url, **lever)) == (json.dumps({"a": value}), "stop")


def test_the_guard_streams_and_reaches_the_server_through_the_openai_clients_extra_body(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format=RESPONSE_FORMAT,
                                       extra_body={"no_repeat_ngram_size": 3})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ('{"a": "abab"}', "stop")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                            response_format=RESPONSE_FORMAT, stream=True,
                                            extra_body={"repetition_penalty": 2.0})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == '{"a": "abac"}'


def test_max_retries_returns_a_valid_retry_and_usage_counts_that_attempt(url):
    r = complete(url, max_retries=2, n=2, seed=3)
    assert r.status_code == 200, r.text
    data = r.json()
    for c in data["choices"]:
        assert c["finish_reason"] == "stop"
        assert set(json.loads(c["message"]["content"])) == {"a"}
    assert data["usage"]["completion_tokens"] <= 2 * 40
    # near-greedy retries loop as the first attempt does: the last attempt is returned
    text, finish = choice(complete(url, max_retries=1, temperature=0.01))
    assert finish == "length" and "ababab" in text


def test_max_retries_with_stream_is_refused_naming_the_parameter(url):
    err = error(complete(url, max_retries=1, stream=True))
    assert err["param"] == "max_retries" and "stream" in err["message"]
    assert choice(complete(url, max_retries=0, stream=False))[1] == "length"  # 0: off


@pytest.mark.parametrize("extra, param, reason", [
    ({"repetition_penalty": 0.5}, "repetition_penalty", "must be a number in [1, 10]"),
    ({"repetition_penalty": 11}, "repetition_penalty", "must be a number in [1, 10]"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty", "valid number"),
    ({"repetition_penalty": True}, "repetition_penalty", "valid number"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size", "must be an integer in 0..64"),
    ({"no_repeat_ngram_size": 65}, "no_repeat_ngram_size", "must be an integer in 0..64"),
    ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size", "valid integer"),
    ({"max_retries": -1}, "max_retries", "greater than or equal to 0"),
    ({"max_retries": MAX_RETRIES + 1}, "max_retries", f"less than or equal to {MAX_RETRIES}"),
    ({"max_retries": "2"}, "max_retries", "valid integer"),
])
def test_bad_values_are_400_naming_the_parameter_and_the_limit(url, extra, param, reason):
    err = error(complete(url, **extra))
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{param}: ") and reason in err["message"]


def test_a_nan_penalty_is_refused(url):
    body = ('{"model": "loop", "messages": [{"role": "user", "content": "x"}], '
            '"repetition_penalty": NaN}')  # Python's json reads NaN
    r = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert error(r)["param"] == "repetition_penalty"


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_openais_additive_penalties_stay_refused_and_point_to_repetition_penalty(url, name):
    err = error(complete(url, **{name: 0.5}))
    assert err["param"] == name and err["code"] == "unsupported_parameter"
    assert "use repetition_penalty" in err["message"]
    # a client's default 0 is accepted, and changes nothing: the single attempt still loops
    assert choice(complete(url, **{name: 0}, max_retries=0))[1] == "length"
