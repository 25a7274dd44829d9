"""parse_output: the final validation of a completed output, per spec kind."""

from __future__ import annotations

import enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from constrained_spec.errors import OutputValidationError
from constrained_spec.schemas import Grammar, Regex, normalize_schema, parse_output


class Person(BaseModel):
    name: str
    age: int = Field(ge=0)


class Mood(enum.Enum):
    HAPPY = "happy"
    SAD = "sad"


def test_pydantic_target_returns_an_instance():
    out = parse_output(normalize_schema(Person), '{"name": "Ada", "age": 36}')
    assert isinstance(out, Person) and out.age == 36


def test_json_schema_returns_plain_json():
    spec = normalize_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert parse_output(spec, '{"a": 1}') == {"a": 1}


def test_type_adapter_target_validates_through_pydantic():
    assert parse_output(normalize_schema(list[int]), "[1, 2]") == [1, 2]


def test_malformed_json_raises_with_text():
    with pytest.raises(OutputValidationError) as info:
        parse_output(normalize_schema(Person), '{"name": "Ada", "age": ')
    assert info.value.text == '{"name": "Ada", "age": ' and "not valid JSON" in str(info.value)


def test_schema_violation_lists_errors_with_pointers():
    with pytest.raises(OutputValidationError) as info:
        parse_output(normalize_schema(Person), '{"name": "Ada", "age": -1}')
    assert info.value.errors and info.value.errors[0].startswith("/age")


def test_unenforced_keywords_are_still_validated():
    spec = normalize_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert parse_output(spec, "[1, 2]") == [1, 2]
    with pytest.raises(OutputValidationError):
        parse_output(spec, "[1, 1]")


def test_formats_are_checked():
    spec = normalize_schema({"type": "string", "format": "ipv4"})
    assert parse_output(spec, '"10.0.0.1"') == "10.0.0.1"
    with pytest.raises(OutputValidationError):
        parse_output(spec, '"10.0.0"')


def test_schema_draft_is_taken_from_dollar_schema():
    spec = normalize_schema({"$schema": "http://json-schema.org/draft-07/schema#",
                             "type": "array", "items": [{"type": "integer"}], "additionalItems": False})
    assert parse_output(spec, "[1]") == [1]
    with pytest.raises(OutputValidationError):
        parse_output(spec, "[1, 2]")


def test_regex_full_match():
    spec = normalize_schema(Regex(r"\d{3}-\d{4}"))
    assert parse_output(spec, "555-1234") == "555-1234"
    with pytest.raises(OutputValidationError):
        parse_output(spec, "555-12345")


def test_choice_returns_the_original_value():
    assert parse_output(normalize_schema(Mood), "sad") is Mood.SAD
    assert parse_output(normalize_schema(Literal["x", "y"]), "y") == "y"
    assert parse_output(normalize_schema(["one", 2, None]), "2") == 2
    assert parse_output(normalize_schema(["one", 2, None]), "null") is None
    with pytest.raises(OutputValidationError):
        parse_output(normalize_schema(Mood), "angry")


def test_grammar_checks_the_language():
    spec = normalize_schema(Grammar('root ::= "a"+ "b"'))
    assert parse_output(spec, "aab") == "aab"
    with pytest.raises(OutputValidationError):
        parse_output(spec, "ba")


@pytest.mark.parametrize("text", ["1e999", "-1e999", '{"x": 12e400}', "[1.0, 9" + "9" * 400 + ".5]"])
def test_numbers_that_overflow_a_float64_are_refused_not_returned_as_inf(text):
    schema = {} if text[0] in "{[" else {"type": "number"}
    with pytest.raises(OutputValidationError, match="not finite") as info:
        parse_output(normalize_schema(schema), text)
    assert info.value.text == text
    assert parse_output(normalize_schema({"type": "number"}), "1.7976931348623157e308") > 1e308


def test_an_integer_past_the_digit_limit_is_an_output_validation_error():
    with pytest.raises(OutputValidationError, match="cannot be read"):
        parse_output(normalize_schema({"type": "integer"}), "1" * 5000)


def test_a_model_that_writes_1e789_gets_a_typed_error():
    """End to end: the number grammar lets a model write an overflowing exponent; the library
    never hands back ``inf``."""
    from cs_testlib import bigram_loaded

    from constrained_spec import Generator

    chain = ["Ċ", "1", "e", "7", "8", "9", "<|endoftext|>"]  # after the prompt's newline: 1e789
    model = bigram_loaded({(a, b): 10.0 for a, b in zip(chain, chain[1:])})
    gen = Generator(model, schema={"type": "number"}, system_prompt=False, speculative=False,
                    max_tokens=12, max_retries=0)  # the one output's validation
    with pytest.raises(OutputValidationError, match="not finite") as info:
        gen("a number")
    assert info.value.text == "1e789"
