"""The pre-flight hears the backend: what xgrammar logs on fd 2 while converting a schema is an
issue of the report (with the keyword's JSON pointer), never raw stderr, and never under
"every keyword is enforced"; the extra keys xgrammar lets through next to patternProperties
cannot carry a value the schema forbids; the coverage benchmark attributes what a declared
pattern-key issue causes.

Each schema here is used by one test only: conversions are cached per schema, and a test that
checks what a first conversion hears must not find it cached by another."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading

import pytest

from constrained_spec.cli import main
from constrained_spec.errors import SchemaError
from constrained_spec.grammar import TokenizerData, compile_spec
from constrained_spec.schemas import JsonLayout, check_schema, normalize_schema, preflight
from constrained_spec.schemas.backend_issues import locate
from constrained_spec.schemas.backend_log import (
    BackendMessage,
    hear_compile,
    hear_conversion,
    parse_log_line,
)
from constrained_spec.schemas.backends import conversion

# the module (the package's attribute of that name is the function)
preflight_module = importlib.import_module("constrained_spec.schemas.preflight")
COMPACT = JsonLayout(separators=(",", ":"))
CHAR_TOK = TokenizerData.from_tokens(["<eos>"] + [chr(c) for c in range(32, 127)], 0)


def overlapping_one_of(title: str) -> dict:
    # 5 matches both branches: oneOf forbids it, anyOf (what xgrammar generates) allows it
    return {"title": title, "type": "object", "properties": {"n": {"oneOf": [
        {"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}}, "required": ["n"]}


def look_ahead_key(title: str) -> dict:
    return {"title": title, "type": "object", "patternProperties": {
        "^(?!x-)[a-z-]+$": {"type": "string"}}, "additionalProperties": False}


@pytest.fixture
def deaf_walker(monkeypatch):
    """The pre-flight's own walker blind to oneOf overlap and to regex constructs: whatever the
    report then says about them came from the backend's log."""
    monkeypatch.setattr(preflight_module._Walker, "oneof", lambda self, node, path: None)
    monkeypatch.setattr(preflight_module, "_regex_issues", lambda *a, **k: [])


# ---- the backend's warnings reach the report --------------------------------------------------

def test_overlapping_one_of_warning_becomes_an_issue_at_its_pointer(deaf_walker):
    spec = normalize_schema(overlapping_one_of("deaf oneOf"), layout=COMPACT)
    report = preflight(spec, "xgrammar")
    assert [(i.keyword, i.pointer, i.level) for i in report.issues] == [
        ("oneOf", "/properties/n/oneOf", "ignored")]
    assert "falling back to anyOf" in report.issues[0].message
    assert "every keyword is enforced" not in report.format()
    with pytest.raises(SchemaError) as refused:
        check_schema(spec, "xgrammar", "strict")
    assert refused.value.pointer == "/properties/n/oneOf"


def test_backend_warning_merges_with_the_walkers_own_issue():
    report = preflight(normalize_schema(overlapping_one_of("merged oneOf")), "xgrammar")
    assert [(i.keyword, i.pointer) for i in report.issues] == [("oneOf", "/properties/n/oneOf")]
    assert "xgrammar warns" not in report.issues[0].message  # the walker's words, said once


def test_look_ahead_warning_names_the_pattern_key(deaf_walker):
    report = preflight(normalize_schema(look_ahead_key("deaf look-ahead")), "xgrammar")
    pointers = {i.pointer: i for i in report.issues}
    issue = pointers["/patternProperties/^(?!x-)[a-z-]+$"]
    assert issue.level == "ignored" and "Lookahead" in issue.message


def test_look_ahead_warning_in_a_pattern_names_the_pattern(deaf_walker):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?!ab)[a-z]+$"}}}
    report = preflight(normalize_schema(schema), "xgrammar")
    assert [(i.keyword, i.pointer) for i in report.issues] == [("pattern", "/properties/s/pattern")]


