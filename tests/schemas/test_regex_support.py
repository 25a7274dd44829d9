"""Regex constructs per backend: the measured table stays true, the pre-flight report names
every construct a backend mishandles (with its pointer), strict mode refuses it, and whatever
a lenient grammar lets through is still judged by Python's re at final validation."""

from __future__ import annotations

import json
import warnings

import pytest

from constrained_spec.errors import OutputValidationError, SchemaError
from constrained_spec.grammar import compile_spec
from constrained_spec.grammar.regex_probe import (
    PROBES,
    _spec_and_text,
    measure_regex_support,
    probe_tokenizer,
)
from constrained_spec.schemas import Regex, check_schema, normalize_schema, parse_output, preflight
from constrained_spec.schemas.backends import FORMAT_PATTERNS
from constrained_spec.schemas.patterns import REGEX_FEATURES, regex_features
from constrained_spec.schemas.support import REGEX_CONTEXTS, REGEX_SUPPORT

# SchemaStore's pattern for Python identifiers (keywords excluded by a negative look-ahead)
IDENTIFIER = (r"^(?!(False|None|True|and|as|assert|async|await|break|class|continue|def|del|elif"
              r"|else|except|finally|for|from|global|if|import|in|is|lambda|nonlocal|not|or|pass"
              r"|raise|return|try|while|with|yield)$)[a-zA-Z_][\w]*$")


@pytest.fixture(scope="module")
def tok():
    return probe_tokenizer()


