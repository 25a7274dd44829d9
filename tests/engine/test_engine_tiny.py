"""Engine properties on a tiny random Llama and a character vocabulary (milliseconds each)."""

from __future__ import annotations

import itertools

import pytest
import torch
from cs_testlib import CHARS

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import Drafter, NgramDrafter
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import HFRunner, LeanRunner
from constrained_spec.schemas import Regex, normalize_schema

ID = {c: i for i, c in enumerate(CHARS)}
EOS = (0,)


def ids(text_tokens: list[str]) -> list[int]:
    return [ID[t] for t in text_tokens]


def make_engine(model, spec: SpeculativeConfig | None, k: int | None = None, runner=None,
                dtype: torch.dtype = torch.float32):
    runner = runner or LeanRunner(model, dtype=dtype, device=torch.device("cpu"))
    drafter = None
    if spec is not None and spec.method == "ngram":
        drafter = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
    return Engine(runner, speculative=spec, drafter=drafter, max_batch_size=4096)


def run(model, tok, schema, prompts, params, spec, runner=None, dtype=torch.float32):
    compiled = compile_spec(normalize_schema(schema), tok) if schema is not None else None
    eng = make_engine(model, spec, runner=runner, dtype=dtype)
    reqs = [Request(list(p), compiled.new_matcher() if compiled else None, params, EOS) for p in prompts]
    eng.run(reqs)
    return reqs


PROMPTS = [ids(list("ab")*4), ids(list("abcab")), ids(['{', '"', 'a', '"', ':', ' ', '1', ',']), ids(list("dddd"))]
SPECS = {
    "off": None,
    "forced": SpeculativeConfig(method=None),
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, forced=False),
    "forced+ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
}
SCHEMAS = [
    Regex(r"(ab|c)+d{2,4}"),
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
     "required": ["a", "b"], "additionalProperties": False},
    ["abc", "abd", "e"],
]


def test_lean_runner_matches_transformers_logits(tiny_model):
    seq = list(range(1, 20))
    with torch.inference_mode():
        ref = tiny_model(torch.tensor([seq])).logits[0]
    lean = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    hf = HFRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    for runner in (lean, hf):
        s = runner.new_slot()
        a = runner.forward([s], [seq[:7]], [7])
        b = runner.forward([s], [seq[7:12] + [5, 5]], [7])  # two junk positions ...
        runner.truncate(s, 12)  # ... dropped: rejected drafts are overwritten by position
        c = runner.forward([s], [seq[12:]], [len(seq) - 12])
        got = torch.cat([a, b[:5], c])
        assert torch.allclose(got, ref, atol=1e-4), (type(runner).__name__, (got - ref).abs().max())


def test_lean_runner_batches_ragged_slots_like_single_runs(tiny_model):
    lean = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    seqs = [list(range(1, 9)), list(range(3, 6)), list(range(10, 30))]
    slots = [lean.new_slot() for _ in seqs]
    batched = lean.forward(slots, seqs, [2, 1, 3])
    for s, (seq, n) in enumerate(zip(seqs, [2, 1, 3])):
        with torch.inference_mode():
            ref = tiny_model(torch.tensor([seq])).logits[0, -n:]
        start = sum([2, 1, 3][:s])
        assert torch.allclose(batched[start:start + n], ref, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["regex", "json", "choice"])
