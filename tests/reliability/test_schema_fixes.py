"""Regressions for defects the JSONSchemaBench sweep found in the grammar layer: each one let
the matcher accept an instance the schema forbids, refuse one it allows, or crash."""

from __future__ import annotations

import json

import pytest

from constrained_spec.errors import SchemaError
from constrained_spec.grammar import compile_spec
from constrained_spec.schemas import JsonLayout, normalize_schema, preflight


def matcher(schema, tok, backend="xgrammar", layout=None):
    return compile_spec(normalize_schema(schema, layout=layout or JsonLayout()), tok,
                        backend=backend).new_matcher()


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_format_date_is_calendar_exact(ascii_tok, backend):
    m = matcher({"type": "string", "format": "date"}, ascii_tok, backend)
    ok = ["2024-02-29", "2000-02-29", "1999-12-31", "0001-01-01"]
    bad = ["2023-02-29", "1900-02-29", "2022-04-31", "2022-02-30", "0000-01-01", "2022-13-01"]
    assert all(m.accepts_text(json.dumps(d)) for d in ok)
    assert not any(m.accepts_text(json.dumps(d)) for d in bad)


def test_format_date_time_is_calendar_exact_on_xgrammar(ascii_tok):
    m = matcher({"type": "string", "format": "date-time"}, ascii_tok)
    assert m.accepts_text('"2024-02-29T23:59:60.25+01:00"')
    assert not m.accepts_text('"2023-02-29T10:00:00Z"')
    assert not m.accepts_text('"2023-01-01T10:00:00"')  # RFC 3339 needs the offset


def test_date_format_next_to_a_pattern_is_declared(ascii_tok):
    issues = preflight(normalize_schema({"type": "string", "format": "date", "pattern": "^2"}))
    assert ("format", "/format") in {(i.keyword, i.pointer) for i in issues.ignored}


def test_integer_bounds_past_64_bits_are_clamped_not_refused(ascii_tok):
    m = matcher({"type": "integer", "minimum": -1e30, "maximum": 9223372036854776000}, ascii_tok)
    assert m.accepts_text("9223372036854775807") and m.accepts_text("-9223372036854775808")
    assert not m.accepts_text("9223372036854775808")  # narrowed, never wider


def test_an_integer_range_wholly_past_64_bits_is_refused_by_pointer_or_validated_after(ascii_tok):
    """xgrammar raised its internal "Check failed: (val <= MAX_INT64_AS_DOUBLE)" here."""
    from pydantic import BaseModel, Field

    from constrained_spec.errors import OutputValidationError
    from constrained_spec.schemas import check_schema, parse_output

    class Big(BaseModel):
        n: int = Field(ge=2 ** 70)

    with pytest.raises(SchemaError, match="64-bit") as info:
        check_schema(normalize_schema(Big), "xgrammar")
    assert info.value.pointer == "/properties/n/minimum" and "Check failed" not in str(info.value)
    with pytest.warns(UserWarning, match="64-bit"):  # lenient: generated unbounded, checked after
        spec = normalize_schema(Big)
        check_schema(spec, "xgrammar", "lenient")
    m = compile_spec(spec, ascii_tok).new_matcher()
    assert m.accepts_text('{"n": 5}')
    with pytest.raises(OutputValidationError):
        parse_output(spec, '{"n": 5}')
    assert parse_output(spec, '{"n": %d}' % 2 ** 71).n == 2 ** 71


def test_draft4_boolean_exclusive_bounds(ascii_tok):
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
              "minimum": 0, "exclusiveMinimum": True, "maximum": 10, "exclusiveMaximum": False}
    m = matcher(schema, ascii_tok)
    assert [m.accepts_text(t) for t in ("0", "1", "10", "11")] == [False, True, True, False]


