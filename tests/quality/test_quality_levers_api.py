"""Output-quality levers through the public API, on bigram models that loop by construction.

A bigram Llama (``cs_testlib.bigram_llama``) over a byte-level BPE: the next token depends on
the last one alone, so greedy decoding inside a JSON string can be made to loop forever.

- retries (``max_retries``): on by default, the first valid attempt is returned, ``attempts``
  counts them, retries are seeded (reproducible), all-failed raises the last error with the
  attempts; ``max_retries=0`` is a single attempt (the tests of single-attempt behaviour set it);
- bounds (``max_string_length``, ``max_items``): added to the grammar where the schema has none,
  reported, overridable per call, final validation still against the user's schema;
- the repetition guard through ``Generator`` / ``generate`` keywords;
- layout: pretty JSON as ``json.dumps(indent=...)`` writes it, and a clean end (nothing may
  follow the closing brace);
- bad option values raise ``ConfigError`` naming the option.
"""

from __future__ import annotations

import json

import pytest
from cs_testlib import bigram_loaded
from pydantic import BaseModel, field_validator

from constrained_spec import (
    ConfigError,
    Generator,
    IncompleteOutputError,
    JsonLayout,
    OutputValidationError,
    generate,
)
from constrained_spec.grammar import compile_spec
from constrained_spec.schemas import bound_schema, normalize_schema

STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                 "additionalProperties": False}


@pytest.fixture(scope="module")
def looping():
    """Inside a string: a -> b -> a -> ... (5); the closing quote comes second (3)."""
    return bigram_loaded({('"', "a"): 5, ("a", "b"): 5, ("b", "a"): 5, ("a", '"'): 3, ("b", '"'): 3})


@pytest.fixture(scope="module")
def one_letter():
    """Greedy writes {"a": "a"}; sampling sometimes writes "b" (4 against 5)."""
    return bigram_loaded({('"', "a"): 5, ('"', "b"): 4, ("a", '"'): 5, ("b", '"'): 5})


def test_greedy_loops_until_max_tokens(looping):
    with pytest.raises(IncompleteOutputError) as info:
        generate(looping, "x", schema=STRING_SCHEMA, max_tokens=30, max_retries=0)
    assert "ababab" in info.value.partial_text
    assert info.value.attempts == 1


def test_retries_return_the_first_valid_attempt_and_count_attempts(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30, retry_from="start")
    res = gen("x", max_retries=4, return_result=True)
    assert res.attempts >= 2 and res.stats.attempts == res.attempts
    assert json.loads(res.text) == res.value
    # attempt k (k >= 1) samples at the retry temperature with seed k: the earlier ones failed
    for k in range(1, res.attempts - 1):
        with pytest.raises(IncompleteOutputError):
            gen("x", temperature=0.7, seed=k, max_retries=0)
    assert gen("x", temperature=0.7, seed=res.attempts - 1, max_retries=0) == res.value
    again = gen("x", max_retries=4, return_result=True)  # seeded: reproducible
    assert (again.value, again.attempts) == (res.value, res.attempts)


def test_retries_sum_the_stats_of_every_attempt(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30, speculative=False,
                    retry_from="start")
    with pytest.raises(IncompleteOutputError) as info:
        gen("x", max_retries=2, retry_temperature=0.01)  # near-greedy retries loop too
    err = info.value
    assert err.attempts == 3 and err.stats.attempts == 3
    assert err.stats.emitted_tokens == 3 * 30  # every attempt ran to max_tokens


def test_retries_cure_a_failed_validation(one_letter):
    class OnlyB(BaseModel):
        a: str

        @field_validator("a")
        @classmethod
        def not_a(cls, v: str) -> str:
            if v == "a":
                raise ValueError("'a' is not accepted")
            return v

    gen = Generator(one_letter, schema=OnlyB, max_tokens=20)
    with pytest.raises(OutputValidationError):
        gen("x", max_retries=0)
    res = gen("x", max_retries=8, return_result=True)
    # a later attempt's sample passed the validator (which letters it drew is the seed's)
    assert isinstance(res.value, OnlyB) and res.value.a != "a" and res.attempts >= 2


def test_a_call_s_max_retries_overrides_the_generator_s_in_batches(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30, max_retries=4)
    out = gen.batch(["x", "y"], return_result=True, max_retries=0)
    assert all(isinstance(r, IncompleteOutputError) and r.attempts == 1 for r in out)
    out = gen.batch(["x", "y"], return_result=True)  # the Generator's own max_retries
    assert all(not isinstance(r, BaseException) and r.attempts >= 2 for r in out)


def test_repetition_guard_through_the_api_completes_the_output(looping):
    value = generate(looping, "x", schema=STRING_SCHEMA, max_tokens=30, no_repeat_ngram_size=3)
    assert value == {"a": "abab"}
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30)
    assert gen("x", no_repeat_ngram_size=3) == {"a": "abab"}  # per call
    with pytest.raises(IncompleteOutputError):
        gen("x", max_retries=0)


def test_max_string_length_bounds_the_loop_and_validates_against_the_user_schema(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30, max_string_length=5)
    assert gen("x") == {"a": "ababa"}
    assert [b.format() for b in gen.report.added_bounds] == [
        "added: maxLength 5 at /properties/a (max_string_length)"]
    assert "maxLength" not in gen.spec.json_schema["properties"]["a"]  # validation: the user's
    assert gen.grammar_spec.json_schema["properties"]["a"]["maxLength"] == 5
    assert "added: maxLength 5" in gen.report.format()
    plain = Generator(looping, schema=STRING_SCHEMA, max_tokens=30)
    assert plain("x", max_string_length=3) == {"a": "aba"}  # per call


