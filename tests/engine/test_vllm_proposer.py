"""Our proposer inside vLLM's engine, without vLLM: for any row vLLM hands it, the drafts our
own engine would propose at the same grammar state (forced tokens and grammar-checked n-gram
lookups), found through the registry by the row's request id (tests/on_vllm run it in vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cs_testlib import CHARS

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.drafters.base import AcceptCursor, GrammarCursor
from constrained_spec.generation import vllm_proposer
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.timing import StepTimer
from constrained_spec.generation.vllm_engine import drafting
from constrained_spec.generation.vllm_proposer import Drafting, Entry
from constrained_spec.grammar import compile_spec
from constrained_spec.schemas import normalize_schema

ID = {c: i for i, c in enumerate(CHARS)}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
# the prompt holds the value the n-gram lookup copies: 'bead", ' follows 'bead' there
PROMPT = [ID[c] for c in 'bead", 36']
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_forced_tokens=6)


class FakeRunner:
    def __init__(self, req_ids: list[str]) -> None:
        self.input_batch = SimpleNamespace(req_ids=req_ids)


def proposer(monkeypatch, req_ids: list[str], k: int, max_model_len: int = 4096):
    monkeypatch.setattr(vllm_proposer, "_owning_runner", lambda: FakeRunner(req_ids))
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                             model_config=SimpleNamespace(max_model_len=max_model_len))
    return vllm_proposer.GrammarProposer(config)


def request(tiny_tok, output: str) -> Request:
    compiled = compile_spec(normalize_schema(SCHEMA), tiny_tok)
    matcher = compiled.new_matcher()
    r = Request(list(PROMPT), matcher, SamplingParams(max_tokens=64), (0,))
    for c in output:
        assert matcher.accept(ID[c])
        r.output_ids.append(ID[c])
    return r


def engine_drafts(tiny_model, r: Request) -> list[int]:
    """What our engine drafts for ``r`` in its next step."""
    from constrained_spec.model.runner import LeanRunner

    runner = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    eng = Engine(runner, speculative=SPEC, drafter=NgramDrafter(SPEC.prompt_lookup_max,
                                                                 SPEC.prompt_lookup_min))
    eng.budget = None  # every draft, as vLLM verifies every draft it is given
    rows = torch.empty((eng.max_rows, eng.words), dtype=torch.int32)
    st = eng._new_state(r, rows, StepTimer())
    eng._draft([r], [st])
    return st.tokens


@pytest.mark.parametrize("committed, sampled", [
    ('{"name": "', ""),  # every sampled token committed on our side already
    ('{"name": "', "be"),  # vLLM sampled two tokens this step that we have not committed yet
    ("", '{"na'),  # inside a forced key
])
def test_a_rows_drafts_are_our_engines_drafts_at_the_same_state(monkeypatch, tiny_tok, tiny_model,
                                                                  committed, sampled):
    ours = drafting(SPEC)
    # vLLM runs our request "cs-1" as "cs-1-" and 8 random characters
    prop = proposer(monkeypatch, ["other", "cs-1-0f3e9a1b"], k=ours.k + ours.max_forced)
    r = request(tiny_tok, committed)
    vllm_proposer.REGISTRY["cs-1"] = Entry(r, ours)
    try:
        context = PROMPT + [ID[c] for c in committed + sampled]
        tokens = np.zeros((2, 64), dtype=np.int64)
        tokens[1, :len(context)] = context
        out = prop.propose([[5], [context[-1]]], np.array([3, len(context)]), tokens)
    finally:
        vllm_proposer.REGISTRY.pop("cs-1")
    assert out[0] == []  # a row we did not submit: no drafts
    expected = engine_drafts(tiny_model, request(tiny_tok, committed + sampled))
    assert out[1] == expected and expected  # forced and copied tokens, as our engine drafts
    assert len(r.output_ids) == len(committed)  # the request's own matcher is untouched


def test_drafts_stop_at_max_tokens_and_the_model_length(monkeypatch, tiny_tok):
    ours = drafting(SPEC)
    r = request(tiny_tok, '{"name": "')
    r.params = SamplingParams(max_tokens=len(r.output_ids) + 2)
    context = PROMPT + r.output_ids
    tokens = np.array([context + [0] * 8])
    prop = proposer(monkeypatch, ["cs-2"], k=ours.k + ours.max_forced)
    vllm_proposer.REGISTRY["cs-2"] = Entry(r, ours)
    try:
        assert len(prop.propose([[context[-1]]], np.array([len(context)]), tokens)[0]) == 2
        short = proposer(monkeypatch, ["cs-2"], k=ours.k + ours.max_forced,
                         max_model_len=len(context) + 2)
        assert len(short.propose([[context[-1]]], np.array([len(context)]), tokens)[0]) == 1
    finally:
        vllm_proposer.REGISTRY.pop("cs-2")


def test_a_finished_request_or_a_token_our_grammar_refuses_gets_no_drafts(monkeypatch, tiny_tok):
    ours = drafting(SPEC)
    r = request(tiny_tok, '{"name": "')
    prop = proposer(monkeypatch, ["cs-3"], k=ours.k + ours.max_forced)
    vllm_proposer.REGISTRY["cs-3"] = Entry(r, ours)
    try:
        bad = PROMPT + r.output_ids + [ID["}"], ID["}"]]  # '}}' inside a string is fine ...
        good = prop.propose([[bad[-1]]], np.array([len(bad)]), np.array([bad]))
        vllm_proposer.REGISTRY["cs-3"] = Entry(request(tiny_tok, ""), ours)
        refused = PROMPT + [ID["a"]]  # ... an output that cannot start with 'a' is refused
        assert prop.propose([[ID["a"]]], np.array([len(refused)]), np.array([refused])) == [[]]
        vllm_proposer.REGISTRY["cs-3"] = Entry(r, ours)
        r.finish_reason = "stop"
        assert prop.propose([[bad[-1]]], np.array([len(bad)]), np.array([bad])) == [[]]
    finally:
        vllm_proposer.REGISTRY.pop("cs-3")
    assert good[0]  # the string's value goes on: drafts


def test_an_accept_cursor_checks_by_accept_and_keeps_going_after_a_refusal(tiny_tok):
    compiled = compile_spec(normalize_schema(SCHEMA), tiny_tok)
    cursor = AcceptCursor(compiled.new_matcher(), 4)
    assert not cursor.push(ID["a"]) and not cursor.exhausted  # refused, the fork unchanged
    assert cursor.push(ID["{"]) and cursor.push(ID['"'])
    assert cursor.push(ID["n"]) is True and cursor.push(ID["a"]) is False  # 3 drafts fill 4 rows
    with pytest.raises(TypeError, match="no mask rows"):
        cursor.row()
    masked = GrammarCursor(compiled.new_matcher(), torch.empty((4, 1), dtype=torch.int32))
    assert masked.masked and not AcceptCursor.masked


def test_copied_drafts_follow_the_requests_acceptance_and_forced_ones_stay():
    entry = Entry(None, Drafting(k=4, max_forced=6, ngram=NgramDrafter()))
    entry.last = [True, True, False, False, False]  # two forced tokens, then three copies
    entry.learn(2)  # the forced ones accepted, no copy: half the copies next time
    assert entry.limit == 2 and entry.last == []
    entry.last = [False, False]
    entry.learn(0)
    assert entry.limit == 1  # never below one: a request that starts copying again is seen
    entry.last = [False, True]
    entry.learn(2)  # every copy accepted: one more
    assert entry.limit == 2
    entry.last = [True, True]
    entry.learn(0)  # no copies proposed: nothing learned about them
    assert entry.limit == 2
    assert entry.forced_limit == 3  # forced ones apart: all taken (6), then both refused (3) ...
    entry.last = [True, True, True]
    entry.learn(3)
    assert entry.forced_limit == 4  # ... then all three taken: one more


def test_a_request_whose_copies_fail_is_proposed_fewer_of_them(monkeypatch, tiny_tok):
    ours = drafting(SPEC)
    r = request(tiny_tok, '{"name": "')
    entry = Entry(r, ours)
    prop = proposer(monkeypatch, ["cs-5"], k=ours.k + ours.max_forced)
    vllm_proposer.REGISTRY["cs-5"] = entry
    try:
        context = PROMPT + r.output_ids
        first = prop.propose([[context[-1]]], np.array([len(context)]), np.array([context]))[0]
        assert entry.last.count(False) >= 3  # copied from the prompt, then forced tokens
        context = context + [ID["d"]]  # vLLM accepted none of them and sampled 'd'
        prop.propose([[ID["d"]]], np.array([len(context)]), np.array([context]))[0]
    finally:
        vllm_proposer.REGISTRY.pop("cs-5")
    assert first and entry.limit == 2 and 0 < entry.last.count(False) <= 2


def test_a_forced_limit_caps_the_forced_drafts_of_the_next_proposal(monkeypatch, tiny_tok):
    ours = drafting(SpeculativeConfig(method=None, max_forced_tokens=6))  # forced tokens only
    r = request(tiny_tok, "{")
    entry = Entry(r, ours)
    prop = proposer(monkeypatch, ["cs-6"], k=ours.max_forced)
    vllm_proposer.REGISTRY["cs-6"] = entry
    try:
        context = PROMPT + r.output_ids
        full = prop.propose([[context[-1]]], np.array([len(context)]), np.array([context]))[0]
        entry.last, entry.forced_limit = [], 1
        capped = prop.propose([[context[-1]]], np.array([len(context)]), np.array([context]))[0]
    finally:
        vllm_proposer.REGISTRY.pop("cs-6")
    assert len(full) > 1 and capped == full[:1]  # '"name": "' forced, then only its first token