@pytest.mark.parametrize("layout", [JsonLayout(), JsonLayout(indent=2)])
def test_object_and_array_const_and_enum_follow_the_layout(ascii_tok, layout):
    schema = {"type": "object", "required": ["c", "e"], "properties": {
        "c": {"const": {"a": [1, {"b": None}], "s": "x"}},
        "e": {"enum": [[1, 2], {"k": "v"}, "plain"]}}}
    m = matcher(schema, ascii_tok, layout=layout)
    for e in ([1, 2], {"k": "v"}, "plain"):
        assert m.accepts_text(layout.dumps({"c": {"a": [1, {"b": None}], "s": "x"}, "e": e}))
    assert not m.accepts_text(layout.dumps({"c": {"a": [1], "s": "x"}, "e": "plain"}))


@pytest.mark.parametrize("pattern, ok, bad", [
    ("^x(-[a-z]+)?$", ["x", "x-ab"], ["xa", "xab", "x-"]),
    ("^(-[a-z]+)?(-[0-9]+)?$", ["", "-ab", "-1", "-a-1"], ["ab", "properties", "a-1"]),
    ("^v(\\.[0-9]+)??$", ["v", "v.1"], ["v1"]),
])
def test_optional_groups_in_patterns_are_not_skipped(ascii_tok, pattern, ok, bad):
    m = matcher({"type": "string", "pattern": pattern}, ascii_tok)
    assert all(m.accepts_text(json.dumps(s)) for s in ok)
    assert not any(m.accepts_text(json.dumps(s)) for s in bad)


def test_optional_groups_in_pattern_property_names_are_not_skipped(ascii_tok):
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^[a-z]{2}(-[A-Z]{2})?$": {"type": "string"}}}
    m = matcher(schema, ascii_tok)
    assert m.accepts_text('{"en": "x", "en-GB": "y"}')
    assert not m.accepts_text('{"properties": "x"}')


def test_schema_document_limits_name_the_place():
    with pytest.raises(SchemaError) as info:
        normalize_schema({"type": "object", "properties": {"a": {"enum": [float("nan")]}}})
    assert info.value.pointer == "/properties/a/enum/0"
    with pytest.raises(SchemaError) as info:
        normalize_schema({"type": "object", "properties": {"a": {"default": {1, 2}}}})
    assert info.value.pointer == "/properties/a/default"


FORMATS = ["date", "date-time", "time", "ipv4", "ipv6", "uuid", "email", "hostname", "uri",
           "uri-reference", "uri-template", "duration", "json-pointer", "relative-json-pointer"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_strings_the_grammar_writes_for_a_format_pass_final_validation(ascii_tok, fmt):
    """Random walks through the grammar (uniform over allowed tokens) until it may end: the
    output must pass final validation, or the grammar is looser than the checker (xgrammar's
    ipv4 allowed "10.0.0.01", which Python's ipaddress refuses)."""
    import random

    import torch

    from constrained_spec.errors import OutputValidationError
    from constrained_spec.schemas import parse_output

    spec = normalize_schema({"type": "string", "format": fmt})
    compiled = compile_spec(spec, ascii_tok)
    rng = random.Random(fmt)
    words = (ascii_tok.vocab_size + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    failures = []
    for _ in range(40):
        m, text = compiled.new_matcher(), []
        for _ in range(80):
            m.fill_bitmask(bitmask)
            allowed = [i for i in range(ascii_tok.vocab_size) if (int(bitmask[0, i >> 5]) >> (i & 31)) & 1]
            if 0 in allowed and (len(allowed) == 1 or (len(text) > 8 and rng.random() < 0.3)):
                break
            token = rng.choice([t for t in allowed if t != 0])
            assert m.accept(token)
            text.append(ascii_tok.decoded[token].decode())
        else:
            continue
        try:
            parse_output(spec, "".join(text))
        except OutputValidationError:
            failures.append("".join(text))
    assert not failures, failures[:5]


def test_all_of_with_a_fixed_set_of_values_becomes_their_exact_enum(ascii_tok):
    """xgrammar generates any value for several-subschema allOf; when a member is an enum /
    const, the values the whole allOf accepts are generated instead (and nothing is declared)."""
    schema = {"$defs": {"e": {"enum": ["ab", "abcd", 3, {"k": 1}]}},
              "allOf": [{"$ref": "#/$defs/e"}, {"not": {"type": "integer"}},
                        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "object"}]}]}
    assert preflight(normalize_schema(schema)).ok
    m = matcher(schema, ascii_tok)
    assert [m.accepts_text(t) for t in ('"ab"', '{"k": 1}', '"abcd"', "3", '"x"')] == [
        True, True, False, False, False]
    unsatisfiable = {"allOf": [{"enum": [1]}, {"not": {"enum": [1]}}]}
    assert "allOf" in {i.keyword for i in preflight(normalize_schema(unsatisfiable)).ignored}


