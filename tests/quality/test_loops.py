"""Repetition-loop detection (``constrained_spec/loops.py``) and its path through the engine and
the public API.

Unit tests run the rule on synthetic token sequences (one id per character): loops inside a
string and across array items fire as soon as the rule is met and not a token earlier;
repetitive but valid outputs (counting numbers, random enum lists, similar objects, a 64-digit
placeholder hash, three identical items) never fire. A brute-force check defines the rule.
End to end, a bigram model that loops inside a JSON string by construction is stopped with
``finish_reason == "loop"`` long before ``max_tokens``, identically with and without
speculation, and the user gets a ``RepetitionLoopError`` (an ``IncompleteOutputError``) that
``max_retries`` cures.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from cs_testlib import CHARS, bigram_llama, bigram_loaded

from constrained_spec import Generator, IncompleteOutputError, RepetitionLoopError, generate
from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.loops import MAX_PERIOD, MIN_LENGTH, MIN_REPEATS, LoopDetector, find_loop
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import normalize_schema


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def fires_at(tokens: list[int], **rule: Any) -> int | None:
    """1-based count of tokens after which the detector reports a loop (None: never)."""
    det = LoopDetector(**rule)
    for n, t in enumerate(tokens, 1):
        if det.push(t) is not None:
            return n
    return None


# -- loops that must be stopped -------------------------------------------------------------------

def test_a_loop_inside_a_string_fires_once_the_span_reaches_min_length():
    prefix = ids('{"order_id": "')
    out = prefix + ids("0123456789" * 30)
    n = fires_at(out)
    assert n == len(prefix) + MIN_LENGTH  # the periodic span is exactly MIN_LENGTH tokens
    loop = find_loop(out)
    assert (loop.period, loop.start, loop.length) == (10, len(prefix), MIN_LENGTH)
    assert loop.repeats == pytest.approx(9.6)


def test_a_loop_across_array_items_fires_after_min_repeats_copies():
    item = ids('{"sku": "A-1", "name": "Stapler", "quantity": 2}, ')  # 50 tokens > MIN_LENGTH / 4
    assert len(item) * MIN_REPEATS > MIN_LENGTH
    prefix = ids('{"items": [')
    out = prefix + item * 8
    loop = find_loop(out)
    assert loop.period == len(item) and loop.start == len(prefix)
    assert fires_at(out) == len(prefix) + MIN_REPEATS * len(item)


def test_the_shortest_period_is_reported():
    loop = find_loop(ids('"version": "1.' + ".1" * 80))
    assert loop.period == 2


def test_periods_longer_than_max_period_are_not_looked_for():
    unit = ids("".join(chr(0x100 + i) for i in range(MAX_PERIOD + 1)))
    assert find_loop(unit * 10) is None
    assert find_loop(unit[:-1] * 10) is not None  # exactly MAX_PERIOD: found


# -- repetitive but valid outputs that must not fire ----------------------------------------------

def test_counting_numbers_do_not_fire():
    assert find_loop(ids(json.dumps(list(range(1, 400))))) is None
    assert find_loop(ids(json.dumps([round(0.5 * i, 1) for i in range(300)]))) is None


def test_random_enum_lists_and_similar_objects_do_not_fire():
    rng = random.Random(0)
    colours = json.dumps([rng.choice(["red", "green", "blue"]) for _ in range(200)])
    assert find_loop(ids(colours)) is None
    people = json.dumps([{"name": rng.choice(["Ann", "Bob", "Cy"]), "age": rng.randint(20, 60),
                          "active": rng.choice([True, False])} for _ in range(40)])
    assert find_loop(ids(people)) is None


def test_long_valid_repetition_below_the_rule_does_not_fire():
    # what valid data holds (benchmarks/loops.py): placeholder hashes, three identical items
    assert find_loop(ids('{"sha256": "' + "0" * 64 + '"}')) is None
    assert find_loop(ids('{"id": "' + "0123456789abcdef" * 4 + '"}')) is None
    item = ids('{"name": "", "value": 0, "unit": "kg", "note": ""}, ')
    assert find_loop(ids("[") + item * (MIN_REPEATS - 1)) is None
    assert find_loop(ids("[0" + ", 0" * ((MIN_LENGTH - 2) // 3 - 1) + "]")) is None


# -- the rule itself ------------------------------------------------------------------------------

def brute_force(tokens: list[int], max_period: int, min_repeats: int, min_length: int) -> int | None:
    """The first n such that the last max(min_length, min_repeats * p) of tokens[:n] have period
    p, for some p <= max_period."""
    for n in range(1, len(tokens) + 1):
        for p in range(1, max_period + 1):
            span = max(min_length, min_repeats * p)
            if span <= n and all(tokens[i] == tokens[i - p] for i in range(n - span + p, n)):
                return n
    return None


def test_the_detector_matches_the_brute_force_rule():
    rng = random.Random(1)
    rule = {"max_period": 6, "min_repeats": 3, "min_length": 10}
    fired = 0
    for _ in range(300):
        seq = [rng.randrange(3) for _ in range(rng.randrange(5, 30))]
        unit = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        seq += unit * rng.randrange(1, 6) + [rng.randrange(4) for _ in range(rng.randrange(0, 5))]
        want = brute_force(seq, **rule)
        assert fires_at(seq, **rule) == want, seq
        fired += want is not None
    assert 50 < fired < 250  # both outcomes are exercised


def test_extend_in_batches_equals_one_token_at_a_time():
    out = ids('{"a": "x' + "ab" * 100)
    det = LoopDetector()
    for i in range(0, len(out), 7):
        if det.extend(out[i:i + 7]) is not None:
            break
    assert det.loop == find_loop(out)
    assert det.push(1) is det.loop  # later tokens are ignored once a loop was found


def test_bad_rule_values_raise():
    with pytest.raises(ValueError):
        LoopDetector(min_repeats=1)


# -- end to end: the engine stops a looping attempt ----------------------------------------------

ID = {c: i for i, c in enumerate(CHARS)}
V = len(CHARS) + 2
STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                 "additionalProperties": False}


@pytest.fixture(scope="module")
def loop_model():
    t = torch.full((V, V), -10.0)
    for (a, b), w in {("{", '"a'): 5, ('"a', '": '): 5, ('": ', '"'): 5, ('"', "a"): 5, ("a", "b"): 5,
                      ("b", "a"): 5, ("a", '"'): 3, ("b", '"'): 3, ('"', "}"): 4}.items():
        t[ID[a], ID[b]] = w
    return bigram_llama(t)


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(method="ngram", num_speculative_tokens=4)],
                         ids=["off", "forced+ngram"])
def test_the_engine_stops_a_looping_attempt_with_finish_reason_loop(loop_model, tiny_tok, spec):
    compiled = compile_spec(normalize_schema(STRING_SCHEMA), tiny_tok)
    runner = LeanRunner(loop_model, dtype=torch.float32, device=torch.device("cpu"))
    eng = Engine(runner, speculative=spec, drafter=NgramDrafter(3, 1) if spec else None)
    params = SamplingParams(max_tokens=400)
    looping = Request([ID["a"]], compiled.new_matcher(), params, (0,))
    unguarded = Request([ID["a"]], compiled.new_matcher(), params, (0,), loops=None)
    eng.run([looping, unguarded])
    assert unguarded.finish_reason == "length" and len(unguarded.output_ids) == 400
    assert looping.finish_reason == "loop"
    # {"a": "ab... : 4 tokens of structure, then the string loops with period 2
    assert len(looping.output_ids) == 4 + MIN_LENGTH
    assert looping.output_ids == unguarded.output_ids[:len(looping.output_ids)]
    assert looping.stats.loops_detected == 1
    assert looping.stats.loop_tokens_saved == 400 - len(looping.output_ids)


@pytest.fixture(scope="module")
def looping():
    """Inside a string: a -> b -> a -> ... (5); the closing quote comes second (3)."""
    return bigram_loaded({('"', "a"): 5, ("a", "b"): 5, ("b", "a"): 5, ("a", '"'): 3, ("b", '"'): 3})


def test_a_loop_surfaces_as_an_incomplete_output_error_that_says_where(looping):
    with pytest.raises(RepetitionLoopError) as info:
        generate(looping, "x", schema=STRING_SCHEMA, max_tokens=500, max_retries=0)
    err = info.value
    assert isinstance(err, IncompleteOutputError)
    assert err.period == 2 and err.repeated_text in ("ab", "ba")
    assert len(err.token_ids) < 500 and "ababab" in err.partial_text
    assert "repetition loop detected" in str(err) and f"from output token {err.start}" in str(err)
    assert err.stats.loops_detected == 1 and err.stats.loop_tokens_saved > 300


def test_retries_cure_a_stopped_loop_and_count_its_tokens(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=500)
    res = gen("x", max_retries=4, return_result=True)
    assert res.attempts >= 2 and json.loads(res.text) == res.value
    assert res.stats.loops_detected >= 1
    # the stopped attempts cost about MIN_LENGTH tokens each, not max_tokens
    assert res.stats.emitted_tokens < 500
