"""A request whose grammar costs too much matcher work per token is stopped alone (a
`GrammarCostError`), and the requests beside it go on as they would alone (tiny model, ms)."""

from __future__ import annotations

import time

import pytest
import torch
from cs_testlib import CHARS

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.errors import GrammarCostError
from constrained_spec.generation import engine as engine_module
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.grammar.matcher import Matcher
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import Regex, normalize_schema

EOS = (0,)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


class SlowMatcher(Matcher):
    """A real matcher whose every accept also spins ``delay`` seconds of CPU: a grammar that
    costs that much a token (the bound counts CPU time, so a sleep would not do)."""

    def __init__(self, inner: Matcher, delay: float) -> None:
        self.inner, self.delay, self.vocab_size = inner, delay, inner.vocab_size

    def accept(self, token_id: int) -> bool:
        end = time.thread_time() + self.delay
        while time.thread_time() < end:
            pass
        return self.inner.accept(token_id)

    def fork(self) -> Matcher:
        return SlowMatcher(self.inner.fork(), self.delay)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def forced_tokens(self) -> list[int]:
        return self.inner.forced_tokens()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def must_stop(self) -> bool:
        return self.inner.must_stop()

    def accepts_text(self, text: str) -> bool:
        return self.inner.accepts_text(text)


def _engine(model, speculative: SpeculativeConfig | None) -> Engine:
    runner = LeanRunner(model, dtype=torch.float32, device=torch.device("cpu"))
    drafter = NgramDrafter(3, 1) if speculative is not None and speculative.method else None
    return Engine(runner, speculative=speculative, drafter=drafter, max_batch_size=8)


def _request(compiled, prompt: list[int], delay: float | None = None) -> Request:
    matcher = compiled.new_matcher()
    if delay is not None:
        matcher = SlowMatcher(matcher, delay)
    return Request(prompt, matcher, SamplingParams(max_tokens=40), EOS)


def per_vocab(seconds: float, tok) -> float:
    """The bound (given per 100,000 vocabulary entries) that is ``seconds`` for ``tok`` (with
    the floor off: `no_floor`)."""
    return seconds * 100_000 / tok.vocab_size


@pytest.fixture
def no_floor(monkeypatch):
    """The bounds as scaled to the tiny vocabulary, without the floor that keeps them at least
    10 ms a call whatever the vocabulary."""
    monkeypatch.setattr(engine_module, "GRAMMAR_MIN_SCALE", 0.0)


@pytest.fixture
def tight_bound(monkeypatch, tiny_tok, no_floor):
    """A bound a 20 ms-an-accept grammar is far past, and a tiny vocabulary's far within."""
    monkeypatch.setattr(engine_module, "GRAMMAR_GRACE_S", 0.1)
    monkeypatch.setattr(engine_module, "GRAMMAR_S_PER_CALL", per_vocab(0.002, tiny_tok))
    monkeypatch.setattr(engine_module, "GRAMMAR_STEP_S_PER_CALL", per_vocab(1.0, tiny_tok))


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig(method="ngram", num_speculative_tokens=3)],
                         ids=["plain", "ngram"])
def test_a_costly_grammar_stops_its_request_alone(tiny_model, tiny_tok, tight_bound, speculative):
    compiled = compile_spec(normalize_schema(SCHEMA), tiny_tok)
    prompt = [CHARS.index(c) for c in "ab{"]
    alone = _request(compiled, prompt)
    _engine(tiny_model, speculative).run([alone])
    slow, plain = _request(compiled, prompt, delay=0.02), _request(compiled, prompt)
    _engine(tiny_model, speculative).run([slow, plain])
    assert slow.finish_reason == "error" and isinstance(slow.error, GrammarCostError)
    assert slow.error.token_ids == slow.output_ids  # the output so far is kept on the error
    assert "matcher work" in str(slow.error)
    # the request beside it: the same tokens as alone, finished as alone
    assert plain.output_ids == alone.output_ids and plain.finish_reason == alone.finish_reason
    assert plain.grammar_s > 0  # its own work is measured too, and far within the bound...
    assert alone.error is None and plain.error is None  # ... which only the slow one crosses


def test_the_default_bound_leaves_an_ordinary_grammar_alone(tiny_model, tiny_tok):
    compiled = compile_spec(normalize_schema(Regex(r"(ab|c)+d{2,4}")), tiny_tok)
    reqs = [_request(compiled, [CHARS.index(c) for c in p]) for p in ("ab", "abc", "dd")]
    _engine(tiny_model, SpeculativeConfig(method="ngram", num_speculative_tokens=4)).run(reqs)
    for r in reqs:
        assert r.error is None, r.error
        assert r.grammar_s < engine_module.GRAMMAR_GRACE_S


def test_the_generator_returns_the_grammar_cost_error_with_the_partial_text(tiny_loaded, monkeypatch):
    from constrained_spec.api import Generator

    monkeypatch.setattr(engine_module, "GRAMMAR_GRACE_S", 0.0)
    monkeypatch.setattr(engine_module, "GRAMMAR_S_PER_CALL", 0.0)
    gen = Generator(tiny_loaded, schema=SCHEMA)
    out = gen.batch(["x"], max_tokens=20)[0]
    assert isinstance(out, GrammarCostError)
    assert out.partial_text == tiny_loaded.tokenizer.decode(out.token_ids)


def test_a_grammar_that_matches_no_string_is_refused_at_compile(tiny_tok):
    from constrained_spec.errors import SchemaError
    from constrained_spec.schemas import Grammar

    with pytest.raises(SchemaError, match="matches no string"):
        compile_spec(normalize_schema(Grammar("root ::= a\na ::= b\nb ::= a")), tiny_tok)


def test_a_grammar_dead_end_stops_its_request_with_a_typed_error(tiny_model, tiny_tok):
    from constrained_spec.errors import GrammarDeadEndError
    from constrained_spec.schemas import Grammar

    # "a" can start it; after it, a rule that never ends: no token, and it cannot end there
    compiled = compile_spec(normalize_schema(Grammar('root ::= "a" x\nx ::= y\ny ::= x')), tiny_tok)
    dead = _request(compiled, [CHARS.index("b")])
    _engine(tiny_model, SpeculativeConfig(method=None)).run([dead])
    assert dead.finish_reason == "error" and isinstance(dead.error, GrammarDeadEndError)
    assert dead.output_ids == [CHARS.index("a")] == dead.error.token_ids


def test_one_costly_step_after_the_first_stops_its_request(tiny_model, tiny_tok, monkeypatch,
                                                           no_floor):
    monkeypatch.setattr(engine_module, "GRAMMAR_GRACE_S", 1e9)  # only the step bound is left
    monkeypatch.setattr(engine_module, "GRAMMAR_STEP_S_PER_CALL", per_vocab(0.005, tiny_tok))
    compiled = compile_spec(normalize_schema(SCHEMA), tiny_tok)
    prompt = [CHARS.index(c) for c in "ab{"]
    slow, plain = _request(compiled, prompt, delay=0.05), _request(compiled, prompt)
    _engine(tiny_model, None).run([slow, plain])
    assert isinstance(slow.error, GrammarCostError) and "in the last step" in str(slow.error)
    assert len(slow.output_ids) >= 1  # the first step has the grace: it went through
    assert plain.error is None