def test_pattern_properties_keys_are_searched_as_json_schema_does(ascii_tok):
    """Github_easy o14471 / o21729 / o37070: "[a-zA-Z]+", "\\w" and "^mode" matched keys whole,
    refusing "Error1", "alias1" and "mode1", which the schema allows."""
    m = matcher({"type": "object", "patternProperties": {"^mode": {"type": "integer"}},
                 "additionalProperties": False}, ascii_tok)
    assert m.accepts_text('{"mode1": 1}') and m.accepts_text('{"mode": 1}')
    assert not m.accepts_text('{"xmode": 1}')  # anchored at the start: still excluded
    assert not m.accepts_text('{"mode1": "x"}')


def test_a_declared_property_a_searched_key_pattern_matches_is_declared(ascii_tok):
    report = preflight(normalize_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                         "patternProperties": {"am": {"type": "integer"}}}))
    assert ("patternProperties", "/properties/name") in {(i.keyword, i.pointer) for i in report.ignored}


def test_a_required_name_not_declared_is_generated_with_the_schema_that_applies(ascii_tok):
    """Github_trivial o2058: required "text" missing from properties was never generated, so
    every output missed it (and the valid instances were refused)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["text"]}
    m = matcher(schema, ascii_tok)
    assert m.accepts_text('{"name": "a", "text": [1]}') and not m.accepts_text('{"name": "a"}')
    assert not preflight(normalize_schema(schema)).issues
    typed = {**schema, "additionalProperties": {"type": "integer"}}
    m = matcher(typed, ascii_tok)
    assert m.accepts_text('{"text": 3}') and not m.accepts_text('{"text": "3"}')
    keyed = {**schema, "patternProperties": {"^te": {"type": "boolean"}}}
    assert matcher(keyed, ascii_tok).accepts_text('{"text": true}')
    untyped = {"properties": {"a": {}}, "required": ["a", "<caret>"]}  # Github_trivial o90933
    assert not matcher(untyped, ascii_tok).accepts_text('{"a": 1}')
    assert matcher(untyped, ascii_tok).accepts_text('{"a": 1, "<caret>": 2}')
    closed = {**schema, "additionalProperties": False}  # unsatisfiable: still declared
    assert [i.pointer for i in preflight(normalize_schema(closed)).ignored] == ["/required"]


@pytest.mark.parametrize("text, valid", [
    ('"a\\nb"', True),            # Github_easy o9772: PEM certificates, "\n" inside maxLength
    ('"\\"\\\\\\/"', True),       # every escape is one character of the decoded string
    ('"\\u00e9\\u0001b"', True),
    ('"a\\n"', False),            # two characters: below minLength
    ('"a\\nb\\nc\\n"', False),    # six characters: past maxLength
    ('"a\tbc"', False),           # a raw tab is not JSON (json.loads refuses it)
])
def test_length_limited_strings_admit_escapes_counted_as_characters(ascii_tok, text, valid):
    """xgrammar's length grammar wrote no escape (valid strings refused) and raw control
    characters (output json.loads refuses); each escape now counts one character."""
    from constrained_spec.schemas import parse_output

    schema = {"type": "string", "minLength": 3, "maxLength": 5}
    assert matcher(schema, ascii_tok).accepts_text(text) is valid
    if valid:
        assert parse_output(normalize_schema(schema), text) == json.loads(text)


def test_a_surrogate_pair_escape_is_not_counted_as_two_characters(ascii_tok):
    # "\ud83d\ude00" is one code point: under minLength 2 it is invalid, so it must be refused
    m = matcher({"type": "string", "minLength": 2}, ascii_tok)
    assert not m.accepts_text('"\\ud83d\\ude00"')
    assert m.accepts_text('"\\u00e9\\u00e9"')


def test_length_limited_strings_inside_objects_admit_escapes(ascii_tok):
    schema = {"type": "object", "properties": {
        "pem": {"type": "string", "minLength": 5, "maxLength": 40},
        "keys": {"type": "object", "propertyNames": {"maxLength": 4},
                 "additionalProperties": {"type": "integer"}}}, "required": ["pem"]}
    m = matcher(schema, ascii_tok)
    assert m.accepts_text('{"pem": "-----\\nAB\\n-----", "keys": {"a\\tb": 1}}')
    assert not m.accepts_text('{"pem": "-----\\nAB\\n-----", "keys": {"a\\tbcd": 1}}')


def test_an_untyped_node_with_object_or_array_keywords_is_reported_narrowed():
    """Github_easy o24467: `properties` without `type` also allows arrays (the test instance
    has one); xgrammar generates an object there. Named in the report, never warned about."""
    import warnings

    from constrained_spec.schemas import check_schema

    spec = normalize_schema({"properties": {"ops": {"items": {"type": "integer"}},
                                            "typed": {"type": "object", "properties": {}}}})
    report = preflight(spec)
    assert {(i.keyword, i.pointer) for i in report.narrowed} == {("type", ""),
                                                                  ("type", "/properties/ops")}
    assert report.ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_schema(spec, "xgrammar")


def test_length_limited_strings_under_hyphenated_definition_names_admit_escapes(ascii_tok):
    # SchemaStore citation-file-format: "$defs"-style names with a hyphen name xgrammar's rules
    schema = {"definitions": {"identifier-description": {"type": "string", "minLength": 1}},
              "type": "object", "properties": {"d": {"$ref": "#/definitions/identifier-description"}}}
    assert matcher(schema, ascii_tok).accepts_text('{"d": "a\\\\b\\n"}')


def test_a_pattern_with_raw_newlines_in_a_class_compiles(ascii_tok):
    """SchemaStore github-workflows: ``(.|[CR LF])*`` with real CR / LF characters; xgrammar's
    lexer refused the schema ("Character class should not contain newline")."""
    m = matcher({"type": "string", "pattern": "^\\$\\{\\{(.|[\r\n])*\\}\\}$"}, ascii_tok)
    assert m.accepts_text('"${{ github.ref }}"')
    assert not m.accepts_text('"${{ x }"')


@pytest.mark.parametrize("pattern, narrowed", [
    ("^[a-z]+$", False), (r"^\d{3}-[\w-]+$", False),
    ("^.+$", True), (r"^\S+$", True), ("[^a]", True), ('^a"b$', True), ("^\\$\\{\\{(.|[\r\n])*\\}\\}$", True),
])
def test_a_pattern_allowing_characters_json_escapes_is_reported_narrowed(ascii_tok, pattern, narrowed):
    """xgrammar's JSON-string patterns write no escape: a value holding a quote, a backslash or
    a newline the pattern allows is never generated (SchemaStore github-workflows). The report
    names it; the grammar refuses such a value and accepts the rest."""
    schema = {"type": "string", "pattern": pattern}
    report = preflight(normalize_schema(schema))
    assert (("pattern", "/pattern", "json-escape") in {
        (i.keyword, i.pointer, i.construct) for i in report.narrowed}) is narrowed
    assert report.ok
    if pattern == "^.+$":
        m = matcher(schema, ascii_tok)
        assert m.accepts_text('"a b"') and not m.accepts_text('"a\\"b"')


def test_a_draft3_schema_inside_a_type_list_is_refused_by_pointer():
    """jsonschema-specifications' draft 3 metaschema: ``"type": ["string", {"$ref": "#"}]``
    raised a TypeError in the xgrammar rewrite instead of a typed refusal."""
    from constrained_spec.schemas import check_schema

    spec = normalize_schema({"$schema": "http://json-schema.org/draft-03/schema#", "type": "object",
                             "properties": {"d": {"type": ["string", {"type": "integer"}]}}})
    with pytest.raises(SchemaError, match="draft 3") as info:
        check_schema(spec, "xgrammar")
    assert info.value.pointer == "/properties/d/type"
