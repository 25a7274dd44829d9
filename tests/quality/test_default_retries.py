"""Retries are on by default (``DEFAULT_MAX_RETRIES``) and change only outputs that failed.

- a greedy request that completes on its first attempt gives the same token ids with the
  default options as with ``max_retries=0`` (a retry runs only after a failed attempt);
- a request that runs out of ``max_tokens`` or loops is retried by default: ``attempts`` and
  the summed stats count every attempt, ``failed_attempts`` holds the failed ones' errors;
- ``max_retries=0`` is plain single-attempt decoding;
- streaming (``on_tokens``) turns the default off, an explicit count with it is refused;
  ``on_progress`` counts tokens without turning retries off.
"""

from __future__ import annotations

import json

import pytest
from cs_testlib import bigram_loaded

from constrained_spec import (
    ConfigError,
    GenerationResult,
    Generator,
    IncompleteOutputError,
    generate,
)
from constrained_spec.api import DEFAULT_MAX_RETRIES

STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                 "additionalProperties": False}
# on the tiny random model at 16 tokens: the object runs out of max_tokens, the others complete
MIXED_SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
     "required": ["n", "s"]},
    {"type": "string"},
    ["red", "green", "blue"],
    {"type": "array", "items": {"type": "string"}},
]


@pytest.fixture(scope="module")
def looping():
    """Inside a string: a -> b -> a -> ... (5); the closing quote comes second (3)."""
    return bigram_loaded({('"', "a"): 5, ("a", "b"): 5, ("b", "a"): 5, ("a", '"'): 3, ("b", '"'): 3})


def test_default_retries_leave_greedy_first_attempt_outputs_token_identical(tiny_loaded):
    gen = Generator(tiny_loaded, max_tokens=16)
    prompts = [f"item {i}" for i in range(len(MIXED_SCHEMAS))]
    single = gen.batch(prompts, schemas=MIXED_SCHEMAS, return_result=True, max_retries=0)
    default = gen.batch(prompts, schemas=MIXED_SCHEMAS, return_result=True)
    completed = [i for i, r in enumerate(single) if isinstance(r, GenerationResult)]
    failed = [i for i, r in enumerate(single) if isinstance(r, IncompleteOutputError)]
    assert completed and failed and len(completed) + len(failed) == len(prompts)
    for i in completed:
        assert isinstance(default[i], GenerationResult)
        assert default[i].token_ids == single[i].token_ids
        assert default[i].attempts == 1 and default[i].failed_attempts == []
    for i in failed:
        assert single[i].attempts == 1
        # retried by default until one attempt completes or the retries run out
        retried = default[i]
        assert 2 <= retried.attempts == retried.stats.attempts <= DEFAULT_MAX_RETRIES + 1
        assert isinstance(retried, GenerationResult) or retried.attempts == DEFAULT_MAX_RETRIES + 1
        assert len(retried.failed_attempts) == retried.attempts - 1
        assert retried.failed_attempts[0].token_ids == single[i].token_ids  # the greedy attempt


def test_a_looping_request_is_retried_by_default_and_max_retries_0_turns_it_off(looping):
    res = generate(looping, "x", schema=STRING_SCHEMA, max_tokens=30, return_result=True)
    assert 2 <= res.attempts <= DEFAULT_MAX_RETRIES + 1 and res.stats.attempts == res.attempts
    assert json.loads(res.text) == res.value
    assert len(res.failed_attempts) == res.attempts - 1
    assert all("ababab" in e.partial_text for e in res.failed_attempts)
    with pytest.raises(IncompleteOutputError) as info:
        generate(looping, "x", schema=STRING_SCHEMA, max_tokens=30, max_retries=0)
    assert info.value.attempts == 1 and info.value.failed_attempts == []


def test_streaming_turns_the_default_off_and_refuses_an_explicit_count(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30)
    streamed: list[int] = []
    [out] = gen.batch(["x"], on_tokens=lambda i, toks: streamed.extend(toks))
    assert isinstance(out, IncompleteOutputError) and out.attempts == 1
    assert streamed == out.token_ids  # one attempt streamed, nothing else
    with pytest.raises(ConfigError) as info:
        gen.batch(["x"], on_tokens=lambda i, toks: None, max_retries=1)
    assert info.value.option == "max_retries"
    [out] = gen.batch(["x"], on_tokens=lambda i, toks: None, max_retries=0)  # explicit 0: fine
    assert isinstance(out, IncompleteOutputError)


def test_on_progress_counts_every_attempt_s_tokens_and_keeps_the_default_retries(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30)
    counted: list[int] = []
    [res] = gen.batch(["x"], return_result=True, on_progress=counted.append)
    assert isinstance(res, GenerationResult) and res.attempts >= 2
    assert sum(counted) == res.stats.emitted_tokens
