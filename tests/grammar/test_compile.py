"""compile_spec: cached per (spec, tokenizer, backend); errors and timeouts become SchemaError."""

from __future__ import annotations

import time

import pytest

from constrained_spec.errors import SchemaError
from constrained_spec.grammar import TokenizerData, compile_cache_info, compile_spec
from constrained_spec.grammar.matcher import OutlinesMatcher, XGrammarMatcher
from constrained_spec.schemas import Grammar, Regex, normalize_schema

TOK = TokenizerData.from_tokens(["<eos>"] + [chr(c) for c in range(32, 127)], 0)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_compile_cache_hits_for_equal_specs(backend):
    spec = normalize_schema({"type": "object", "properties": {"k": {"type": "boolean"}}})
    first = compile_spec(spec, TOK, backend=backend)
    before = compile_cache_info()
    again = compile_spec(normalize_schema({"type": "object", "properties": {"k": {"type": "boolean"}}}),
                         TOK, backend=backend)
    assert again is first
    assert compile_cache_info()["hits"] == before["hits"] + 1


def test_backends_and_tokenizers_are_separate_cache_entries():
    spec = normalize_schema(Regex("[ab]+"))
    other = TokenizerData.from_tokens(["<eos>", "a", "b", "ab"], 0)
    a = compile_spec(spec, TOK, backend="xgrammar")
    assert compile_spec(spec, TOK, backend="outlines") is not a
    assert compile_spec(spec, other, backend="xgrammar") is not a


def test_new_matcher_type_follows_backend():
    spec = normalize_schema(Regex("a"))
    assert isinstance(compile_spec(spec, TOK).new_matcher(), XGrammarMatcher)
    assert isinstance(compile_spec(spec, TOK, backend="outlines").new_matcher(), OutlinesMatcher)


def test_ebnf_on_outlines_is_a_schema_error():
    with pytest.raises(SchemaError, match="use xgrammar") as info:
        compile_spec(normalize_schema(Grammar('root ::= "a"')), TOK, backend="outlines")
    assert info.value.backend == "outlines"


@pytest.mark.parametrize("backend, pattern", [("xgrammar", r"(?<=a)b"), ("outlines", r"a(?=b)")])
def test_backend_compile_error_becomes_schema_error(backend, pattern):
    with pytest.raises(SchemaError) as info:
        compile_spec(normalize_schema(Regex(pattern)), TOK, backend=backend)
    assert info.value.backend == backend
    # failures are not cached: the same error again, not a stale future
    with pytest.raises(SchemaError):
        compile_spec(normalize_schema(Regex(pattern)), TOK, backend=backend)


def test_compile_timeout_raises_and_a_retry_reuses_the_work():
    props = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{3,{i % 40 + 5}}}$"} for i in range(300)}
    spec = normalize_schema({"type": "object", "properties": props, "required": list(props)})
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match="longer than") as info:
        compile_spec(spec, TOK, timeout_s=1e-4)
    assert time.perf_counter() - t0 < 0.5 and info.value.backend == "xgrammar"
    hits = compile_cache_info()["hits"]
    compiled = compile_spec(spec, TOK, timeout_s=60)  # waits for the compile already running
    assert compile_cache_info()["hits"] == hits + 1
    assert compiled.new_matcher().accepts_text(
        "{" + ", ".join(f'"field_{i}": "abcd"' for i in range(300)) + "}")


def test_unknown_backend_is_rejected():
    with pytest.raises(SchemaError):
        compile_spec(normalize_schema(Regex("a")), TOK, backend="llguidance")