def test_clean_schema_still_says_every_keyword_is_enforced():
    spec = normalize_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "oneOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["a", "b"]})
    report = preflight(spec, "xgrammar")
    assert report.format() == "xgrammar: every keyword is enforced"
    assert conversion(spec, "xgrammar").heard == ()


def test_disjoint_one_of_reaches_xgrammar_as_any_of_without_a_warning():
    # xgrammar proves only branches with nothing but a "type" disjoint: these it would warn about
    schema = {"oneOf": [{"type": "string", "minLength": 1}, {"$ref": "#/$defs/N"}],
              "$defs": {"N": {"type": "null"}}}
    import xgrammar

    with hear_conversion("xgrammar", "") as raw:
        xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    assert any("falling back to anyOf" in m.text for m in raw)  # so this test can fail
    spec = normalize_schema(schema)
    assert conversion(spec, "xgrammar").heard == ()
    assert preflight(spec, "xgrammar").format() == "xgrammar: every keyword is enforced"


def test_cache_hit_keeps_the_backend_warnings(deaf_walker):
    spec = normalize_schema(overlapping_one_of("cached oneOf"), layout=COMPACT)
    first = compile_spec(spec, CHAR_TOK)  # converts (and caches the conversion) first
    assert any("falling back to anyOf" in m.text for m in first.backend_warnings)
    expected = [("oneOf", "/properties/n/oneOf", "ignored")]
    for _ in range(2):  # both pre-flights read the cached conversion
        assert [(i.keyword, i.pointer, i.level) for i in preflight(spec).issues] == expected
    again = compile_spec(spec, CHAR_TOK)
    assert again is first and again.backend_warnings == first.backend_warnings


# ---- nothing leaks, nothing else is lost ------------------------------------------------------

def test_schema_check_prints_the_warning_as_a_report_line_not_raw_stderr(capfd):
    schema = json.dumps(overlapping_one_of("schema-check oneOf"))
    assert main(["schema-check", schema]) == 0
    out, err = capfd.readouterr()
    assert "ignored: oneOf at /properties/n/oneOf" in out
    assert "every keyword is enforced" not in out
    assert "Warning:" not in err and ".cc:" not in err


def test_compile_and_preflight_leak_no_backend_line_to_stderr(capfd):
    spec = normalize_schema(look_ahead_key("leak look-ahead"), layout=COMPACT)
    preflight(spec, "xgrammar")
    compile_spec(spec, CHAR_TOK)
    assert ".cc:" not in capfd.readouterr().err


def test_other_stderr_output_inside_a_window_is_passed_on(capfd):
    with hear_conversion("xgrammar", "") as heard:
        print("a line of our own", file=sys.stderr, flush=True)
        os.write(2, b"[12:00:00] /x/fsm_builder.cc:1: Warning: made up\n")
    assert [m.text for m in heard] == ["made up"]
    err = capfd.readouterr().err
    assert "a line of our own" in err and "made up" not in err


def test_megabytes_written_inside_a_window_never_block():
    # a pipe would fill at 64 KiB and block the writer (the compile) forever
    blob = b"x" * 4_000_000 + b"\n"
    with hear_conversion("xgrammar", "") as heard:
        for _ in range(3):
            os.write(2, blob)
        os.write(2, b"[12:00:00] /x/a.cc:2: Warning: after the flood\n")
    assert [m.text for m in heard] == ["after the flood"]


def test_concurrent_sessions_keep_only_their_own_regex_warnings():
    import xgrammar

    def schema(pattern: str) -> str:
        return json.dumps({"type": "string", "pattern": pattern})

    a, b = schema("^(?!aaa)[a-z]+$"), schema("^(?!bbb)[0-9]+$")
    other: list[BackendMessage] = []

    def convert_b() -> None:
        with hear_conversion("xgrammar", b) as heard:
            xgrammar.Grammar.from_json_schema(b)
        other.extend(heard)

    with hear_compile("xgrammar", a) as mine:
        worker = threading.Thread(target=convert_b)
        worker.start()
        worker.join()  # b's warning lands in a's window too
        xgrammar.Grammar.from_json_schema(a)
    assert [m.text.rsplit(": ", 1)[1] for m in mine] == ["^(?!aaa)[a-z]+$"]
    assert [m.text.rsplit(": ", 1)[1] for m in other] == ["^(?!bbb)[0-9]+$"]


