"""Compatibility: what clients written for vLLM, SGLang and llama.cpp's server send.

The same requests through the official ``openai`` client (chat, completions, tools,
streaming, ``parse``) and raw JSON bodies shaped as vLLM's, SGLang's and llama.cpp's
documentation shows them for structured outputs (json, regex, choice, grammar,
structural_tag; current and older field names). Each must succeed with a result that
satisfies its constraint. ONE server for the module, in this process over the embedded model
of the session (the ``embedded`` fixture), with short outputs.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai_server_process import serve_in_thread
from pydantic import BaseModel

from constrained_spec.server import ServerConfig, create_app

pytestmark = pytest.mark.model

MODEL = "compat"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SQL = ('root ::= select_statement\n'
       'select_statement ::= "SELECT " column " from " table " where " condition\n'
       'column ::= "col_1 " | "col_2 "\ntable ::= "table_1 " | "table_2 "\n'
       'condition ::= column "= " number\nnumber ::= "1 " | "2 "')
EMAIL = r"[a-z]{1,10}@[a-z]{1,10}\.com"
ASK = [{"role": "user", "content": "Ada Lovelace is 36. Give her name and age."}]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def url(embedded):
    config = ServerConfig(model_name=MODEL, max_batch_size=4, max_queue=8, max_tokens=48)
    with serve_in_thread(create_app(embedded, config)) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(url: str, **fields) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": ASK, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def content(body: dict) -> str:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


# vLLM's structured-outputs docs (the current `structured_outputs` object, and the guided_*
# names of v0.6 - v0.10), SGLang's extra body fields, llama.cpp's server's fields
@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"choice": ["positive", "negative"]}},
    {"guided_choice": ["positive", "negative"]},
], ids=["vllm-choice", "vllm-guided_choice"])
def test_choice_bodies(url, fields):
    assert content(chat(url, **fields)) in ("positive", "negative")


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": EMAIL}, "stop": ["\n"]},
    {"guided_regex": EMAIL, "stop": ["\n"]},
    {"regex": EMAIL},
], ids=["vllm-regex", "vllm-guided_regex", "sglang-regex"])
def test_regex_bodies(url, fields):
    assert re.fullmatch(EMAIL, content(chat(url, **fields)))


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"json": PERSON}},
    {"guided_json": PERSON},
    {"json_schema": json.dumps(PERSON)},  # SGLang: JSON text
    {"json_schema": PERSON},  # llama.cpp's server: an object
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}}},
    {"response_format": {"type": "json_object", "schema": PERSON}},  # llama.cpp's server
], ids=["vllm-json", "vllm-guided_json", "sglang-json_schema", "llamacpp-json_schema",
        "openai-json_schema", "llamacpp-json_object-schema"])
def test_json_bodies(url, fields):
    jsonschema.validate(json.loads(content(chat(url, **fields))), PERSON)


def test_json_object_bodies(url):
    for fields in ({"structured_outputs": {"json_object": True}},
                   {"response_format": {"type": "json_object"}}):
        assert isinstance(json.loads(content(chat(url, **fields))), dict)


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"grammar": SQL}},
    {"guided_grammar": SQL},
    {"ebnf": SQL},  # SGLang
    {"grammar": SQL},  # llama.cpp's server (GBNF)
], ids=["vllm-grammar", "vllm-guided_grammar", "sglang-ebnf", "llamacpp-grammar"])
def test_grammar_bodies(url, fields):
    text = content(chat(url, **fields))
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text), text


TAG = {"begin": "<person>", "schema": PERSON, "end": "</person>"}


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "structural_tag", "structures": [TAG], "triggers": ["<person>"]}},
    {"structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "structures": [TAG], "triggers": ["<person>"]})}},
    {"response_format": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<person>", "content": {"type": "json_schema", "json_schema": PERSON},
        "end": "</person>"}}},
], ids=["vllm-response_format-legacy", "vllm-structured_outputs", "xgrammar-format"])
def test_structural_tag_bodies(url, fields):
    body = chat(url, max_tokens=64, **fields)
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), choice
    for segment in re.findall(r"<person>(.*?)</person>", choice["message"]["content"], re.S):
        jsonschema.validate(json.loads(segment), PERSON)  # every tagged segment is valid


def test_openai_client_chat_parse_and_stream(client):
    done = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,
                                         temperature=0)
    assert isinstance(done.choices[0].message.parsed, Person)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    parts = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12,
                                           stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content  # greedy: streamed = not streamed


def test_openai_client_extra_body_constraints(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                       extra_body={"guided_regex": r"\d{2}"})
    assert re.fullmatch(r"\d{2}", r.choices[0].message.content)


def test_openai_client_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, echo=True)
    assert r.choices[0].text.startswith("The capital of France is")
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=4,
                                  extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert r.choices[0].text in (" yes", " no")
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6,
                                         temperature=0, stream=True)
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_openai_client_tools(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=48)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
