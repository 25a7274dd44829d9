"""Compiles in child processes (grammar/compile_worker.py): the same grammar as a compile here,
errors typed, a compile past its timeout stopped with its process, children that end with
their parent; and the compile cache bounded in bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from constrained_spec.errors import SchemaError
from constrained_spec.grammar import (
    CompileWorkers,
    TokenizerData,
    clear_compile_cache,
    compile_cache_info,
    compile_spec,
)
from constrained_spec.schemas import Grammar, Regex, normalize_schema
from constrained_spec.settings import overridden

TOK = TokenizerData.from_tokens(["<eos>"] + [chr(c) for c in range(32, 127)] + ["ab", '{"'], 0)
SPECS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                      "n": {"type": "integer"}}, "required": ["name", "n"]},
    Regex(r"[a-c]{2,5}-\d+"),
    ["yes", "no", "maybe"],
    Grammar('root ::= "x" ("y" | "zz")*'),
]
WALKS = ['{"name": "ab", "n": 12}', "abc-42", "maybe", "xyzzy"]


@pytest.fixture(scope="module")
def workers():
    pool = CompileWorkers(processes=2)
    yield pool
    pool.close()


def _masks(compiled, text: str) -> list[list[int]]:
    """The bitmask rows along ``text``, one character token at a time."""
    matcher, rows = compiled.new_matcher(), []
    mask = torch.zeros(1, (TOK.vocab_size + 31) // 32, dtype=torch.int32)
    for ch in text:
        matcher.fill_bitmask(mask, 0)
        rows.append(mask[0].tolist())
        if not matcher.accept(1 + ord(ch) - 32):
            break
    return rows


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize("schema, walk", list(zip(SPECS, WALKS)), ids=["json", "regex", "choice", "ebnf"])
def test_a_compile_in_a_child_is_the_grammar_compiled_here(workers, backend, schema, walk):
    if backend == "outlines" and isinstance(schema, Grammar):
        pytest.skip("EBNF is xgrammar's")
    spec = normalize_schema(schema)
    clear_compile_cache()
    here = compile_spec(spec, TOK, backend=backend)
    clear_compile_cache()
    there = compile_spec(spec, TOK, backend=backend, workers=workers)
    assert there is not here and there.backend == backend
    assert _masks(there, walk) == _masks(here, walk)
    assert there.new_matcher().accepts_text(walk)


def test_a_compile_error_in_a_child_is_the_typed_error_with_its_backend(workers):
    clear_compile_cache()
    spec = normalize_schema(Regex("(?=a)a"))  # a look-ahead: outlines-core cannot build it
    with pytest.raises(SchemaError) as err:
        compile_spec(spec, TOK, backend="outlines", workers=workers)
    assert err.value.backend == "outlines" and "outlines" in str(err.value)
    assert str(err.value).count("(backend outlines)") <= 1


def _pids(pool: CompileWorkers) -> set[int]:
    return {c.proc.pid for idle in pool._idle.values() for c in idle}


def test_a_compile_past_its_timeout_is_stopped_with_its_process():
    pool = CompileWorkers(processes=1)
    try:
        pool.start(TOK)
        (pid,) = _pids(pool)
        clear_compile_cache()
        spec = normalize_schema({"type": "array", "items": {"type": "string", "pattern": "[a-z]+"}})
        with pytest.raises(SchemaError, match="was stopped"):
            compile_spec(spec, TOK, timeout_s=1e-4, workers=pool)  # no compile is that fast
        deadline = time.monotonic() + 30
        while pool.killed == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.killed == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the child is gone, and with it the compile's CPU and memory
        assert compile_cache_info()["size"] == 0  # a stopped compile is not cached
        # the next compile runs in the successor
        compiled = compile_spec(spec, TOK, timeout_s=60, workers=pool)
        assert compiled.new_matcher().accepts_text('["ab"]')
        assert _pids(pool) and pid not in _pids(pool)
    finally:
        pool.close()


def test_a_compile_child_ends_when_its_parent_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from constrained_spec.grammar import CompileWorkers, TokenizerData
        pool = CompileWorkers(1)
        pool.start(TokenizerData.from_tokens(["<eos>", "a", "b"], 0))
        print(next(iter(pool._idle.values()))[0].proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # reap it if it is ours (it is not: its parent was killed), else just wait
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the compile child outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_compile_cache_is_bounded_in_bytes():
    clear_compile_cache()
    specs = [normalize_schema(Regex(f"[a-z]{{{n}}}x")) for n in range(1, 6)]
    with overridden(compile_cache_mb=0):
        compile_spec(specs[0], TOK)
        assert compile_cache_info()["size"] == 0  # 0 keeps none
    for spec in specs:
        compile_spec(spec, TOK)
    info = compile_cache_info()
    assert info["size"] == len(specs) and info["bytes"] > 0
    one = info["bytes"] // len(specs)
    with overridden(compile_cache_mb=1):
        # past a bound, the least recently used go first: fill 1 MiB with fresh grammars
        n = 2 + (1 << 20) // max(one, 1)
        for i in range(min(n, 400)):
            compile_spec(normalize_schema(Regex(f"y{{{i + 1}}}[a-z]")), TOK)
        assert compile_cache_info()["bytes"] <= 1 << 20
    clear_compile_cache()


AMBIGUOUS = Regex(r"(\w{1,20} ?){1,50}")  # 0.7 s of CPU for the mask after "hello"


def test_an_ambiguous_grammar_is_refused_where_it_compiles(embedded):
    tok = embedded.tokenizer_data
    clear_compile_cache()
    with pytest.raises(SchemaError, match="too ambiguous for its matcher"):
        compile_spec(normalize_schema(AMBIGUOUS), tok)  # in a thread here
    pool = CompileWorkers(processes=1)
    try:
        with pytest.raises(SchemaError, match="too ambiguous for its matcher"):
            compile_spec(normalize_schema(AMBIGUOUS), tok, workers=pool)  # in the child
        # an unambiguous one of the same length is served, in the same child
        fine = compile_spec(normalize_schema(Regex(r"[a-z]{1,20}( [a-z]{1,20}){0,49}")), tok,
                            workers=pool)
        assert fine.new_matcher().accepts_text("hello world")
    finally:
        pool.close()
