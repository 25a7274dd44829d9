"""The server's constraint forms, ``/v1/completions``, ``/tokenize`` / ``/detokenize``,
``/v1/models/{id}``, ``/version``, ``min_tokens`` / ``ignore_eos`` and the reasoning switch, in
this process on the tiny Llama (its text is random; what these tests check is what the
grammar, the fields and the routes guarantee)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from openai_server_process import serve_tiny

from constrained_spec.config import SamplingParams
from constrained_spec.generation.engine import Request, mask_stop_tokens
from constrained_spec.schemas import Grammar, Regex, StructuralTag
from constrained_spec.server.protocol import APIError, CompletionRequest, parse_body
from constrained_spec.server.structured import closed_objects, constraint_of

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TAG_LEGACY = {"type": "structural_tag", "triggers": ["<a>"],
              "structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}]}


@pytest.fixture(scope="module")
def url(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL, max_tokens=8) as (_, url):
        yield url


def post(url: str, path: str = "/v1/chat/completions", **fields) -> httpx.Response:
    body = {**CHAT, **fields} if path == "/v1/chat/completions" else fields
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def constraint(**fields):
    return constraint_of(parse_body(json.dumps({**CHAT, **fields}).encode()), "xgrammar")


@pytest.mark.parametrize("fields, kind, param", [
    ({"structured_outputs": {"regex": "a+"}}, Regex, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, list, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, Grammar, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "object"}}}, dict, "structured_outputs.json"),
    ({"structured_outputs": {"json": '{"type": "object"}'}}, dict, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, dict, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG_LEGACY)}}, StructuralTag,
     "structured_outputs.structural_tag"),
    ({"response_format": TAG_LEGACY}, StructuralTag, "response_format"),
    ({"guided_json": {"type": "object"}}, dict, "guided_json"),
    ({"guided_regex": "a+"}, Regex, "guided_regex"),
    ({"guided_choice": ["x", "y"]}, list, "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, Grammar, "guided_grammar"),
    ({"regex": "a+"}, Regex, "regex"),  # SGLang's
    ({"ebnf": 'root ::= "x"'}, Grammar, "ebnf"),  # SGLang's
    ({"json_schema": '{"type": "object"}'}, dict, "json_schema"),  # SGLang's: JSON text
    ({"json_schema": {"type": "object"}}, dict, "json_schema"),  # llama.cpp's: an object
    ({"grammar": 'root ::= "x"'}, Grammar, "grammar"),  # llama.cpp's
    ({"response_format": {"type": "json_object", "schema": {"type": "array"}}}, dict,
     "response_format.schema"),  # llama.cpp's json_object with a schema
])
def test_every_constraint_form_becomes_one_library_kind_named_by_its_field(fields, kind, param):
    c = constraint(**fields)
    assert isinstance(c.schema, kind) and c.param == param


def test_two_constraints_in_one_request_are_a_400_naming_both():
    for fields in ({"guided_regex": "a", "structured_outputs": {"choice": ["a"]}},
                   {"response_format": {"type": "json_object"}, "regex": "a"},
                   {"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}):
        with pytest.raises(APIError) as info:
            constraint(**fields)
        assert info.value.status == 400 and " and " in info.value.message
        names = [n for n in ("guided_regex", "structured_outputs", "response_format", "regex",
                             "grammar") if n in info.value.message]
        assert len(names) >= 2, info.value.message


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"guided_decoding_backend": "lm-format-enforcer", "guided_regex": "a"},
     "guided_decoding_backend"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "[\n]*"}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(url, fields, param):
    r = post(url, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_disable_additional_properties_closes_object_schemas_and_only_those():
    schema = {"type": "object", "properties": {"properties": {"type": "object"},
                                               "open": {"type": "object", "additionalProperties": True},
                                               "n": {"type": "integer"}},
              "$defs": {"d": {"properties": {"x": {"type": "string"}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property name, not a keyword
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]["n"]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is unchanged
    c = constraint(structured_outputs={"json": schema, "disable_additional_properties": True})
    assert c.schema == closed


@pytest.mark.parametrize("fields, pattern", [
    ({"structured_outputs": {"regex": "[ab]{3}"}}, "[ab]{3}"),
    ({"guided_choice": ["yes", "no"]}, "yes|no"),
    ({"ebnf": 'root ::= "x" | "y"'}, "x|y"),
])
def test_regex_choice_and_grammar_outputs_match_in_chat_and_completions(url, fields, pattern):
    chat = post(url, **fields)
    assert chat.status_code == 200, chat.text
    assert re.fullmatch(pattern, chat.json()["choices"][0]["message"]["content"])
    done = post(url, "/v1/completions", model=MODEL, prompt="Say:", **fields)
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["object"] == "text_completion"
    assert re.fullmatch(pattern, body["choices"][0]["text"])


def test_completions_take_every_prompt_form_and_index_choices_prompt_major(url):
    r = post(url, "/v1/completions", model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=2,
             guided_choice=["p", "q"])
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "ab"}).json()["tokens"]
    for prompt in (ids, [ids, ids]):
        r = post(url, "/v1/completions", model=MODEL, prompt=prompt, max_tokens=2)
        assert r.status_code == 200, r.text
    r = post(url, "/v1/completions", model=MODEL, prompt=[10 ** 9], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.0"


def test_echo_puts_the_prompt_before_the_text_streamed_and_not(url):
    fields = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "echo": True, "temperature": 0}
    whole = post(url, "/v1/completions", **fields).json()
    text = whole["choices"][0]["text"]
    assert text.startswith("Once")
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={**fields, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == text  # greedy: the same
    assert chunks[-1]["usage"] == whole["usage"]


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(url):
    t = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello world",
                                            "return_token_strs": True}).json()
    assert set(t) == {"count", "max_model_len", "tokens", "token_strs"}
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT["messages"]}).json()
    assert chat["count"] == len(chat["tokens"]) > 0
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.0"
    both = httpx.post(f"{url}/tokenize", json={"prompt": "a", "messages": CHAT["messages"]})
    assert both.status_code == 400


@pytest.mark.parametrize("body,param", [
    ('{"messages": []}', "messages"),  # no user message: what the chat route says too
    ('{"messages": [{"role": "system", "content": "x"}]}', "messages"),
    ('{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages"),  # lone surrogate
    ('{"prompt": "a \\ud800 b"}', "prompt"),
])
def test_tokenize_answers_a_clients_mistake_400_on_a_connection_that_serves_on(url, body, param):
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/tokenize", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 200


def test_models_by_id_and_version(url):
    assert httpx.get(f"{url}/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(f"{url}/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert isinstance(httpx.get(f"{url}/version").json()["version"], str)


def _rows(eos_allowed_only: bool) -> torch.Tensor:
    logits = torch.zeros(3, 5)
    if eos_allowed_only:
        logits[2, 1:] = float("-inf")  # the grammar allows the stop token (id 0) alone here
    return logits


def test_min_tokens_masks_the_stop_token_where_held_but_the_grammar_wins():
    req = Request([1], None, SamplingParams(min_tokens=3), (0,))
    req.output_ids = [4]  # rows are output positions 1, 2, 3
    logits = _rows(eos_allowed_only=False)
    mask_stop_tokens(logits, [req], [3])
    assert torch.isinf(logits[:2, 0]).all() and logits[2, 0] == 0  # held at 1 and 2, not at 3
    logits = _rows(eos_allowed_only=True)
    req.params = SamplingParams(ignore_eos=True)
    mask_stop_tokens(logits, [req], [3])
    assert torch.isinf(logits[:2, 0]).all()
    assert logits[2, 0] == 0  # only the stop token is allowed: it stays


def test_ignore_eos_runs_to_max_tokens_and_a_grammar_still_ends_the_output(url):
    # this regex lets the tiny model stop after a few tokens; ignore_eos holds the stop
    held = post(url, max_tokens=6, ignore_eos=True, guided_regex="[a-z ]+", max_retries=0).json()
    assert held["choices"][0]["finish_reason"] == "length"
    assert held["usage"]["completion_tokens"] == 6
    ended = post(url, max_tokens=6, min_tokens=5, guided_choice=["a", "b"]).json()
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["choices"][0]["message"]["content"] in ("a", "b")


def test_reasoning_switches_are_checked(url):
    assert post(url, chat_template_kwargs={"foo": 1}).status_code == 200  # passed to the template
    r = post(url, chat_template_kwargs={"add_generation_prompt": False})  # the library's own
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    for name, value in [("chat_template", "INJECTED {{ messages[0].content }}"),  # not variables
                        ("tokenizer_kwargs", {}), ("truncation", True), ("max_length", 3),
                        ("padding", True), ("return_tensors", "pt"), ("conversation", []),
                        ("return_assistant_tokens_mask", True), ("sanitize_control_tokens", True)]:
        r = post(url, chat_template_kwargs={name: value})
        assert r.status_code == 400, name
        assert r.json()["error"]["param"] == "chat_template_kwargs" and name in r.json()["error"]["message"]
    r = post(url, chat_template_kwargs={"enable_thinking": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    r = post(url, chat_template_kwargs={"enable_thinking": True}, reasoning=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"
    assert post(url, chat_template_kwargs={"enable_thinking": False}).status_code == 200


def test_a_completions_prompt_form_error_names_prompt():
    with pytest.raises(APIError) as info:
        parse_body(b'{"model": "m", "prompt": [["a"]]}', CompletionRequest)
    assert info.value.param.startswith("prompt")


def test_min_tokens_and_ignore_eos_hold_the_stop_and_keep_greedy_speculation_identical(tiny_loaded):
    from constrained_spec import Generator

    # under this regex the tiny model stops after 2 tokens by itself (the stop is allowed
    # after any letter): min_tokens holds it to 7, ignore_eos to max_tokens
    runs = []
    for speculative in (None, False):
        gen = Generator(tiny_loaded, schema=Regex("[a-z ]+"), speculative=speculative,
                        max_tokens=12, max_retries=0)
        runs.append([gen.batch(["hi"], return_result=True, **options)[0].token_ids
                     for options in ({}, {"min_tokens": 7}, {"ignore_eos": True})])
    assert runs[0] == runs[1]  # greedy: the same tokens with and without speculation
    plain, held, ignored = (len(ids) for ids in runs[0])
    assert plain < 7 <= held and ignored == 12