def quiet_check(spec, backend, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_schema(spec, backend, mode)


def test_measured_regex_support_matches_the_table(tok):
    """Fails when a backend (or one of our rewrites) changes what it does with a construct:
    then update support.REGEX_SUPPORT (``python -m constrained_spec.grammar.regex_probe``)."""
    measured = measure_regex_support(tok)
    changed = {f"{feature} / {backend} / {context}: table {REGEX_SUPPORT[feature][backend][context]}, "
               f"measured {status}"
               for feature, row in measured.items() for backend, cells in row.items()
               for context, status in cells.items()
               if REGEX_SUPPORT[feature][backend][context] != status}
    assert not changed, sorted(changed)


def test_every_feature_has_a_probe_a_name_and_a_table_row():
    assert set(PROBES) == set(REGEX_FEATURES) == set(REGEX_SUPPORT)
    for row in REGEX_SUPPORT.values():
        assert {b: tuple(c) for b, c in row.items()} == REGEX_CONTEXTS


@pytest.mark.parametrize("feature", sorted(PROBES))
def test_regex_features_finds_each_probed_construct(feature):
    for probe in PROBES[feature]:
        assert feature in regex_features(probe.pattern), probe.pattern


@pytest.mark.parametrize("pattern", [r"^[a-z]+$", r"a+?b*?", r"\++[+]{2}", r"^a$|^b$", r"x{2,3}y",
                                     r"(?:ab)?c", r"[\-.]", r"(?P<n>a)b", r"\$\^"])
def test_plain_patterns_have_no_flagged_construct(pattern):
    assert regex_features(pattern) == {}


def test_the_library_s_own_format_patterns_use_no_flagged_construct():
    assert {fmt: regex_features(p) for fmt, p in FORMAT_PATTERNS.items()} == {
        fmt: {} for fmt in FORMAT_PATTERNS}


def test_unicode_property_classes_are_refused_up_front_with_the_pointer():
    """Python's re has no \\p{..}: final validation could not check it, so nothing gets that far."""
    with pytest.raises(SchemaError) as info:
        normalize_schema({"type": "object", "properties": {"n": {"type": "string", "pattern": r"^\p{L}+$"}}})
    assert info.value.pointer == "/properties/n/pattern"
    with pytest.raises(SchemaError, match="invalid regular expression"):
        normalize_schema(Regex(r"\p{L}"))


# ---- the SchemaStore regression ------------------------------------------------------------

@pytest.mark.parametrize("schema, pointer", [
    ({"type": "object", "propertyNames": {"pattern": IDENTIFIER}}, "/propertyNames/pattern"),
    ({"type": "object", "patternProperties": {IDENTIFIER: {"type": "string"}},
      "additionalProperties": False}, "/patternProperties/" + IDENTIFIER),
])
def test_identifier_look_ahead_is_declared_refused_in_strict_and_caught_in_lenient(schema, pointer, tok):
    """xgrammar drops the look-ahead (a log line only), so {"class": "x"} was generated though
    the schema forbids it, and the report said nothing about patternProperties keys."""
    spec = normalize_schema(schema)
    report = preflight(spec, "xgrammar")
    named = [i for i in report.ignored if i.construct == "negative-lookahead"]
    assert [i.pointer for i in named] == [pointer]
    assert "negative look-ahead '(?!(False|None" in named[0].message

    with pytest.raises(SchemaError) as info:
        quiet_check(spec, "xgrammar", "strict")
    assert info.value.pointer == pointer and "look-ahead" in str(info.value)
    assert "mode='lenient'" in str(info.value)  # what to do

    quiet_check(spec, "xgrammar", "lenient")
    matcher = compile_spec(spec, tok).new_matcher()
    assert matcher.accepts_text('{"class": "x"}')  # the grammar lets it through ...
    with pytest.raises(OutputValidationError):
        parse_output(spec, '{"class": "x"}')  # ... and final validation refuses it
    assert parse_output(spec, '{"klass": "x"}') == {"klass": "x"}


def test_anchors_inside_a_look_ahead_are_part_of_the_look_ahead():
    issues = preflight(normalize_schema({"type": "string", "pattern": IDENTIFIER}), "xgrammar").issues
    assert "inner-anchor" not in {i.construct for i in issues}


# ---- every construct, every context ------------------------------------------------------------

def _contexts():
    for feature, row in REGEX_SUPPORT.items():
        for backend, cells in row.items():
            for context, status in cells.items():
                yield feature, backend, context, status


@pytest.mark.parametrize("feature, backend, context, status", list(_contexts()))
def test_report_names_each_mishandled_construct_where_it_sits(feature, backend, context, status):
    probe = next(p for p in PROBES[feature] if p.contexts is None or context in p.contexts)
    spec, _ = _spec_and_text(probe.pattern, context, "a")
    pointer = {"regex": "", "pattern": "/pattern", "propertyNames": "/propertyNames/pattern",
               "patternProperties": "/patternProperties/" + probe.pattern.replace("~", "~0")
               .replace("/", "~1")}[context]
    found = {(i.pointer, i.level) for i in preflight(spec, backend).issues if i.construct == feature}
    level = {"enforced": None, "narrowed": "narrowed", "ignored": "ignored", "wrong": "unsupported",
             "unsupported": "unsupported"}[status]
    assert found == ({(pointer, level)} if level else set())


@pytest.mark.parametrize("feature, backend, context",
                         [(f, b, c) for f, b, c, s in _contexts() if s in ("ignored", "wrong")])
def test_lenient_grammar_leaks_never_pass_final_validation(feature, backend, context, tok):
    """A string Python rejects that the grammar accepts becomes OutputValidationError."""
    leaked = 0
    for probe in PROBES[feature]:
        if probe.contexts is not None and context not in probe.contexts:
            continue
        for text in probe.reject:
            spec, written = _spec_and_text(probe.pattern, context, text)
            quiet_check(spec, backend, "lenient")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                matcher = compile_spec(spec, tok, backend=backend).new_matcher()
            if matcher.accepts_text(written):
                leaked += 1
                with pytest.raises(OutputValidationError):
                    parse_output(spec, written)
    assert leaked, "the table says the grammar lets invalid strings through; the probe found none"


@pytest.mark.parametrize("feature, backend, context",
                         [(f, b, c) for f, b, c, s in _contexts() if s in ("ignored", "wrong", "unsupported")])
def test_strict_mode_refuses_each_mishandled_construct_with_its_pointer(feature, backend, context):
    probe = next(p for p in PROBES[feature] if p.contexts is None or context in p.contexts)
    spec, _ = _spec_and_text(probe.pattern, context, "a")
    with pytest.raises(SchemaError) as info:
        quiet_check(spec, backend, "strict")
    assert info.value.pointer is not None


def test_narrowing_constructs_are_reported_but_never_warned_or_refused():
    spec = normalize_schema({"type": "string", "pattern": r"^\d{4}$"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = check_schema(spec, "xgrammar", "strict")
    assert report.ok and [i.construct for i in report.narrowed] == ["digit"]
    assert json.dumps(report.format()).count("narrowed") == 1
