"""The same API, CLI and server on vLLM's engine (its CPU build here; only the device differs
on GPUs). Each test names the property: what the frontend guarantees holds on both engines."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from constrained_spec import Generator, Regex, generate
from constrained_spec.config import SpeculativeConfig

pytestmark = pytest.mark.model  # the embedded model, exported once for vLLM

PROMPT = "Extract the person: Ada Lovelace is a 36 year old mathematician living in London."


class Person(BaseModel):
    name: str
    age: int
    city: str


def test_generate_on_vllm_returns_the_validated_pydantic_object(vllm_model):
    res = generate(vllm_model, PROMPT, schema=Person, speculative=False, return_result=True)
    assert isinstance(res.value, Person) and res.finish_reason == "stop"
    assert res.stats.emitted_tokens == len(res.token_ids) > 0
    assert Person.model_validate_json(res.text) == res.value


PROMPTS = [PROMPT, "Extract the person: Grace Hopper, 85, lives in New York.",
           "Extract the person: Alan Turing was 41 and lived in Manchester."]


def first_difference_is_a_near_tie(vllm_model, prompt_ids: list[int], a: list[int], b: list[int]) -> None:
    """Two greedy outputs of one prompt either agree or first differ at a near-tie under a
    neutral float32 reference (the export in float32): a wrong prompt or grammar on one side
    would differ by a wide margin; bf16 arithmetic that differs (another engine, another batch
    shape) may tip a near-tie."""
    import torch
    from transformers import AutoModelForCausalLM

    if a == b:
        return
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert i < min(len(a), len(b)), "one output is a prefix of the other"
    reference = AutoModelForCausalLM.from_pretrained(str(vllm_model.path), dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_ids + a[:i]])).logits[0, -1]
    gap = abs(float(logits[a[i]] - logits[b[i]]))
    assert gap < 0.25, f"token {i} differs by {gap:.3f} logits, not a near-tie"


def test_greedy_outputs_match_our_engine_or_differ_at_a_near_tie(vllm_model, embedded):
    # the same prompt ids and compiled grammar, greedy: only arithmetic differs (our engine
    # runs the file's 4-bit groups, vLLM a dense bf16 export)
    same = 0
    for prompt in PROMPTS:
        gen = Generator(embedded, schema=Person, speculative=False, max_retries=0)
        ours = gen(prompt, return_result=True)
        theirs = generate(vllm_model, prompt, schema=Person, speculative=False, max_retries=0,
                          return_result=True)
        same += ours.token_ids == theirs.token_ids
        first_difference_is_a_near_tie(vllm_model, gen.make_request(prompt)[0].prompt_ids,
                                       ours.token_ids, theirs.token_ids)
    assert same >= 1  # the engines agree where nothing is close


def test_a_regex_constraint_holds_on_vllm(vllm_model):
    date = generate(vllm_model, "Today's date in ISO format:", schema=Regex(r"\d{4}-\d{2}-\d{2}"),
                    speculative=False, max_tokens=16)
    assert len(date) == 10 and date[4] == date[7] == "-"


def test_choices_hold_on_vllm(vllm_model):
    out = generate(vllm_model, "Is the sky blue? Answer yes or no.", schema=["yes", "no"],
                   speculative=False, max_tokens=8)
    assert out in ("yes", "no")


def test_a_tool_call_on_vllm_is_parsed_into_a_validated_call(vllm_model):
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    gen = Generator(vllm_model, tools=[get_weather], tool_choice="required", speculative=False)
    call = gen("What is the weather in Paris? Use celsius.")
    assert call.name == "get_weather" and isinstance(call.arguments["city"], str)
    assert call.arguments.get("unit", "celsius") in ("celsius", "fahrenheit")


def test_our_drafts_on_vllm_keep_the_greedy_output_and_report_their_acceptance(vllm_model):
    from constrained_spec.generation.vllm_engine import engine_for

    gen = Generator(vllm_model, schema=Person, speculative=False, max_retries=0)
    plain = gen(PROMPT, return_result=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)  # the default method
    res = Generator(vllm_model, schema=Person, speculative=spec, max_retries=0)(PROMPT, return_result=True)
    # vLLM ran our proposer (forced and grammar-checked n-gram drafts), not its own n-gram
    config = engine_for(vllm_model, spec).vllm_config.speculative_config
    assert config.method == "custom_class" and config.model.endswith("vllm_proposer.GrammarProposer")
    # lossless (greedy) up to bf16 arithmetic: vLLM's CPU build verifies a draft window in
    # other GEMM shapes than a 1-token decode, which may tip a near-tie (it did on an AVX2-only
    # CPU: age 31 against 32); token identity is test_float32_identity.py's
    first_difference_is_a_near_tie(vllm_model, gen.make_request(PROMPT)[0].prompt_ids,
                                   plain.token_ids, res.token_ids)
    assert isinstance(res.value, Person)
    st = res.stats
    assert st.drafted_tokens > 0 and 0 < st.accepted_tokens <= st.drafted_tokens
    assert st.emitted_tokens == len(res.token_ids) and st.acceptance_length > 1.0
    assert sum(st.proposed_at[:1]) > 0  # per-position counts from vLLM's per-step metrics


def test_vllms_prefix_cache_serves_a_repeated_schema_prompt_and_is_counted(vllm_model):
    gen = Generator(vllm_model, schema=Person, speculative=False, max_retries=0)
    gen(PROMPT)
    again = gen("Extract the person: Alan Turing was 41 and lived in Manchester.",
                return_result=True).stats
    # the shared part (the template's start and the schema description) in 16-token blocks
    assert 16 <= again.cached_prompt_tokens < again.prompt_tokens


class Address(BaseModel):
    street: str
    number: int


class Order(BaseModel):
    items: list[str]
    total: float
    paid: bool


CONCURRENT = [  # eight prompts, each with a schema of its own, in one vLLM batch
    (PROMPT, Person),
    ("Extract the address: 221 Baker Street.", Address),
    ("Order: two pens and a notebook, 7.50 in total, paid.", Order),
    ("Is water wet? Answer yes or no.", ["yes", "no"]),
    ("A date in 2024 as YYYY-MM-DD:", Regex(r"2024-[01][0-9]-[0-3][0-9]")),
    ("Extract the person: Grace Hopper, 85, lives in New York.", Person),
    ("Three colours as a JSON list of strings:",
     {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}),
    ("Rate the movie from 1 to 5, with a one-word reason.",
     {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                       "reason": {"type": "string", "maxLength": 16}},
      "required": ["stars", "reason"], "additionalProperties": False}),
]


@pytest.mark.parametrize("speculative", [False, None], ids=["no speculation", "our drafts"])
def test_eight_concurrent_requests_of_different_schemas_each_end_valid_or_typed(vllm_model,
                                                                               speculative):
    import jsonschema

    from constrained_spec.errors import IncompleteOutputError
    from constrained_spec.schemas import normalize_schema

    gen = Generator(vllm_model, speculative=speculative, max_batch_size=8, max_tokens=64,
                    max_retries=0)
    prompts = [p for p, _ in CONCURRENT]
    out = gen.batch(prompts, schemas=[s for _, s in CONCURRENT], return_result=True)
    done = 0
    for (prompt, schema), res in zip(CONCURRENT, out):
        if isinstance(res, IncompleteOutputError):  # max_tokens: typed, the output kept
            assert res.token_ids, prompt
            continue
        assert not isinstance(res, Exception), f"{prompt}: {res!r}"
        done += 1
        spec = normalize_schema(schema)
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(res.text), spec.json_schema)
        elif isinstance(schema, Regex):
            assert re.fullmatch(schema.pattern, res.text), (prompt, res.text)
        else:
            assert res.text in schema, (prompt, res.text)
    assert done >= 6


def test_max_tokens_ends_a_vllm_request_as_on_our_engine(vllm_model, embedded):
    from constrained_spec.errors import IncompleteOutputError

    ends = []
    for model in (embedded, vllm_model):  # the library's rule, whichever engine decodes
        with pytest.raises(IncompleteOutputError) as err:
            generate(model, PROMPT, schema=Person, max_tokens=5, speculative=False, max_retries=0)
        ends.append(len(err.value.token_ids))
    assert ends == [5, 5]


def test_a_batch_of_mixed_schemas_runs_together_on_vllm(vllm_model):
    gen = Generator(vllm_model, speculative=False)
    out = gen.batch([PROMPT, "Is water wet? yes or no"], schemas=[Person, ["yes", "no"]])
    assert isinstance(out[0], Person) and out[1] in ("yes", "no")


def test_the_server_streams_from_vllm_with_the_same_request_surface(vllm_model):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
    from openai_server_process import serve_in_thread

    from constrained_spec.server import ServerConfig, create_app

    app = create_app(vllm_model, ServerConfig(model_name="m", speculative=False))
    with serve_in_thread(app) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "p", "strict": True, "schema": Person.model_json_schema()}}}
        text = ""
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += chunk["choices"][0]["delta"].get("content") or "" if chunk["choices"] else ""
        assert isinstance(Person.model_validate_json(text), Person)
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "b", "schema": {"type": "object", "$ref": "http://example.com/s.json"}}}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_schema"


def test_the_cli_generates_on_vllm(vllm_model, capsys):
    from constrained_spec.cli import main

    # the same options as the session's model (conftest.ENGINE_ARGS): its engine is reused

    code = main(["generate", PROMPT, "--engine", "vllm", "--vllm-arg", "enforce_eager=true",
                 "--no-speculation", "--schema", json.dumps(Person.model_json_schema()), "--quiet"])
    assert code == 0
    assert isinstance(Person.model_validate_json(capsys.readouterr().out), Person)


def test_serve_with_engine_vllm_answers_a_schema_request(vllm_usable):
    # the command as users run it: its own process, its own vLLM engine (eager, small cache)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
    from openai_server_process import start_server

    server = start_server("--engine", "vllm", "--vllm-arg", "enforce_eager=true",
                          "--no-speculation", "--served-model-name", "m", timeout=600)
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": "m", "messages": [{"role": "user", "content": PROMPT}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "p", "strict": True, "schema": Person.model_json_schema()}}})
        assert r.status_code == 200, r.text
        assert isinstance(Person.model_validate_json(r.json()["choices"][0]["message"]["content"]), Person)
    finally:
        server.stop()


def test_a_configuration_vllm_refuses_is_a_config_error_naming_why(vllm_usable):
    from constrained_spec.errors import ConfigError
    from constrained_spec.model.loading import load_model

    # the embedded model has 9 attention heads: 2 tensor-parallel ranks cannot split them
    model = load_model(None, engine="vllm", tensor_parallel_size=2, enforce_eager=True, quiet=True)
    with pytest.raises(ConfigError, match="divisible by tensor parallel size") as err:
        generate(model, PROMPT, schema=Person, speculative=False)
    assert err.value.option == "engine_args"


# markers that are one token each in the embedded model's vocabulary (the model never writes
# them: the budget closes the block, a structural tag on vLLM's side, our matcher on ours)
ONE_TOKEN_MARKERS = ("<issue_start>", "<issue_closed>")


@pytest.mark.parametrize("budget,drafting", [(0, False), (5, False), (5, True)])
def test_reasoning_on_vllm_thinks_within_the_budget_then_answers_validated(vllm_model, budget,
                                                                          drafting):
    from constrained_spec.frontend.reasoning import ReasoningMarkers

    start, end = (vllm_model.tokenizer.convert_tokens_to_ids(m) for m in ONE_TOKEN_MARKERS)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4) if drafting else False
    res = generate(vllm_model, PROMPT, schema=Person, reasoning=ReasoningMarkers(*ONE_TOKEN_MARKERS),
                   max_reasoning_tokens=budget, speculative=spec, max_retries=0, return_result=True)
    assert isinstance(res.value, Person) and res.finish_reason == "stop"
    ids = res.token_ids
    assert ids[0] == start and ids[budget + 1] == end and end not in ids[1:budget + 1]
    assert isinstance(res.reasoning, str) and len(vllm_model.tokenizer.encode(
        res.reasoning, add_special_tokens=False)) <= budget
    assert Person.model_validate_json(res.text) == res.value


def test_reasoning_on_vllm_with_an_end_marker_of_several_tokens_is_a_config_error(vllm_model):
    from constrained_spec.errors import ConfigError
    from constrained_spec.frontend.reasoning import ReasoningMarkers

    with pytest.raises(ConfigError, match="one token") as err:
        generate(vllm_model, PROMPT, schema=Person, reasoning=ReasoningMarkers("<think>", "</think>"),
                 speculative=False)
    assert err.value.option == "reasoning"


def test_min_tokens_and_ignore_eos_hold_the_stop_on_vllm(vllm_model):
    # "What is 2+2?" ends early (11 tokens greedy here); held back, it runs on
    gen = Generator(vllm_model, speculative=False, max_tokens=40, max_retries=0)
    plain = gen("What is 2+2?", return_result=True)
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 20
    held = gen("What is 2+2?", return_result=True, min_tokens=20)
    assert len(held.token_ids) >= 20 and held.token_ids[:len(plain.token_ids) - 1] == plain.token_ids[:-1]
    ignored = gen("What is 2+2?", return_result=True, ignore_eos=True)
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"
    # a grammar that must end still ends the output (the grammar wins, as on our engine)
    three = Generator(vllm_model, schema=Regex("[a-z]{3}"), speculative=False, max_tokens=16)
    assert len(three("Three letters:", min_tokens=12)) == 3


def test_raw_logprobs_on_vllm_cover_every_token_and_masked_is_a_config_error(vllm_model):
    from constrained_spec.errors import ConfigError

    gen = Generator(vllm_model, schema=Person, speculative=False, max_retries=0)
    res = gen(PROMPT, return_result=True, logprobs=2, logprobs_mode="raw")
    assert len(res.logprobs) == len(res.token_ids) > 0
    assert [e.token_id for e in res.logprobs] == res.token_ids
    assert all(e.logprob <= 0 and len(e.top) == 2 for e in res.logprobs)
    with pytest.raises(ConfigError) as err:
        gen(PROMPT, logprobs=2)
    assert err.value.option == "logprobs_mode"
