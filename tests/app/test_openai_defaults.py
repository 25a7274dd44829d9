"""Server defaults that keep a good answer (issue: a client moving over from vLLM or
llama.cpp's server): under ``tool_choice`` "required" with OpenAI's default
``parallel_tool_calls`` the calls end at a repeat and come back as ``tool_calls``, never as
call markup in ``content``; a cut call is dropped and said so (``warnings``); greedy free text
at ``max_tokens`` is the same streamed and not, ``finish_reason`` "length"; schema keywords
the grammar does not enforce reach the client as ``warnings``; a ``strict`` refusal names the
HTTP field.

The first tests drive a :class:`Choice` directly on a character "tokenizer" (no model); the
rest serve the embedded model in this process (one server for the module)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai_server_process import serve_in_thread

from constrained_spec.errors import IncompleteOutputError, RepetitionLoopError
from constrained_spec.frontend.tools import DEFAULT_FORMAT, ToolSet
from constrained_spec.schemas import check_schema, normalize_schema
from constrained_spec.server import ServerConfig, create_app
from constrained_spec.server.choices import Choice, response_warnings
from constrained_spec.server.protocol import api_error

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
PARIS, CATS = ("get_weather", {"city": "Paris"}), ("search", {"q": "cats"})
UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                    "uniqueItems": True}}, "required": ["tags"]}


# -- one choice, no model ---------------------------------------------------------------------

def _decode(ids):
    return "".join(map(chr, ids))


def _choice(choice: str = "required", finish_reason: str = "length") -> Choice:
    """A Choice over the tool grammar's parser whose "tokens" are characters."""
    spec = ToolSet([WEATHER, SEARCH], choice, True).spec(DEFAULT_FORMAT)
    request = SimpleNamespace(matcher=None, finish_reason=finish_reason)
    return Choice.of(0, SimpleNamespace(request=request), spec, "default", _decode)  # type: ignore[arg-type]


def _feed(choice: Choice, text: str, step: int = 1) -> None:
    for i in range(0, len(text), step):  # ``step`` characters per commit, one per "token"
        choice.text.feed([ord(ch) for ch in text[i:i + step]])


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_a_repeated_call_stops_the_choice_and_the_calls_before_it_are_the_answer(step):
    choice = _choice()
    text = DEFAULT_FORMAT.write([PARIS, CATS, PARIS, CATS])
    _feed(choice, text, step)
    assert choice.text.stopped  # the server cancels the request here, as at a stop string
    repeat_end = len(DEFAULT_FORMAT.write([PARIS, CATS, PARIS])) - len(DEFAULT_FORMAT.call_end)
    if step == 1:
        assert choice.text.text == text[:repeat_end]  # at the repeat's last character
    out = choice.stopped_outcome(tokens=len(text))
    assert out.finish_reason == "tool_calls" and out.text == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [PARIS, CATS]
    assert [w["type"] for w in out.warnings] == ["tool_call_repeated"]
    assert out.result is None  # an answer: never run again


def test_calls_without_a_repeat_never_stop_the_choice():
    choice = _choice()
    _feed(choice, DEFAULT_FORMAT.write([PARIS, CATS, ("get_weather", {"city": "Rome"})]))
    assert not choice.text.stopped


@pytest.mark.parametrize("error", [IncompleteOutputError, RepetitionLoopError])
def test_a_cut_output_keeps_its_complete_calls_and_no_markup_reaches_content(error):
    choice = _choice()
    whole = DEFAULT_FORMAT.write([PARIS, CATS])
    _feed(choice, whole[:-20])  # inside the second call
    failed = error("cut", partial_text=whole[:-20])
    out = choice.tool_outcome(failed, tokens=40)
    assert out.finish_reason == "length" and out.text == ""  # as OpenAI: the output was cut
    assert [(c.name, c.arguments) for c in out.tool_calls] == [PARIS]
    [note] = out.warnings
    assert note["type"] == "tool_call_dropped" and note["choice"] == 0
    assert ("repetition loop" in note["message"]) == (error is RepetitionLoopError)
    assert out.result is None  # the complete call is an answer: not run again


def test_a_cut_output_without_a_complete_call_has_empty_content_and_is_retryable():
    choice = _choice()
    _feed(choice, DEFAULT_FORMAT.write([PARIS])[:25])
    failed = IncompleteOutputError("cut", partial_text="")
    out = choice.tool_outcome(failed, tokens=25)
    assert out.finish_reason == "length" and out.text == "" and not out.tool_calls
    assert out.result is failed and [w["type"] for w in out.warnings] == ["tool_call_dropped"]
    auto = _choice("auto")
    _feed(auto, "Let me check.\n" + DEFAULT_FORMAT.write([PARIS])[:25])
    out = auto.tool_outcome(failed, tokens=30)
    assert out.text == "Let me check." and "<tool_call>" not in out.text


def test_warnings_name_the_keywords_not_enforced_and_nothing_for_an_enforced_schema():
    choice = SimpleNamespace(spec=normalize_schema(UNIQUE))
    [item] = response_warnings([choice])["warnings"]
    assert item["type"] == "keyword_not_enforced" and item["keyword"] == "uniqueItems"
    assert item["pointer"] == "/properties/tags/uniqueItems"
    enforced = SimpleNamespace(spec=normalize_schema({"type": "object", "properties": {
        "a": {"type": "integer"}}}))
    assert response_warnings([enforced]) == {}  # the response stays exactly OpenAI's


