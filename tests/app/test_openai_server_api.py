"""The OpenAI-compatible server as a real process, called with the official ``openai`` client.

ONE server for the module (embedded model, ``--api-key``, ``--enable-metrics``, a small
``--max-request-bytes``); few generations, each with a small ``max_tokens``.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai_server_process import start_server
from pydantic import BaseModel

pytestmark = pytest.mark.model

KEY = "test-key"
MAX_BYTES = 20_000


class Person(BaseModel):
    name: str
    age: int


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    srv = start_server("--api-key", KEY, "--enable-metrics", "--max-request-bytes", str(MAX_BYTES),
                       "--max-batch-size", "4", "--max-queue", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    [m] = client.models.list().data
    return m.id


def assert_envelope(body: dict, *, code: str | None = None) -> dict:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_models_health_and_nothing_but_uvicorn_on_stdout(server, model):
    assert model == "SmolLM2-135M-Instruct"
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok"
    for line in server.stdout().splitlines():  # uvicorn's access log is its only stdout
        assert re.match(r'INFO: +127\.0\.0\.1:\d+ - "(GET|POST) ', line), line


def test_a_request_without_the_api_key_is_401_in_the_envelope(server, model):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    assert_envelope(r.json(), code="invalid_api_key")
    assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1 needs the key


def test_an_oversized_body_is_413_in_the_envelope(server, client, model):
    big = "x" * (MAX_BYTES + 1000)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": big}])
    assert info.value.status_code == 413
    assert_envelope(info.value.response.json(), code="request_too_large")
    # a chunked body (no Content-Length) is counted as it is read
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": big}]}).encode()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=iter([body[:5000], body[5000:]]),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    assert_envelope(r.json(), code="request_too_large")


def test_a_bad_schema_is_400_naming_the_keyword_and_its_location(client, model):
    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Ada, 36"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    err = assert_envelope(info.value.response.json(), code="invalid_schema")
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "response_format.json_schema.schema"
    assert "'type'" in err["message"] and "/properties/age/type" in err["message"]


def test_bad_options_and_unknown_models_are_refused_in_the_envelope(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       temperature=3)
    assert assert_envelope(info.value.response.json())["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert_envelope(info.value.response.json(), code="model_not_found")


def test_a_pydantic_model_through_parse(client, model):
    completion = client.beta.chat.completions.parse(
        model=model, response_format=Person, max_tokens=40,
        messages=[{"role": "user", "content": "Ada Lovelace is 36 years old. Extract the person."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)
    usage = completion.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 40
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_repeated_schema_prompt_is_read_from_the_prefix_cache_with_the_same_answer(client, model):
    messages = [{"role": "user", "content": "Lyon is a city in France. Extract the city."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    first, second = (client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                                    temperature=0, response_format=fmt) for _ in range(2))
    assert second.choices[0].message.content == first.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the schema's system message and the question: every whole 16-token block of the prompt
    assert cached >= (second.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_streaming_json_schema_with_the_openai_client(client, model):
    stream = client.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, max_tokens=40,
        messages=[{"role": "user", "content": "Paris is the capital of France."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # incremental
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    jsonschema.validate(json.loads(text), CITY)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_raw_sse_with_json_object_n_and_seed_ends_with_done(server, model):
    body = {"model": model, "stream": True, "n": 2, "seed": 7, "temperature": 0.7, "max_tokens": 40,
            "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": "Give name and age of Ada Lovelace, 36, as JSON."}]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    texts, finish = {0: "", 1: ""}, {}
    for e in events[:-1]:
        for ch in json.loads(e[len("data: "):])["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert set(finish) == {0, 1}
    for i in (0, 1):
        if finish[i] == "stop":  # json_object: any JSON object
            assert isinstance(json.loads(texts[i]), dict)
        else:
            assert finish[i] == "length"


def test_free_text_length_then_stop_string_cuts_the_text(client, model):
    messages = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
    text = first.choices[0].message.content
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12
    stop = text[len(text) // 2: len(text) // 2 + 3]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=12, stop=[stop])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == text[: text.find(stop)]


def test_an_incomplete_schema_output_is_finish_reason_length(client, model):
    messages = [{"role": "user", "content": "Ada Lovelace is 36 years old."}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": Person.model_json_schema()}})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")  # the partial text
    with pytest.raises(openai.LengthFinishReasonError):
        client.beta.chat.completions.parse(model=model, messages=messages, max_tokens=4,
                                           response_format=Person)


def test_prometheus_metrics(server):
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("constrained_spec_requests_total{finish_reason=\"stop\"}",
                 "constrained_spec_requests_total{finish_reason=\"length\"}",
                 "constrained_spec_generation_tokens_total", "constrained_spec_generation_tokens_per_second",
                 "constrained_spec_acceptance_length", "constrained_spec_acceptance_rate_by_position{position=\"1\"}",
                 "constrained_spec_queue_depth", "constrained_spec_running_requests",
                 "constrained_spec_http_responses_total{route=\"/v1/chat/completions\",status=\"413\"}",
                 "constrained_spec_request_latency_seconds_bucket"):
        assert name in text, name
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["constrained_spec_acceptance_length"]) > 1.0  # speculation is on
