"""The loop detector's structural rule (loops.py): a periodic span that repeats whole JSON
values (it holds a token with a quote) is a loop from ``STRUCTURAL_MIN_LENGTH`` tokens; one
inside a single string still needs ``MIN_LENGTH``. JSON outputs and tool calls get the rule,
free text does not."""

from __future__ import annotations

from constrained_spec import Generator
from constrained_spec.generation.loops import MIN_LENGTH, STRUCTURAL_MIN_LENGTH, LoopDetector
from constrained_spec.generation.retry import quote_tokens

QUOTE = 9
DELIMITERS = frozenset({QUOTE})


def test_a_span_repeating_whole_values_is_a_loop_from_the_structural_length():
    unit = [QUOTE, 1, 2, 3]  # '"x", ' as four tokens
    tokens = [5, 6, 7] + unit * 20
    loop = LoopDetector(structural_tokens=DELIMITERS).extend(tokens)
    assert loop is not None and loop.period == 4 and loop.start == 3
    assert loop.length == STRUCTURAL_MIN_LENGTH
    # without the delimiter ids: only the general rule, which needs more
    assert LoopDetector().extend(tokens) is None


def test_a_span_inside_one_string_still_needs_the_general_length():
    tokens = [QUOTE] + [1, 2, 3, 4] * 40  # the quote opens the string before the span
    loop = LoopDetector(structural_tokens=DELIMITERS).extend(tokens)
    assert loop is not None and loop.length == MIN_LENGTH and loop.start == 1


def test_quote_tokens_are_the_ids_whose_bytes_hold_a_quote():
    assert quote_tokens([b"a", b'"', b'", "', b"x\"y", b""]) == frozenset({1, 2, 3})


def test_json_requests_get_the_structural_rule_and_free_text_does_not(tiny_loaded):
    gen = Generator(tiny_loaded)
    json_req, _ = gen.make_request("x", schema={"type": "array", "items": {"type": "string"}})
    text_req, _ = gen.make_request("x", schema=None)
    regex_req, _ = gen.make_request("x", schema=["red", "green"])
    assert json_req.loops is not None and json_req.loops.structural_tokens
    assert text_req.loops is not None and text_req.loops.structural_tokens is None
    assert regex_req.loops is not None and regex_req.loops.structural_tokens is None
