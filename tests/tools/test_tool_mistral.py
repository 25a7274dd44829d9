"""Mistral's tool calls on a tokenizer that has ``[TOOL_CALLS]`` (and ``[ARGS]``) as special
tokens, with Mistral-shaped chat templates of both kinds: the JSON list of tokenizers v2 to v7
(``[TOOL_CALLS] [{"name": ..., "arguments": ...}]``) and the v11+ ``[TOOL_CALLS]NAME[ARGS]{...}``.
The marker is one token id in the grammar and in every output, never its spelling; every
finished output parses and validates; auto allows text; greedy output is the same with and
without speculation; streamed deltas of the decoded tokens reassemble to the calls; calls and
results in the history go through the template, their ids (a client's ``call_...`` too) as
Mistral's 9 letters and digits, through the library and the server."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Literal

import httpx
import pytest
from cs_testlib import (
    bigram_loaded,
    byte_level_bpe,
    greedy_tool_texts,
    sampled_tool_values,
    tiny_loaded_model,
)
from pydantic import BaseModel

from constrained_spec import generate
from constrained_spec.api import Generator
from constrained_spec.errors import IncompleteOutputError
from constrained_spec.frontend.prompts import encode_prompt
from constrained_spec.frontend.tools import StreamingToolParser, ToolCall, ToolSet, detect_format
from constrained_spec.grammar import TokenizerData, compile_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
from openai_server_process import serve_tiny  # noqa: E402

MAX = 300  # the byte-level tokenizer writes most characters as one token each

# Shaped like Mistral 7B v0.3's template (tokenizer v3): tools before the last user turn, the
# calls as one JSON list after "[TOOL_CALLS] [", ids of exactly 9 characters, results as JSON.
V3_TEMPLATE = """
{%- if tools is not defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS] " + tools|tojson + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.id is not defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] + ', "id": "' + tool_call.id + '"}' }}
            {{- ", " if not loop.last else "]" + eos_token }}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {%- if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message["content"]|tojson + ', "call_id": "'
            + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

# Shaped like the templates of Mistral's tokenizers v11+: each call "[TOOL_CALLS]NAME[ARGS]ARGS".
V11_TEMPLATE = """
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {%- if tools and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS]" + tools|tojson + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST]" + message["content"] + "[/INST]" }}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] or "" }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set arguments = tool_call.function.arguments %}
            {%- if arguments is not string %}{%- set arguments = arguments|tojson %}{%- endif %}
            {{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" + arguments }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message["role"] == "tool" %}
        {{- "[TOOL_RESULTS]" + message["content"] + "[/TOOL_RESULTS]" }}
    {%- endif %}
{%- endfor %}
"""

MARKERS = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
           "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
KINDS = {"v3": V3_TEMPLATE, "v11": V11_TEMPLATE}


def get_weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"] = "C") -> str:
    """Get the weather of a city."""
    return f"{city}/{unit}"


class Search(BaseModel):
    """Search the web."""

    topic: Literal["cats", "dogs"]


TOOLS = [get_weather, Search]
ROME = ("get_weather", {"city": "Rome", "unit": "C"})
CATS = ("Search", {"topic": "cats"})


def mistral_tok(template: str, special: bool = True):
    """The byte-level test tokenizer with Mistral's control tokens as special tokens (or, with
    ``special=False``, without them: the markers are then text) and ``template``."""
    tok = byte_level_bpe()
    if special:
        tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=list(KINDS))
def loaded(request):
    """A tiny random Llama over the Mistral test tokenizer, one per template kind."""
    return tiny_loaded_model(seed=1, tok=mistral_tok(KINDS[request.param]))


def _calls(value):
    return value if isinstance(value, list) else [value]


def _tool_calls_id(tok) -> int:
    return tok.convert_tokens_to_ids("[TOOL_CALLS]")


# -- the format -------------------------------------------------------------------------------

def test_the_mistral_format_and_its_special_tokens_come_from_the_template_and_tokenizer():
    v3, v11 = mistral_tok(V3_TEMPLATE), mistral_tok(V11_TEMPLATE)
    fmt = detect_format(v3)
    assert fmt.name == "mistral" and not fmt.default
    assert fmt.list_begin == "[TOOL_CALLS] ["  # the template's space after the marker
    assert dict(fmt.tokens) == {"[TOOL_CALLS]": _tool_calls_id(v3)}
    fmt = detect_format(v11)
    assert fmt.name == "mistral_v11"
    assert dict(fmt.tokens) == {"[TOOL_CALLS]": _tool_calls_id(v11),
                                "[ARGS]": v11.convert_tokens_to_ids("[ARGS]")}
    # a tokenizer without the control tokens: the same format, its markers spelled in text
    spelled = detect_format(mistral_tok(V3_TEMPLATE, special=False))
    assert spelled.name == "mistral" and spelled.tokens == ()
    no_space = V3_TEMPLATE.replace('"[TOOL_CALLS] ["', '"[TOOL_CALLS]["')
    assert detect_format(mistral_tok(no_space)).list_begin == "[TOOL_CALLS]["


