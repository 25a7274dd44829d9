"""Structural tags: free text with tagged segments, each validated against its own schema
(constrained_spec/schemas/structural.py). The grammar and the reading of outputs on strings; generation on the
embedded model (greedy identity with speculation on and off, the constant tags drafted)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from constrained_spec import StructuralTag, Tag, TaggedText
from constrained_spec.errors import OutputValidationError, SchemaError
from constrained_spec.schemas import Regex, normalize_schema, parse_output
from constrained_spec.schemas.validate import _grammar_accepts


class Weather(BaseModel):
    city: str
    unit: str


CALL = '<function=get_weather>{"city": "Paris", "unit": "C"}</function>'
WEATHER = StructuralTag(tags=[Tag("<function=get_weather>", Weather, "</function>")],
                        triggers=["<function="])

# the same tag as clients send it: vLLM / SGLang's legacy shape and xgrammar's format tree
LEGACY = {"type": "structural_tag", "triggers": ["<function="],
          "structures": [{"begin": "<function=get_weather>", "end": "</function>",
                          "schema": Weather.model_json_schema()}]}
FORMAT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<function="],
    "tags": [{"type": "tag", "begin": "<function=get_weather>", "end": "</function>",
              "content": {"type": "json_schema", "json_schema": Weather.model_json_schema()}}]}}


@pytest.mark.parametrize("tag", [WEATHER, StructuralTag.from_dict(LEGACY),
                                 StructuralTag.from_dict(json.dumps(FORMAT))],
                         ids=["python", "legacy", "format"])
def test_free_text_around_a_valid_segment_is_accepted_and_read_back(tag):
    spec = normalize_schema(tag)
    text = f"Let me check. {CALL} Done."
    value = parse_output(spec, text)
    assert isinstance(value, TaggedText) and value.text == text
    (seg,) = value.segments
    assert seg.value in (Weather(city="Paris", unit="C"), {"city": "Paris", "unit": "C"})
    assert text[seg.start:seg.stop] == CALL and value.free_text() == "Let me check.  Done."
    assert _grammar_accepts(spec, "no call at all")


@pytest.mark.parametrize("bad", [
    '<function=get_weather>{"city": "Paris"}</function>',  # a required property missing
    '<function=get_weather>{"city":"Paris","unit":"C"}</function>',  # not our JSON layout
    '<function=get_weather>{"city": "Paris", "unit": "C"}',  # no end marker
    '<function=other>{"city": "Paris", "unit": "C"}</function>',  # the trigger starts no tag
])
def test_the_grammar_refuses_a_broken_segment(bad):
    assert not _grammar_accepts(normalize_schema(WEATHER), f"x {bad}")


def test_an_end_marker_inside_a_json_string_does_not_end_the_segment():
    tag = StructuralTag(tags=[Tag("<a>", {"type": "object", "properties": {"s": {"type": "string"}},
                                          "required": ["s"]}, "</a>")])
    text = '<a>{"s": "x</a>y"}</a> after'
    (seg,) = parse_output(normalize_schema(tag), text).segments
    assert seg.value == {"s": "x</a>y"} and text[seg.stop:] == " after"


def test_a_keyword_the_grammar_does_not_enforce_is_still_validated_per_segment():
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    spec = normalize_schema(StructuralTag(tags=[Tag("<n>", unique, "</n>")]))
    assert parse_output(spec, "<n>[1, 2]</n>").values == [[1, 2]]
    with pytest.raises(OutputValidationError, match="tagged segment '<n>'"):
        parse_output(spec, "ok <n>[1, 1]</n>")


def test_regex_and_choice_segments_are_read_as_text_and_value():
    tag = StructuralTag(tags=[Tag("<date>", Regex(r"\d{4}-\d{2}-\d{2}"), "</date>"),
                              Tag("<yes>", ["yes", "no"], "</yes>")], triggers=["<"])
    value = parse_output(normalize_schema(tag), "on <date>2024-01-31</date>, <yes>no</yes>")
    assert value.values == ["2024-01-31", "no"]


def test_at_least_one_makes_the_output_start_with_a_tag():
    spec = normalize_schema(StructuralTag(tags=WEATHER.tags, triggers=["<function="],
                                          at_least_one=True, stop_after_first=True))
    assert _grammar_accepts(spec, CALL)
    assert not _grammar_accepts(spec, "text first " + CALL)
    assert not _grammar_accepts(spec, CALL + CALL)


@pytest.mark.parametrize("make,match", [
    (lambda: StructuralTag(), "exactly one"),
    (lambda: StructuralTag(tags=[Tag("<a>", {}, "</a>")], format={"type": "any_text"}), "exactly one"),
    (lambda: StructuralTag(tags=[Tag("<a>", {}, "</a>")], triggers=["<b"]), "none of the triggers"),
    (lambda: StructuralTag(tags=[Tag("", {}, "</a>")]), "non-empty"),
    (lambda: StructuralTag.from_dict({"type": "json_schema"}), "'structural_tag'"),
    (lambda: StructuralTag.from_dict({"type": "structural_tag"}), "structures"),
    (lambda: StructuralTag.from_dict({"structures": [{"begin": "<a>"}]}), r"structures\[0\]"),
    (lambda: StructuralTag.from_dict("{not json"), "not valid JSON"),
    (lambda: StructuralTag.from_dict({"format": {}, "extra": 1}), "unknown fields"),
    (lambda: normalize_schema(StructuralTag(tags=[Tag("<a>", {"type": "nope"}, "</a>")])),
     r"tags\[0\]\.schema"),
    (lambda: normalize_schema(StructuralTag(format={"type": "no_such_format"})), "does not compile"),
])
def test_a_bad_structural_tag_is_a_schema_error_saying_where(make, match):
    with pytest.raises(SchemaError, match=match):
        make()


@pytest.mark.model
def test_generation_is_greedy_identical_with_speculation_and_drafts_the_constant_tags(embedded):
    from constrained_spec import generate

    tag = StructuralTag(tags=WEATHER.tags, triggers=["<function="], at_least_one=True,
                        stop_after_first=True)
    prompt = "What is the weather in Paris? Call get_weather with the city."
    off = generate(embedded, prompt, schema=tag, speculative=False, max_tokens=80,
                   return_result=True)
    on = generate(embedded, prompt, schema=tag, max_tokens=80, return_result=True)
    assert on.token_ids == off.token_ids and on.text == off.text
    (call,) = on.value.segments
    assert isinstance(call.value, Weather) and on.text.startswith("<function=get_weather>")
    # the markers and the JSON keys are constant: drafted for free, far fewer forwards than tokens
    assert on.stats.target_forwards < on.stats.emitted_tokens / 2