def test_max_items_bounds_an_endless_array():
    # an array of "a" strings: after '"' -> ',' (5) beats ']' (3)
    model = bigram_loaded({('"', "a"): 5, ("a", '"'): 5, ('"', ","): 5, ('"', "]"): 3})
    schema = {"type": "array", "items": {"type": "string", "enum": ["a"]}, "minItems": 1}
    gen = Generator(model, schema=schema, max_tokens=40, layout=JsonLayout(separators=(",", ":")))
    with pytest.raises(IncompleteOutputError):
        gen("x", max_retries=0)
    assert gen("x", max_items=3) == ["a", "a", "a"]


def test_bound_schema_adds_only_missing_bounds():
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "long": {"type": "string", "minLength": 50},
            "capped": {"type": "string", "maxLength": 3},
            "pattern": {"type": "string", "pattern": "^[a-z]+$"},
            "date": {"type": "string", "format": "date"},
            "choice": {"type": "string", "enum": ["x", "y"]},
            "maybe": {"type": ["string", "null"]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
            "few": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
            "many": {"type": "array", "items": {"type": "integer"}, "minItems": 30},
            "not": {"not": {"type": "string"}},
        },
        "$defs": {"tag": {"type": "string"}},
    }
    spec = normalize_schema(schema)
    bounded, added = bound_schema(spec, max_string_length=10, max_items=5)
    got = {(b.pointer, b.keyword): b.value for b in added}
    assert got == {
        ("/properties/free", "maxLength"): 10,
        ("/properties/long", "maxLength"): 50,  # never below the schema's own minimum
        ("/properties/maybe", "maxLength"): 10,
        ("/properties/tags", "maxItems"): 5,
        ("/properties/many", "maxItems"): 30,
        ("/$defs/tag", "maxLength"): 10,
    }
    assert spec.json_schema == schema and bounded.key != spec.key  # the user's spec is untouched
    assert bound_schema(spec) == (spec, [])
    assert bound_schema(normalize_schema(["x", "y"]), max_string_length=3)[1] == []


@pytest.mark.parametrize("indent", [None, 2, 4])
def test_layout_matches_json_dumps_and_ends_cleanly(tiny_loaded, indent):
    layout = JsonLayout(indent=indent)
    value = {"name": "Ada", "tags": ["x", "y"], "age": 36, "ok": True, "none": None, "o": {"k": 1}}
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "age": {"type": "integer"}, "ok": {"type": "boolean"}, "none": {"type": "null"},
        "o": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
              "additionalProperties": False}},
        "required": list(value), "additionalProperties": False}
    text = json.dumps(value, indent=indent, ensure_ascii=False)  # json.dumps' own separators
    assert layout.dumps(value) == text
    for backend in ("xgrammar", "outlines"):
        compiled = compile_spec(normalize_schema(schema, layout=layout), tiny_loaded.tokenizer_data,
                                backend=backend)
        m = compiled.new_matcher()
        assert m.accepts_text(text), backend
        # clean end: the closing brace ends the output, no whitespace may follow it
        for tail in (" ", "\n", "\n\n"):
            assert not m.accepts_text(text + tail), (backend, repr(tail))
        for t in tiny_loaded.tokenizer.encode(text, add_special_tokens=False):
            assert m.accept(t)
        assert m.must_stop(), backend


@pytest.mark.parametrize("kwargs,option", [
    ({"max_retries": -1}, "max_retries"),
    ({"max_retries": 1.5}, "max_retries"),
    ({"retry_temperature": 0}, "retry_temperature"),
    ({"max_string_length": 0}, "max_string_length"),
    ({"max_items": "3"}, "max_items"),
    ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
    ({"repetition_penalty": 0.5}, "repetition_penalty"),
    ({"layout": "pretty"}, "layout"),
    ({"layout": {"indent": 2, "separators": [";", ":"]}}, "layout"),
])
def test_bad_lever_values_raise_config_error(tiny_loaded, kwargs, option):
    with pytest.raises(ConfigError) as info:
        Generator(tiny_loaded, schema=STRING_SCHEMA, **kwargs)
    assert info.value.option == option
    if option != "layout":
        gen = Generator(tiny_loaded, schema=STRING_SCHEMA)
        with pytest.raises(ConfigError) as info:
            gen("x", **kwargs)  # per call too
        assert info.value.option == option


def test_layout_from_json_options(tiny_loaded):
    gen = Generator(tiny_loaded, schema=STRING_SCHEMA, layout={"indent": 2, "separators": [",", ": "]})
    assert gen.schema_options.layout == JsonLayout(indent=2)


def test_unknown_call_option_is_a_config_error(tiny_loaded):
    gen = Generator(tiny_loaded, schema=STRING_SCHEMA)
    with pytest.raises(ConfigError, match="unknown option 'max_token'"):
        gen("x", max_token=3)


def test_retries_refuse_streaming(tiny_loaded):
    gen = Generator(tiny_loaded, schema=STRING_SCHEMA, max_retries=1)
    with pytest.raises(ConfigError) as info:
        gen.batch(["x"], on_tokens=lambda i, toks: None)
    assert info.value.option == "max_retries"