# -- the grammar, on token ids ------------------------------------------------------------------

def _accepts(tok, toolset: ToolSet, ids: list[int]) -> bool:
    fmt = detect_format(tok)
    compiled = compile_spec(toolset.spec(fmt), TokenizerData.from_hf(tok, vocab_size=len(tok) + 2))
    matcher = compiled.new_matcher()
    return all(matcher.accept(i) for i in [*ids, tok.eos_token_id]) and matcher.is_terminated()


def _spelled(tok, text: str) -> list[int]:
    """``text`` in tokens with every Mistral marker spelled in ordinary byte tokens."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, MARKERS)) + ")", text):
        for piece in [part[:2], part[2:]] if part in MARKERS else [part]:
            if piece:
                ids += tok.encode(piece, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_call_marker_is_its_one_special_token_and_never_its_spelling(kind):
    tok = mistral_tok(KINDS[kind])
    fmt = detect_format(tok)
    for choice, parallel in [("required", False), ("auto", True), ("Search", False)]:
        toolset = ToolSet(TOOLS, choice, parallel)
        ids = tok.encode(fmt.write([CATS]), add_special_tokens=False)
        assert ids[0] == _tool_calls_id(tok) and ids.count(_tool_calls_id(tok)) == 1
        assert _accepts(tok, toolset, ids), choice
        spelled = _spelled(tok, fmt.write([CATS]))
        assert tok.decode(spelled) == tok.decode(ids) and _tool_calls_id(tok) not in spelled
        assert not _accepts(tok, toolset, spelled), choice


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_tool_choice_allows_what_it_promises_on_token_ids(kind):
    tok = mistral_tok(KINDS[kind])
    fmt = detect_format(tok)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    one, two = ids(fmt.write([ROME])), ids(fmt.write([ROME, CATS]))
    required, parallel = ToolSet(TOOLS, "required"), ToolSet(TOOLS, "required", True)
    assert _accepts(tok, required, one) and not _accepts(tok, required, two)  # exactly one
    assert _accepts(tok, parallel, one) and _accepts(tok, parallel, two)  # one or more
    for bad in ["It is sunny.", "", fmt.write([("other", {"topic": "cats"})]),
                fmt.write([("Search", {"topic": "birds"})]), "Sure. " + fmt.write([ROME]),
                fmt.write([ROME]) + " done"]:
        assert not _accepts(tok, parallel, ids(bad)), bad
    named = ToolSet(TOOLS, "Search", True)  # exactly one call to that tool
    assert _accepts(tok, named, ids(fmt.write([CATS])))
    assert not _accepts(tok, named, one) and not _accepts(tok, named, ids(fmt.write([CATS, CATS])))
    auto = ToolSet(TOOLS, "auto", True)  # text, or text then calls
    for text in ["It is sunny.", "", fmt.write([ROME, CATS]), "Let me check. " + fmt.write([ROME])]:
        assert _accepts(tok, auto, ids(text)), text
    assert not _accepts(tok, auto, _spelled(tok, "Text about [TOOL_CALLS] itself"))
    assert not _accepts(tok, auto, ids(fmt.write([ROME]) + " and more"))


# -- generation -------------------------------------------------------------------------------

def test_every_sampled_call_is_one_marker_token_then_a_valid_call(loaded):
    tok = loaded.tokenizer
    marker = _tool_calls_id(tok)
    v11 = detect_format(tok).name == "mistral_v11"
    for parallel in (False, True):
        done = 0
        for req, value in sampled_tool_values(loaded, TOOLS, parallel, 6, MAX):
            if isinstance(value, IncompleteOutputError):  # a random model may add calls to the end
                assert parallel
                continue
            done += 1
            calls = _calls(value)
            assert all(isinstance(c, ToolCall) for c in calls)
            assert calls and (parallel or isinstance(value, ToolCall))
            ids = req.output_ids
            assert ids[0] == marker  # the calls begin with the one token
            assert ids.count(marker) == (len(calls) if v11 else 1)
            rest = tok.decode([i for i in ids if i != marker])
            assert "[TOOL_CALLS]" not in rest and "[TOOL_" not in rest  # never spelled
            for call in calls:  # typed and validated by finalize: once more by hand
                if call.name == "Search":
                    assert call.arguments.topic in ("cats", "dogs")
                else:
                    assert call.arguments["city"] in ("Paris", "Rome", "Oslo")
                    assert call.invoke() == f"{call.arguments['city']}/{call.arguments['unit']}"
                assert call.id.isalnum() and len(call.id) == 9
        assert done >= (6 if not parallel else 2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_auto_answers_in_text_or_with_the_call_token_as_the_model_prefers(kind):
    tok = mistral_tok(KINDS[kind])
    # bigram models: after the prompt's last token "[/INST]" one writes "H" (then stops: all
    # else ties and the stop token has the lowest id), the other the call token
    texter = bigram_loaded({("[/INST]", "H"): 10.0}, tok)
    caller = bigram_loaded({("[/INST]", "[TOOL_CALLS]"): 10.0}, tok)
    options = dict(tools=TOOLS, tool_choice="auto", max_tokens=MAX, system_prompt=False)
    assert generate(texter, "Hi", **options) == "H"
    result = generate(caller, "Hi", return_result=True, **options)
    assert isinstance(result.value, ToolCall) and result.token_ids[0] == _tool_calls_id(tok)
    assert result.value.name in ("get_weather", "Search")


def test_sampled_auto_outputs_are_text_or_valid_calls(loaded):
    gen = Generator(loaded, tools=TOOLS, tool_choice="auto", max_tokens=40, temperature=1.0,
                    max_retries=0, system_prompt=False)
    for value in gen.batch(["Weather?"] * 4, seed=2):
        assert isinstance(value, (str, ToolCall, IncompleteOutputError))
        if isinstance(value, str):
            assert "[TOOL_CALLS]" not in value


@pytest.mark.parametrize("choice, parallel", [("required", False), ("Search", True)])
def test_greedy_calls_are_identical_with_and_without_speculation(loaded, choice, parallel):
    on, off, stats = greedy_tool_texts(loaded, TOOLS, choice, parallel,
                                       ["Weather in Rome?", "Find cats", "Anything?"])
    assert on == off
    assert all(t.startswith("[TOOL_CALLS]") for t in on)
    # the marker token, the forced name and punctuation: several tokens per target forward
    assert stats and all(s.acceptance_length > 2.0 for s in stats)


# -- reading calls back -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_streamed_deltas_of_the_decoded_tokens_reassemble_to_the_calls(kind):
    tok = mistral_tok(KINDS[kind])
    fmt = detect_format(tok)
    auto = ToolSet(TOOLS, "auto", True)
    ids = tok.encode("Let me see. " + fmt.write([ROME, CATS]), add_special_tokens=False)
    parser = StreamingToolParser(auto, fmt)
    content, calls = "", {}
    for end in range(1, len(ids) + 1):  # as the server streams: the decoded text so far
        new, deltas = parser.feed(tok.decode(ids[:end]), final=end == len(ids))
        content += new
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function"
                call.update(id=d["id"], name=d["function"]["name"])
            call["arguments"] += d["function"]["arguments"]
    assert content.strip() == "Let me see."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [ROME, CATS]
    assert all(c["id"].isalnum() and len(c["id"]) == 9 for c in calls.values())
    text, parsed = auto.parse(tok.decode(ids), fmt)
    assert text == "Let me see."
    assert [(c.name, c.arguments) for c in parsed] == [ROME, ("Search", Search(topic="cats"))]


@pytest.mark.parametrize("written", [
    '[TOOL_CALLS] [{"name": "Search", "arguments": {"topic": "cats"}}]',
    '[TOOL_CALLS][{"name": "Search", "arguments": {"topic": "cats"}}]',
    '[TOOL_CALLS] [ {"name": "Search", "arguments": {"topic": "cats"}} ]',
])
def test_parsing_takes_the_spaces_a_tokenizer_may_decode_around_the_marker(written):
    fmt = detect_format(mistral_tok(V3_TEMPLATE))
    _, [call] = ToolSet(TOOLS, "auto").parse("Ok." + written, fmt)
    assert call.name == "Search" and call.arguments == Search(topic="cats")
    fmt11 = detect_format(mistral_tok(V11_TEMPLATE))
    _, calls = ToolSet(TOOLS, "required", True).parse(
        '[TOOL_CALLS] Search [ARGS] {"topic": "dogs"}[TOOL_CALLS]Search[ARGS]{"topic": "cats"}',
        fmt11)
    assert [c.arguments.topic for c in calls] == ["dogs", "cats"]


# -- the history --------------------------------------------------------------------------------

def test_calls_and_results_in_the_history_render_through_the_mistral_template(loaded):
    tok = loaded.tokenizer
    v11 = detect_format(tok).name == "mistral_v11"
    call = generate(loaded, "Weather in Oslo?", tools=TOOLS, tool_choice="get_weather",
                    max_tokens=MAX, system_prompt=False)
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        # our own call, as an OpenAI client sends it back: its id passes the template's check
        {"role": "assistant", "content": None, "tool_calls": [call.openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"},
        {"role": "user", "content": "And cats?"},
    ]
    ids = encode_prompt(tok, history, None, tools=ToolSet(TOOLS, "auto"))
    text = tok.decode(ids)
    args = json.dumps(json.loads(call.arguments_json))  # the template's tojson
    if v11:
        assert f"[TOOL_CALLS]get_weather[ARGS]{args}" in text
        assert "[TOOL_RESULTS]-3 C, snow[/TOOL_RESULTS]" in text
    else:
        assert (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {args}, '
                f'"id": "{call.id}"}}]') in text
        assert f'[TOOL_RESULTS] {{"content": "-3 C, snow", "call_id": "{call.id}"}}' in text
    assert ids.count(_tool_calls_id(tok)) == 1  # the marker in the prompt is the token too
    # the tools come once, before the last user turn, rendered by the template
    assert text.index("[AVAILABLE_TOOLS]") > text.index("-3 C, snow")
    assert '"name": "Search"' in text and "You can call functions" not in text
    again = generate(loaded, history, tools=TOOLS, tool_choice="Search", max_tokens=MAX)
    assert again.name == "Search" and again.arguments.topic in ("cats", "dogs")


# -- call ids in the history --------------------------------------------------------------------

def _history(*ids: str) -> list[dict]:
    """A conversation whose assistant turn called get_weather once per id (as an OpenAI client
    sends it: arguments as JSON text) and whose tool turns answer those calls in order."""
    cities = ["Rome", "Oslo", "Paris", "Rome"]
    calls = [{"id": i, "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for i, c in zip(ids, cities)]
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *[{"role": "tool", "tool_call_id": i, "content": f"result {k}"} for k, i in enumerate(ids)],
            {"role": "user", "content": "And cats?"}]


def _v3_ids(*ids: str, tools: ToolSet | None = None) -> tuple[list[str], list[str]]:
    """The ids the v0.3-shaped template writes for ``_history(*ids)``: the calls' (in the
    ``[TOOL_CALLS]`` list) and the results' (``call_id``), in order."""
    tok = mistral_tok(V3_TEMPLATE)
    text = tok.decode(encode_prompt(tok, _history(*ids), None, tools=tools))
    listed = text[text.index("[TOOL_CALLS] ["):text.index("[TOOL_RESULTS]")]
    return (re.findall(r'"id": "([^"]*)"\}', listed),
            re.findall(r'"call_id": "([^"]*)"\}\[/TOOL_RESULTS\]', text))


