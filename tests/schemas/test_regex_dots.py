"""``Regex`` outputs have Python ``re`` semantics: ``.`` matches no newline unless the pattern
says ``(?s)``, on every backend, and final validation is exactly ``re.fullmatch(pattern, out)``.

The backends disagree on ``.`` (xgrammar's matches a newline, Rust's regex under outlines-core
does not), so the pattern a backend is given spells Python's meaning out (`python_regex`).
"""

from __future__ import annotations

import itertools
import re

import pytest
from cs_testlib import bigram_loaded

from constrained_spec import Generator, OutputValidationError, Regex
from constrained_spec.grammar import TokenizerData, compile_spec
from constrained_spec.schemas import normalize_schema, parse_output
from constrained_spec.schemas.patterns import python_regex, search_pattern

# patterns exercising dots in and out of classes, escapes, groups, alternations, quantifiers
# and the DOTALL flag: global, combined with others, scoped on and off
PATTERNS = [
    r".", r"a.c", r".{2,4}", r"a.*", r".+b", r"(.)\n", r"[.]", r"\.", r"\\.", r"[^.]", r"[a.]b",
    r"[\].]", r"[^]a].", r"(a|.)b", r"(?:x.)+", r"a\..", r"(?s).", r"(?s)a.c", r"(?si)a.", r"(?is).",
    r"(?s:.)a.", r"a(?s:.)b", r"(?s)(?-s:.).", r"(?s)a(?-s:.).", r"(?i).b", r"(?i:.)", r".\n.",
    r"(a(.))", r"(?P<x>.)b", r"[\n.].", r"\n|.", r".?", r"\x2e.", r"[\\.]",
]
ALPHABET = ["a", "b", "c", ".", "\n", "x", "\\"]


def strings(max_len: int = 3):
    for n in range(max_len + 1):
        yield from ("".join(p) for p in itertools.product(ALPHABET, repeat=n))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rewritten_pattern_matches_what_python_re_matches(pattern):
    rewritten = python_regex(pattern)
    assert "(?s" not in rewritten and "s)" not in rewritten.replace("\\s)", "")
    for s in strings():
        assert bool(re.fullmatch(rewritten, s)) == bool(re.fullmatch(pattern, s)), (rewritten, s)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_json_search_rewrite_keeps_python_semantics(pattern):
    """A JSON Schema ``pattern`` (jsonschema: ``re.search``) as a whole-string regex."""
    whole = search_pattern(pattern, any_text=r"[\s\S]*")
    for s in strings():
        assert bool(re.fullmatch(whole, s)) == bool(re.search(pattern, s)), (whole, s)


CHAR_TOK = TokenizerData.from_tokens(["<eos>", "a", "b", "c", ".", "\n", "x", "\\"], 0)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
# (other flags and named groups are a backend's own limits, which pre-flight reports)
@pytest.mark.parametrize("pattern", [p for p in PATTERNS if not re.search(r"\(\?[a-z]*i|\(\?P", p)])
def test_backends_accept_exactly_what_python_re_fullmatches(backend, pattern):
    matcher = compile_spec(normalize_schema(Regex(pattern)), CHAR_TOK, backend=backend).new_matcher()
    for s in strings(3):
        assert matcher.accepts_text(s) == bool(re.fullmatch(pattern, s)), repr(s)


def test_final_validation_is_exactly_fullmatch():
    spec = normalize_schema(Regex(r"a.b"))
    assert parse_output(spec, "axb") == "axb"
    with pytest.raises(OutputValidationError):
        parse_output(spec, "a\nb")
    assert parse_output(normalize_schema(Regex(r"(?s)a.b")), "a\nb") == "a\nb"


@pytest.fixture(scope="module")
def newline_lover():
    """A bigram model that, after a newline (the end of its prompt), most wants another newline,
    and after "a" a newline again: unconstrained it writes newlines."""
    return bigram_loaded({("Ċ", "Ċ"): 10.0, ("Ċ", "a"): 5.0, ("a", "Ċ"): 10.0, ("a", "a"): 5.0})


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_dot_regex_output_has_no_newline_and_fullmatches(newline_lover, backend):
    gen = Generator(newline_lover, schema=Regex(r".{10,60}"), backend=backend, system_prompt=False,
                    speculative=False, max_tokens=80)
    for options in ({}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        result = gen("hi", return_result=True, **options)
        assert "\n" not in result.text
        assert re.fullmatch(r".{10,60}", result.text)
    dotall = Generator(newline_lover, schema=Regex(r"(?s).{10,60}"), backend=backend,
                       system_prompt=False, speculative=False, max_tokens=80)
    text = dotall("hi")
    assert "\n" in text and re.fullmatch(r"(?s).{10,60}", text)  # (?s) lets it write newlines
