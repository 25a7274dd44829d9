"""Up-front limits (schemas/limits.py): nested counted repetitions, choice lists, and outputs
that cannot fit in max_tokens are refused before any compute, naming the limit."""

from __future__ import annotations

import json

import pytest

from constrained_spec.api import Generator
from constrained_spec.errors import ConfigError, SchemaError
from constrained_spec.schemas import Regex, normalize_schema
from constrained_spec.schemas.limits import (
    MAX_CHOICES,
    MAX_NESTED_REPETITION,
    nested_repetition,
    shortest_output,
)


@pytest.mark.parametrize("pattern, product", [
    ("((a{1,50}){1,50}){1,50}", 125_000),
    ("(a{1,100}){1,100}", 10_000),
    (r"([a-z0-9]{1,63}\.){1,127}[a-z]{2,6}", 63 * 127),
    (r"(\d{1,3}\.){3}\d{1,3}", 9),
    ("a{1,100000}", 1),  # one repetition alone: a counter, not a product
    ("(a+)+", 1),  # unbounded loops have no counter
    ("(?:(a{2}|b{1,200}){1,30}|c)+", 6_000),  # through alternatives and an unbounded loop
    ("(?=(a{1,9}){1,9})a", 81),  # inside a look-ahead too
])
def test_nested_repetition_is_the_product_of_nested_upper_bounds(pattern, product):
    assert nested_repetition(pattern) == product


def test_a_regex_nesting_repetitions_past_the_limit_is_refused_naming_it():
    with pytest.raises(SchemaError, match=f"{MAX_NESTED_REPETITION - 1:,}"):
        normalize_schema(Regex("((a{1,50}){1,50}){1,50}"))
    normalize_schema(Regex(r"([a-z0-9]{1,63}\.){1,127}[a-z]{2,6}"))  # a hostname: served


@pytest.mark.parametrize("schema, pointer", [
    ({"type": "string", "pattern": "^(a{1,100}){1,100}$"}, "/pattern"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "((b{2,40}){1,40}){1,9}"}}},
     "/properties/x/pattern"),
    ({"type": "object", "patternProperties": {"^(k{1,200}){1,200}$": {"type": "integer"}}},
     "/patternProperties/^(k{1,200}){1,200}$"),
])
def test_a_json_schema_pattern_past_the_limit_is_refused_with_its_pointer(schema, pointer):
    with pytest.raises(SchemaError) as err:
        normalize_schema(schema)
    assert err.value.pointer == pointer and "multiply to" in str(err.value)


def test_a_choice_list_past_the_limit_is_refused_naming_it():
    normalize_schema([f"option {i}" for i in range(MAX_CHOICES)])
    with pytest.raises(SchemaError, match=f"limit is {MAX_CHOICES:,}"):
        normalize_schema([f"option {i}" for i in range(MAX_CHOICES + 1)])


SHORTEST = [  # a schema and the shortest compact JSON text valid under it
    ({"type": "string", "minLength": 7}, "a" * 7),
    ({"type": "array", "items": {"type": "string", "minLength": 3}, "minItems": 4}, ["abc"] * 4),
    ({"type": "object", "properties": {"name": {"type": "string", "minLength": 2},
                                       "tags": {"type": "array", "minItems": 2,
                                                "items": {"type": "integer"}}},
      "required": ["name", "tags"]}, {"name": "ab", "tags": [0, 0]}),
    ({"anyOf": [{"type": "string", "minLength": 50}, {"type": "integer"}]}, 0),
    ({"type": "object", "minProperties": 3}, {"a": 0, "b": 0, "c": 0}),
    ({"enum": ["long value", "v", 12345]}, "v"),
    ({"allOf": [{"type": "string", "minLength": 4}, {"type": "string", "minLength": 9}]}, "a" * 9),
    ({"$ref": "#/$defs/x", "$defs": {"x": {"type": "string", "minLength": 99}}}, "a" * 99),
]


@pytest.mark.parametrize("schema, shortest", SHORTEST)
def test_the_shortest_output_is_a_lower_bound_on_every_valid_output(schema, shortest):
    import jsonschema

    jsonschema.validate(shortest, schema)
    text = json.dumps(shortest, separators=(",", ":"))
    low, where = shortest_output(normalize_schema(schema))
    assert low <= len(text), (low, where, text)
    assert where.startswith("the schema at")


def test_the_shortest_output_of_a_regex_is_its_minimum_width():
    assert shortest_output(normalize_schema(Regex(r"\d{5}-[a-z]{2,}")))[0] == 8


def test_a_schema_no_output_of_which_fits_max_tokens_is_refused_before_any_compute(tiny_loaded):
    gen = Generator(tiny_loaded)
    longest = max(map(len, tiny_loaded.tokenizer_data.decoded))
    too_long = {"type": "string", "minLength": 1_000_000}
    with pytest.raises(ConfigError) as err:
        gen.make_request("x", schema=too_long, max_tokens=64)
    assert err.value.option == "max_tokens" and "/minLength" in str(err.value)
    # at the edge: 64 tokens of the longest token hold 64 * longest characters
    edge = Regex(f"a{{{64 * longest}}}")
    gen.make_request("x", schema=edge, max_tokens=64)
    with pytest.raises(ConfigError, match="max_tokens=64"):
        gen.make_request("x", schema=Regex(f"a{{{64 * longest + 1}}}"), max_tokens=64)


def test_a_pattern_inside_data_keywords_is_data_not_a_pattern():
    normalize_schema({"type": "object", "const": {"pattern": "((a{1,50}){1,50}){1,50}"},
                      "examples": [{"pattern": "(a{1,100}){1,100}"}]})