def test_a_clients_openai_call_ids_reach_the_v3_template_as_matching_9_character_ids():
    sent = ["call_9f8e7d6c5b4a39281706f5e4", "call_QmX8r2LpA0zT7vKc"]
    for tools in (ToolSet(TOOLS, "auto"), None):  # this turn with tools, and without
        calls, results = _v3_ids(*sent, tools=tools)
        assert calls == results  # each result names the call it answers
        assert calls == [i[-9:] for i in sent]  # their last 9 characters, as vLLM keeps them
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in calls)


def test_call_ids_that_are_already_9_letters_and_digits_are_kept():
    calls, results = _v3_ids("a1B2c3D4e", "ZZZZZZZZZ")
    assert calls == results == ["a1B2c3D4e", "ZZZZZZZZZ"]


def test_different_call_ids_with_the_same_last_9_characters_get_different_ids():
    # the last two end like the first, which is already valid and keeps its id; "7" is short
    sent = ["123456789", "call_A_123456789", "call-B-1234-56789", "7"]
    calls, results = _v3_ids(*sent)
    assert calls == results and calls[0] == "123456789"
    assert len(set(calls)) == 4 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in calls)
    assert _v3_ids(*sent) == (calls, results)  # the same conversation, the same ids


@pytest.mark.parametrize("marker, name", [("<tool_call>", "hermes"), ("<|python_tag|>", "llama3")])
def test_call_ids_reach_other_templates_as_the_client_sent_them(marker, name):
    tok = byte_level_bpe()
    tok.chat_template = (
        "{% if tools %}" + marker + "{% endif %}{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.id }};{% endfor %}"
        "{% if m.role == 'tool' %}RESULT {{ m.tool_call_id }};{% endif %}{% endfor %}")
    assert detect_format(tok).name == name
    sent = ["call_A_123456789", "call-B-1234-56789"]
    text = tok.decode(encode_prompt(tok, _history(*sent), None, tools=ToolSet(TOOLS, "auto")))
    assert "CALL call_A_123456789;CALL call-B-1234-56789;" in text
    assert "RESULT call_A_123456789;RESULT call-B-1234-56789;" in text


def test_the_server_answers_a_history_with_a_clients_openai_call_ids(loaded):
    tools = [t.openai() for t in ToolSet(TOOLS, "auto").offered]
    body = {"model": "tiny", "messages": _history("call_9f8e7d6c5b4a39281706f5e4"), "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "Search"}}}
    with serve_tiny(loaded, max_tokens=MAX) as (_, url):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "Search" and re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