@pytest.mark.parametrize("mode", ["forced", "ngram", "forced+ngram"])
def test_greedy_speculation_is_token_identical(tiny_model, tiny_tok, schema, mode, dtype):
    # bf16: the exact runner computes a verify row as a 1-row decode does (test_exact_rows)
    params = SamplingParams(max_tokens=40)
    base = run(tiny_model, tiny_tok, schema, PROMPTS, params, SPECS["off"], dtype=dtype)
    spec = run(tiny_model, tiny_tok, schema, PROMPTS, params, SPECS[mode], dtype=dtype)
    for a, b in zip(base, spec):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason
    assert sum(r.stats.target_forwards for r in spec) <= sum(r.stats.target_forwards for r in base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_batched_mixed_schemas_match_single_runs(tiny_model, tiny_tok, dtype):
    params = SamplingParams(max_tokens=30)
    spec = SPECS["forced+ngram"]
    compiled = [compile_spec(normalize_schema(s), tiny_tok) for s in SCHEMAS]
    eng = make_engine(tiny_model, spec, dtype=dtype)
    reqs = [Request(p, c.new_matcher(), params, EOS) for p, c in itertools.product(PROMPTS, compiled)]
    eng.run(reqs)
    for (p, c), r in zip(itertools.product(PROMPTS, compiled), reqs):
        single = make_engine(tiny_model, None, dtype=dtype)
        one = Request(p, c.new_matcher(), params, EOS)
        single.run([one])
        assert r.output_ids == one.output_ids


def test_max_tokens_respected(tiny_model, tiny_tok):
    params = SamplingParams(max_tokens=3)
    for mode in ("off", "forced+ngram"):
        reqs = run(tiny_model, tiny_tok, Regex("[abc]{10}"), PROMPTS, params, SPECS[mode])
        for r in reqs:
            assert len(r.output_ids) == 3 and r.finish_reason == "length"


def test_every_completed_output_matches_the_grammar(tiny_model, tiny_tok):
    import re

    params = SamplingParams(max_tokens=40, temperature=1.5, seed=3)
    reqs = run(tiny_model, tiny_tok, Regex(r"(ab|c)+d{2,4}"), PROMPTS * 5, params, SPECS["forced+ngram"])
    for r in reqs:
        text = "".join(CHARS[t] for t in r.output_ids)
        if r.finish_reason == "stop":
            assert re.fullmatch(r"(ab|c)+d{2,4}", text), text


class RogueDrafter(Drafter):
    """Proposes a token the grammar forbids, bypassing the cursor's check."""

    name = "rogue"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, states, k):
        for st in states:
            st.cursor.row()  # row 0: the real grammar state, which forbids the token
            st.tokens.append(self.token)
            st.q.append(None)
            st.cursor._pos += 1  # pretend the fork accepted it; its mask row stays the real one


class SpyMatcher:
    """Wraps a matcher and records every token the REAL matcher accepts."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def accept(self, tok):
        self.seen.append(tok)
        return self.inner.accept(tok)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forbidden_draft_is_never_accepted_or_emitted(tiny_model, tiny_tok, temperature):
    forbidden = ID["z"] if "z" in ID else ID["xyz"]
    compiled = compile_spec(normalize_schema(Regex("[ab]{6}")), tiny_tok)
    runner = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    eng = Engine(runner, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=1,
                                                       forced=False),
                 drafter=RogueDrafter(forbidden))
    seen: list[int] = []
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=1)
    reqs = [Request(PROMPTS[0], SpyMatcher(compiled.new_matcher(), seen), params, EOS) for _ in range(8)]
    eng.run(reqs)
    assert forbidden not in seen
    for r in reqs:
        assert forbidden not in r.output_ids
        assert r.stats.accepted_tokens == 0 and r.stats.drafted_tokens > 0
        # six characters, in as many tokens as sampling took (multi-character tokens exist)
        assert r.finish_reason == "stop" and len("".join(CHARS[t] for t in r.output_ids)) == 6


def test_lean_runner_padded_rows_fit_at_cache_capacity_edge(tiny_model):
    # a short row padded to a long neighbour writes beyond its own end: that must fit
    lean = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    a, b = lean.new_slot(), lean.new_slot()
    toks = lambda n: [1 + i % 30 for i in range(n)]  # noqa: E731
    lean.forward([a, b], [toks(19), toks(199)], [1, 1])
    lean.forward([a], [toks(235)], [1])  # a now ends 2 short of a capacity edge (256)
    out = lean.forward([b, a], [toks(9), [1]], [9, 1])
    assert out.shape[0] == 10 and torch.isfinite(out).all()


def test_free_text_in_a_batch_with_schemas_is_unmasked(tiny_model, tiny_tok, monkeypatch):
    """The verifier masks every row of a batch that holds any schema: a free-text request's
    rows must allow everything, whatever the step's bitmask buffer held before."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=30)
    free = ids(list("abababab"))
    alone = run(tiny_model, tiny_tok, None, [free], params, spec)[0]
    compiled = compile_spec(normalize_schema(Regex(r"(ab|c)+d{2,4}")), tiny_tok)
    empty = torch.empty
    # the buffer is allocated uninitialised: make that "whatever it held" all-disallowing
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).zero_())
    eng = make_engine(tiny_model, spec)
    mixed = Request(list(free), None, params, EOS)
    eng.run([Request(ids(list("abab")), compiled.new_matcher(), params, EOS), mixed])
    assert alone.stats.drafted_tokens > 0  # drafts were made: rows past the first were used
    assert (mixed.output_ids, mixed.finish_reason) == (alone.output_ids, alone.finish_reason)