def test_a_strict_refusal_tells_an_http_client_to_send_strict_false():
    with pytest.raises(Exception) as refused:
        check_schema(normalize_schema(UNIQUE), "xgrammar", "strict")
    assert "mode='lenient'" in str(refused.value)  # Python callers keep the Python wording
    message = api_error(refused.value).message
    assert '"strict": false' in message and "mode='lenient'" not in message


def test_json_object_gets_an_instruction_in_words_not_the_schema_pasted():
    from constrained_spec.frontend.prompts import describe_schema

    text = describe_schema(normalize_schema({"type": "object"}))
    assert text is not None and "JSON object" in text and '"type"' not in text
    shaped = describe_schema(normalize_schema(UNIQUE))  # a real schema is still pasted
    assert shaped is not None and '"uniqueItems"' in shaped


# -- the embedded model, served --------------------------------------------------------------

pytest_model = pytest.mark.model


@pytest.fixture(scope="module")
def url(embedded):
    app = create_app(embedded, ServerConfig(model_name="m", max_tokens=256))
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(client, **body) -> tuple[list[tuple[str, dict]], str, str | None, list[Any]]:
    """(calls, content, finish_reason, warnings) of a streamed request, reassembled."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    warnings: list[Any] = []
    for chunk in client.chat.completions.create(model="m", stream=True, **body):
        warnings += (chunk.model_extra or {}).get("warnings") or []
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return got, content, finish, warnings


@pytest_model
def test_required_with_defaults_returns_valid_calls_never_markup_the_same_streamed(client):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    r = client.chat.completions.create(model="m", **body)
    choice = r.choices[0]
    calls = _calls(choice.message)
    assert choice.finish_reason == "tool_calls" and calls and not choice.message.content
    for name, args in calls:
        assert name == "get_weather"
        jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls)  # no repeat
    streamed, content, finish, _ = _streamed(client, **body)  # greedy: the same calls
    assert (streamed, content, finish) == (calls, "", "tool_calls")


@pytest_model
def test_a_call_cut_by_max_tokens_is_dropped_said_so_and_the_complete_ones_kept(client):
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False)
    first_call_tokens = whole.usage.completion_tokens
    body = {"messages": ASK, "tools": [WEATHER, SEARCH], "tool_choice": "required",
            "max_tokens": first_call_tokens + 6}  # room for one call, then a cut
    r = client.chat.completions.create(model="m", **body)
    choice, extra = r.choices[0], r.model_extra or {}
    assert choice.message.tool_calls and not choice.message.content
    if choice.finish_reason == "length":  # the model began another call
        assert [w["type"] for w in extra["warnings"]] == ["tool_call_dropped"]
    body["max_tokens"] = 8  # no call completes: the content is still no markup
    r = client.chat.completions.create(model="m", extra_body={"max_retries": 0}, **body)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
    assert not r.choices[0].message.tool_calls
    assert [w["type"] for w in (r.model_extra or {})["warnings"]] == ["tool_call_dropped"]


@pytest_model
def test_greedy_free_text_at_max_tokens_is_the_same_streamed_and_not(client):
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 24, "temperature": 0}
    r = client.chat.completions.create(model="m", **body)
    _, content, finish, _ = _streamed(client, **body)
    assert r.choices[0].finish_reason == "length" == finish
    assert r.choices[0].message.content == content and r.usage.completion_tokens == 24


@pytest_model
def test_unenforced_keywords_reach_the_client_streamed_and_not(client, url):
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": UNIQUE}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Three tags for a cat."}],
            "response_format": rf, "max_tokens": 60}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    assert [w["keyword"] for w in r["warnings"]] == ["uniqueItems"]
    *_, warnings = _streamed(client, **{k: v for k, v in body.items() if k != "model"})
    assert [w["keyword"] for w in warnings] == ["uniqueItems"]
    completion = {"model": "m", "prompt": "Three tags for a cat:", "response_format": rf,
                  "max_tokens": 60}
    done = httpx.post(f"{url}/v1/completions", json=completion, timeout=600).json()
    assert [w["keyword"] for w in done["warnings"]] == ["uniqueItems"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**completion, "stream": True},
                      timeout=600) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines()
                  if line.startswith("data: {")]
    assert [w["keyword"] for w in chunks[0]["warnings"]] == ["uniqueItems"]
    rf["json_schema"]["strict"] = True
    refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert '"strict": false' in message and "mode=" not in message


@pytest_model
def test_json_object_without_a_system_message_answers_rather_than_echo_the_schema(client):
    # with the schema pasted ({"type": "object"}) the model answered {"type": ...} to both
    for ask in ("What is the capital of France?", "List three fruits."):
        r = client.chat.completions.create(
            model="m", response_format={"type": "json_object"}, max_tokens=80,
            messages=[{"role": "user", "content": ask}])
        answer = json.loads(r.choices[0].message.content)
        assert isinstance(answer, dict) and answer and "type" not in answer