def test_log_lines_are_parsed_and_placed():
    line = ("[12:16:13] /project/cpp/json_schema_converter.cc:870: Warning: oneOf with overlapping "
            "or non-provably-disjoint branches cannot be represented exactly; falling back to "
            "anyOf semantics")
    message = parse_log_line(line)
    assert message is not None and message.level == "warning"
    assert message.source == "json_schema_converter.cc:870"
    assert parse_log_line("an ordinary line") is None
    schema = {"type": "object", "properties": {
        "a": {"type": "number", "multipleOf": 0.5},
        "b": {"type": "string", "pattern": "a\\qb"}}}
    said = {
        "multipleOf is not supported for type:number; ignoring multipleOf":
            [("multipleOf", "/properties/a/multipleOf")],
        "Escape sequence \\q is not recognized in regex; matching the character literally":
            [("pattern", "/properties/b/pattern")],
        "pattern combined with minLength/maxLength is not supported; ignoring minLength": [],
        "something xgrammar never said before": [],
    }
    for text, places in said.items():
        assert locate(BackendMessage("xgrammar", "warning", "x.cc:1", text), schema) == places


def test_length_warning_is_placed_at_the_lengths_next_to_a_pattern():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
        "b": {"type": "string", "maxLength": 4},
        "c": {"not": {"type": "string", "pattern": "^x", "minLength": 2}}}}  # never read
    message = BackendMessage("xgrammar", "warning", "json_schema_converter.cc:1",
                             "pattern combined with minLength/maxLength is not supported")
    assert locate(message, schema) == [("maxLength", "/properties/a/maxLength")]


def test_unplaced_warning_is_an_issue_at_the_root():
    report = preflight_module.PreflightReport(backend="xgrammar")
    preflight_module._add_heard(
        report, [BackendMessage("xgrammar", "warning", "x.cc:1", "something new")], {})
    assert [(i.pointer, i.level) for i in report.issues] == [("", "ignored")]
    assert "every keyword is enforced" not in report.format()


# ---- avro_name: a pattern key's value through the extra keys ----------------------------------

def node_schema(title: str, extra) -> dict:
    node = {"type": "object", "properties": {"name": {"type": "string"}},
            "patternProperties": {"^avro_name$": {"oneOf": [{"type": "string"}, {"type": "null"}]}}}
    if extra is not None:
        node["additionalProperties"] = extra
    return {"title": title, "type": "object", "definitions": {"Node": node},
            "properties": {"nodes": {"type": "array", "items": {"$ref": "#/definitions/Node"}}}}


@pytest.mark.parametrize("extra", [True, {}, {"description": "anything"}])
def test_pattern_key_value_cannot_come_through_extra_keys(extra):
    spec = normalize_schema(node_schema(f"avro {extra!r}", extra), layout=COMPACT)
    assert preflight(spec).ok
    matcher = compile_spec(spec, CHAR_TOK).new_matcher()
    assert not matcher.accepts_text('{"nodes":[{"avro_name":123}]}')
    assert not matcher.accepts_text('{"nodes":[{"name":123}]}')
    for value in ('"x"', "null"):
        assert matcher.accepts_text('{"nodes":[{"avro_name":%s}]}' % value)


def test_extra_keys_with_a_schema_of_their_own_are_declared_at_each_key():
    spec = normalize_schema(node_schema("avro integer extras", {"type": "integer"}), layout=COMPACT)
    report = preflight(spec)
    assert {(i.pointer, i.level) for i in report.issues} == {
        ("/definitions/Node/properties/name", "ignored"),
        ("/definitions/Node/patternProperties/^avro_name$", "ignored")}
    # what the declaration is about: xgrammar does accept it
    assert compile_spec(spec, CHAR_TOK).new_matcher().accepts_text('{"nodes":[{"avro_name":123}]}')


