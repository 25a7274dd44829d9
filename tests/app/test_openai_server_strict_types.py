"""Loose types and silent ignores, over HTTP on the tiny Llama: a boolean is never taken for a
number (Python's bool is an int) nor a number for a boolean, an option with nothing to apply to
is a 400 naming it, a structural tag's structure needs its schema, ``reasoning: true`` on a
model that does not think is a 400, a tool call's markup is never listed as content in its
logprobs, and a text part without its text says so. Every refusal answers before any
generation, and the server serves on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from openai_server_process import serve_tiny

from constrained_spec.errors import ConfigError
from constrained_spec.frontend.reasoning import ReasoningMarkers, resolve_reasoning

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_reasoning import LOOPING, OPEN, think_loaded  # noqa: E402

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
CHOICE = {"enum": ["a", "b"]}  # a JSON schema the tiny model completes in a few tokens


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL) as (_, url):
        yield url


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": HI, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def complete(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **fields}, timeout=60)


def assert_400(r: httpx.Response, param: str, says: str = "") -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert says in error["message"], error
    return error["message"]


def assert_serves_on(url: str) -> None:
    assert chat(url, max_tokens=2).status_code == 200


# -- 1: token ids ----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, param", [
    ([True, False], "prompt.0"),
    ([5, True], "prompt.1"),
    ([[5, 6], [7, False]], "prompt.1.1"),
])
def test_a_boolean_is_no_token_id_in_a_completions_prompt(url, prompt, param):
    assert_400(complete(url, prompt=prompt, max_tokens=1), param, "not a boolean")
    assert complete(url, prompt=[5, 6], max_tokens=1).status_code == 200


def test_a_boolean_is_no_token_id_to_detokenize(url):
    r = httpx.post(f"{url}/detokenize", json={"tokens": [5, True]}, timeout=60)
    assert_400(r, "tokens.1", "got true")


# -- 2: numbers and booleans -----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("n", True), ("max_tokens", True), ("max_completion_tokens", True), ("seed", False),
    ("top_k", True), ("max_retries", True), ("min_tokens", True),
    ("no_repeat_ngram_size", True), ("max_reasoning_tokens", True),
    ("temperature", True), ("top_p", True), ("repetition_penalty", True),
    ("n", "2"), ("max_tokens", 2.0), ("temperature", "0.5"),  # no strings, no fractions
    ("stream", 1), ("ignore_eos", 1), ("logprobs", 1), ("parallel_tool_calls", "true"),
])
def test_a_chat_field_of_one_type_refuses_another_naming_the_field(url, field, value):
    message = assert_400(chat(url, **{field: value}), field)
    assert f"got {json.dumps(value)}" in message
    assert_serves_on(url)


def test_top_logprobs_refuses_a_boolean(url):
    assert_400(chat(url, logprobs=True, top_logprobs=True), "top_logprobs", "got true")


@pytest.mark.parametrize("field, value", [
    ("logprobs", True), ("n", True), ("max_tokens", False), ("echo", 1),
    ("add_special_tokens", 0),
])
def test_a_completions_field_of_one_type_refuses_another_naming_the_field(url, field, value):
    assert_400(complete(url, prompt="hi", **{field: value}), field)


def test_stream_options_include_usage_must_be_a_boolean(url):
    r = chat(url, stream=True, stream_options={"include_usage": "false"})
    assert_400(r, "stream_options.include_usage", "true or false")


def test_numbers_of_the_right_type_are_taken(url):
    r = chat(url, temperature=0, top_p=1, n=2, seed=3, max_tokens=2, top_k=-1,
             repetition_penalty=1, stream=False, logprobs=False)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# -- 3: options with nothing to apply to -----------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"whitespace_pattern": " ?"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"guided_regex": "[ab]", "guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern"),
])
def test_a_json_option_on_a_request_without_json_is_a_400_naming_it(url, fields, param):
    assert_400(chat(url, **fields), param, "leave it out")
    assert_serves_on(url)


def test_structured_outputs_options_apply_to_a_schema_given_elsewhere(url):
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}}
    assert_400(chat(url, response_format=rf, structured_outputs={"whitespace_pattern": "\n+"}),
               "structured_outputs.whitespace_pattern", "does not allow")
    ok = chat(url, guided_json=CHOICE, guided_whitespace_pattern=" ?", max_tokens=8)
    assert ok.status_code == 200, ok.text
    assert json.loads(ok.json()["choices"][0]["message"]["content"]) in ("a", "b")


# -- 4: a structure without its schema -------------------------------------------------------

def _tag(second: dict) -> dict:
    return {"type": "structural_tag", "triggers": ["<"],
            "structures": [{"begin": "<a>", "schema": CHOICE, "end": "</a>"}, second]}


@pytest.mark.parametrize("second", [{"begin": "<b>", "end": "</b>"},
                                    {"begin": "<b>", "schema": None, "end": "</b>"}])
def test_a_structural_tag_structure_without_a_schema_is_a_400_naming_it(url, second):
    assert_400(chat(url, response_format=_tag(second)), "response_format.structures.1.schema",
               "has no 'schema'")
    r = chat(url, structured_outputs={"structural_tag": json.dumps(_tag(second))})
    assert_400(r, "structured_outputs.structural_tag.structures.1.schema", "has no 'schema'")
    assert_serves_on(url)


# -- 5: reasoning on a model that does not think ---------------------------------------------

@pytest.mark.parametrize("fields", [{"reasoning": True},
                                    {"chat_template_kwargs": {"enable_thinking": True}}])
def test_reasoning_on_a_model_without_reasoning_markers_is_a_400_naming_reasoning(url, fields):
    assert_400(chat(url, **fields), "reasoning", "names no reasoning markers")
    assert chat(url, reasoning=False, max_tokens=2).status_code == 200


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_the_template_option_takes_the_templates_markers_or_refuses():
    assert resolve_reasoning("template", _Tok("[THINK]{{ m }}[/THINK]")) == \
        ReasoningMarkers("[THINK]", "[/THINK]")
    with pytest.raises(ConfigError, match="names no reasoning markers"):
        resolve_reasoning("template", _Tok("{{ m }}"))
    assert resolve_reasoning(True, _Tok("{{ m }}")) == ReasoningMarkers()  # as before


def test_reasoning_true_on_a_reasoning_model_thinks_then_answers():
    with serve_tiny(think_loaded(OPEN, LOOPING), max_tokens=20) as (_, url):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "go"}], "reasoning": True,
            "max_reasoning_tokens": 2})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "ab" and message["content"] == "c"


# -- 6: logprobs of a tool call --------------------------------------------------------------

UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"],
    "additionalProperties": False}}}
CALL = {"tools": [UNIT], "tool_choice": {"type": "function", "function": {"name": "unit"}},
        "parallel_tool_calls": False, "logprobs": True, "max_tokens": 60, "max_retries": 0}


def test_a_tool_calls_markup_is_never_listed_as_content_in_its_logprobs(url):
    r = chat(url, **CALL)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
    assert choice["logprobs"]["content"] == []
    streamed = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": HI, "stream": True, **{**CALL, "max_retries": None}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c for e in events for c in e["choices"]]
    assert any(d["delta"].get("tool_calls") for d in deltas)
    assert all(not (d["logprobs"] or {}).get("content") for d in deltas)


# -- 7: a text part without its text ---------------------------------------------------------

@pytest.mark.parametrize("content, param, says", [
    ([{"type": "text"}], "messages.0.content.0.text", "has no 'text' field"),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": 5}], "messages.0.content.1.text",
     "has 'text' 5"),
])
def test_a_text_part_without_its_text_is_a_400_naming_the_text(url, content, param, says):
    r = chat(url, messages=[{"role": "user", "content": content}])
    assert_400(r, param, says)
    assert_serves_on(url)
