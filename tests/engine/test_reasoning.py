"""Reasoning models: free thinking, then the grammar after the end-of-reasoning marker.

Matcher properties on a raw-string vocabulary (no model); engine properties on a scripted bigram
model whose greedy output is a think block then an answer (the marker landing inside draft
windows of the forced and n-gram drafters, budget forcing, greedy identity with speculation on
and off, the sampled distribution); the public API on a byte-level BPE with ``<think>`` /
``</think>`` tokens and a chat template that names them.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from cs_testlib import CHARS, bigram_llama, byte_level_bpe, exact_distribution, gof, tiny_llama

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import Drafter, NgramDrafter
from constrained_spec.engine import Engine, Request
from constrained_spec.errors import ConfigError
from constrained_spec.grammar import TokenizerData, compile_spec
from constrained_spec.grammar.reasoning import ReasoningMatcher, ReasoningTables
from constrained_spec.reasoning import (
    ReasoningMarkers,
    detect_reasoning,
    resolve_reasoning,
    split_reasoning,
)
from constrained_spec.runner import LlamaRunner
from constrained_spec.schemas import Regex, normalize_schema

VOCAB = CHARS + ["<think>", "</think>", "</", "th", "ink", ">", "k>", "k>{", "\n", "i", "h", "k",
                 "x"]
ID = {t: i for i, t in enumerate(VOCAB)}
V = len(VOCAB) + 2  # padded ids past the vocabulary are never allowed
EOS = 0
ANSWER = Regex(r'\{"a": [0-9]\}')


def ids(tokens: list[str]) -> list[int]:
    return [ID[t] for t in tokens]


@pytest.fixture(scope="module")
def tok():
    return TokenizerData.from_tokens(VOCAB, eos_token_id=EOS, vocab_size=V)


@pytest.fixture(scope="module")
def compiled(tok):
    return compile_spec(normalize_schema(ANSWER), tok)


def tables(tok, multi: bool = False) -> ReasoningTables:
    """The markers as one token each, or (``multi``) the end marker as four tokens."""
    end = ids(["</", "th", "ink", ">"]) if multi else ids(["</think>"])
    return ReasoningTables(tok, ids(["<think>"]), end, b"</think>")


def allowed(m, vocab: int = V) -> set[int]:
    mask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    return {t for t in range(vocab) if (int(mask[0, t >> 5]) >> (t & 31)) & 1}


def feed(m, tokens: list[str]) -> None:
    for t in tokens:
        assert m.accept(ID[t]), t


# -- the matcher ---------------------------------------------------------------------------
def test_thinking_allows_every_text_token_but_no_stop_or_padded_id(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    got = allowed(m)
    assert EOS not in got and V - 1 not in got and V - 2 not in got
    # "}" and "\n" are forbidden by the answer grammar at its start, free while thinking
    assert {ID["}"], ID["\n"], ID["xyz"], ID["</think>"], ID["<think>"]} <= got
    assert not m.is_completed() and not m.must_stop() and not m.is_terminated()
    assert not m.accept(EOS)


def test_grammar_applies_right_after_a_one_token_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["}", "x", "</think>"])
    assert m.phase == "answer" and m.answer_start == 3 and m.reasoning_tokens == 3
    assert allowed(m) == allowed(compiled.new_matcher()) == {ID["{"]}
    assert not m.accept(ID["\n"])
    feed(m, ["{", '"a', '": ', "7", "}"])
    assert m.must_stop()


def test_marker_spelled_across_tokens_ends_reasoning(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["</", "t", "h", "i", "n"])
    assert m.phase == "thinking"
    feed(m, ["k>"])
    assert m.phase == "answer" and m.answer_start == 6


def test_token_running_past_the_marker_is_masked_in_thinking(tok, compiled):
    """"k>{" would complete "</think>" and start the answer inside a reasoning token: masked
    after "</thin", allowed where it completes nothing."""
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    assert ID["k>{"] in allowed(m)
    feed(m, ["</", "th", "i", "n"])
    assert ID["k>{"] not in allowed(m) and ID["k>"] in allowed(m)
    assert not m.accept(ID["k>{"])
    feed(m, ["x"])  # the partial match is broken: "k>{" completes nothing now
    assert ID["k>{"] in allowed(m)


def test_multi_token_marker_rest_is_proposed_once_started(tok, compiled):
    m = ReasoningMatcher(tables(tok, multi=True), compiled.new_matcher, phase="thinking")
    assert m.forced_tokens() == []
    feed(m, ["</"])
    assert m.forced_tokens() == ids(["th", "ink", ">"])
    assert len(allowed(m)) > 3  # a proposal, not a mask: the model may write on
    feed(m, ["th", "ink", ">"])
    assert m.phase == "answer"


def test_budget_forces_the_end_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok, multi=True), compiled.new_matcher, max_reasoning_tokens=2,
                         phase="thinking")
    feed(m, ["x", "m"])
    assert m.phase == "closing" and m.forced_tokens() == ids(["</", "th", "ink", ">"])
    assert allowed(m) == {ID["</"]} and not m.accept(ID["x"])
    feed(m, ["</", "th"])
    assert allowed(m) == {ID["ink"]}
    feed(m, ["ink", ">"])
    assert m.phase == "answer" and m.reasoning_tokens == 2


def test_budget_zero_forces_start_and_end_then_the_grammar(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, max_reasoning_tokens=0)
    assert m.phase == "opening"
    assert m.forced_tokens() == ids(["<think>", "</think>"])
    feed(m, ["<think>", "</think>"])
    assert m.phase == "answer" and m.forced_tokens() == compiled.new_matcher().forced_tokens()


def test_opening_forces_the_start_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher)
    assert allowed(m) == {ID["<think>"]}
    feed(m, ["<think>"])
    assert m.phase == "thinking" and ID["x"] in allowed(m)


def test_prompt_that_closed_the_block_starts_in_the_answer(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="answer")
    assert m.answer_start == 0 and allowed(m) == {ID["{"]}


def test_rollback_across_the_boundary_restores_thinking(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["x", "</think>", "{", '"a'])
    m.rollback(3)  # '"a', "{", "</think>"
    assert m.phase == "thinking" and m.answer_start is None and m.reasoning_tokens == 1
    assert ID["}"] in allowed(m)
    feed(m, ["}", "</think>"])  # a fresh answer: the old grammar state is gone
    assert m.answer_start == 3 and allowed(m) == {ID["{"]}
    feed(m, ["{"])
    m.rollback(1)  # inside the answer: the inner matcher rolls back
    assert m.phase == "answer" and allowed(m) == {ID["{"]}
    with pytest.raises(ValueError):
        m.rollback(10)


def test_rollback_out_of_closing_lifts_the_forced_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok, multi=True), compiled.new_matcher, max_reasoning_tokens=1,
                         phase="thinking")
    feed(m, ["x", "</", "th"])
    m.rollback(3)
    assert m.phase == "thinking" and ID["x"] in allowed(m)


def test_fork_is_independent(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["x"])
    f = m.fork()
    feed(f, ["</think>", "{"])
    assert m.phase == "thinking" and f.phase == "answer"
    g = f.fork()
    feed(g, ['"a'])
    fresh = compiled.new_matcher()
    assert fresh.accept(ID["{"])
    assert allowed(f) == allowed(fresh) != allowed(g)


def test_free_text_answer_ends_at_a_stop_token(tok):
    m = ReasoningMatcher(tables(tok), None, phase="thinking")
    feed(m, ["x", "</think>"])
    assert m.is_completed() and not m.must_stop() and EOS in allowed(m)
    assert m.accept(EOS) and m.is_terminated() and m.must_stop()
    assert allowed(m) == set()


def test_accepts_text_checks_the_answer_after_the_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    assert m.accepts_text('a } b</think>{"a": 7}')
    assert not m.accepts_text('{"a": 7}')
    assert not m.accepts_text('x</think>{"a": 77')


# -- markers and options -------------------------------------------------------------------
class _Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("template,expected", [
    ("{% if enable_thinking %}<think>\n\n</think>{% endif %}", ReasoningMarkers()),
    ("[THINK]{{ m }}[/THINK]", ReasoningMarkers("[THINK]", "[/THINK]")),
    ({"default": "<seed:think>x</seed:think>"}, ReasoningMarkers("<seed:think>", "</seed:think>")),
    ("{{ bos_token }}{{ message['content'] }}", None),
    (None, None)])
def test_markers_are_detected_from_the_chat_template(template, expected):
    assert detect_reasoning(_Tok(template)) == expected


def test_reasoning_option_resolves():
    plain = _Tok("{{ message['content'] }}")
    assert resolve_reasoning("auto", plain) is None
    assert resolve_reasoning(True, plain) == ReasoningMarkers()
    assert resolve_reasoning(False, _Tok("</think>")) is None
    custom = ReasoningMarkers("<r>", "</r>")
    assert resolve_reasoning(custom, plain) is custom
    with pytest.raises(ConfigError, match="reasoning"):
        resolve_reasoning("yes", plain)
    with pytest.raises(ConfigError, match="reasoning"):
        ReasoningMarkers("", "</r>")