def test_property_names_extra_keys_are_declared_at_the_names_they_admit():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "ID": {"type": "string"}},
              "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}}
    report = preflight(normalize_schema(schema))
    assert [i.pointer for i in report.issues] == ["/properties/name"]


# ---- the coverage benchmark ------------------------------------------------------------------

def test_extra_keys_error_caused_by_a_declared_pattern_key_is_declared():
    from benchmarks.coverage import Prepared, classify

    schema = look_ahead_key("coverage look-ahead")
    spec = normalize_schema(schema)
    report = preflight(spec)
    instance = {"x-a": "v"}  # excluded by the look-ahead, so additionalProperties: false refuses it
    text = JsonLayout().dumps(instance)
    assert compile_spec(spec, CHAR_TOK).new_matcher().accepts_text(text)  # xgrammar lets it by
    prep = Prepared(schema, [{"valid": False, "data": instance}])
    counts = classify(prep, [True], [i.pointer for i in report.ignored])
    assert (counts["declared"], counts["silent"]) == (1, 0)
    assert classify(prep, [True], [])["silent"] == 1  # undeclared, it would be silently wrong


# ---- two pattern keys for one name ------------------------------------------------------------

def test_name_matching_two_pattern_keys_is_declared_at_both():
    schema = {"type": "object", "patternProperties": {
        "^avro_name$": {"oneOf": [{"type": "string"}, {"type": "null"}]},
        "^[a-z_]+$": {"type": "integer"}}}
    spec = normalize_schema(schema, layout=COMPACT)
    # what is declared: xgrammar writes avro_name with the integer schema's value
    assert compile_spec(spec, CHAR_TOK).new_matcher().accepts_text('{"avro_name":123}')
    report = preflight(spec)
    assert {(i.pointer, i.level) for i in report.issues} == {
        ("/patternProperties/^avro_name$", "ignored"), ("/patternProperties/^[a-z_]+$", "ignored")}


@pytest.mark.parametrize("keys", [("^x-", "^y-"), ("^[0-9]+$", "^[a-z]+$"), ("^a{3}$", "^a{2}$")])
def test_disjoint_pattern_keys_are_not_reported(keys):
    schema = {"type": "object", "patternProperties": {
        keys[0]: {"type": "string"}, keys[1]: {"type": "integer"}}}
    assert preflight(normalize_schema(schema)).ok


# ---- a schema reached only through a $ref into a non-schema container ------------------------

def test_schema_reached_only_through_a_ref_is_rewritten_too():
    # "misc" is not a schema keyword: only the $ref makes "date" / "start" schemas, and the
    # backend converts them, so they need the same rewrites (exact dates, search semantics)
    schema = {"type": "object", "required": ["d", "p"], "properties": {
        "d": {"$ref": "#/definitions/misc/date"}, "p": {"$ref": "#/definitions/misc/start"}},
        "definitions": {"misc": {"date": {"type": "string", "format": "date"},
                                 "start": {"type": "string", "pattern": "^ab"}}}}
    spec = normalize_schema(schema, layout=COMPACT)
    assert preflight(spec).ok
    matcher = compile_spec(spec, CHAR_TOK).new_matcher()
    assert not matcher.accepts_text('{"d":"2020-02-30","p":"abc"}')  # no Feb 30
    assert matcher.accepts_text('{"d":"2020-02-28","p":"abc"}')  # "^ab" searches, not whole


def test_disjoint_one_of_behind_a_ref_into_a_container_raises_no_warning():
    schema = {"$ref": "#/definitions/misc/text", "definitions": {"misc": {"text": {"oneOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}}]}}}}
    spec = normalize_schema(schema)
    assert conversion(spec, "xgrammar").heard == ()
    assert preflight(spec).format() == "xgrammar: every keyword is enforced"
