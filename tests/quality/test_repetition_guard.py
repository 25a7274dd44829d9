"""The opt-in repetition guard (``no_repeat_ngram_size``, ``repetition_penalty``).

Loops are built by construction: a "bigram" Llama whose next-token logits depend on the last
token alone (``cs_testlib.bigram_llama``) writes ``abab...`` inside a JSON string forever under
greedy decoding. The guard must break the loop, leave grammar-forced structure alone, never
leave a row with no allowed token, and be applied identically at every verified position:
greedy speculation on == off token for token, and speculative sampling exact for the modified
distribution (chi-square against the enumerated distribution, as in test_lossless_sampling).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from cs_testlib import CHARS, bigram_llama, exact_distribution, gof

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import Drafter, NgramDrafter
from constrained_spec.errors import ConfigError
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.sampling import (
    apply_repetition_guard,
    ngram_bans,
    probs_from_logits,
)
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import Regex, normalize_schema

ID = {c: i for i, c in enumerate(CHARS)}
V = len(CHARS) + 2
EOS = (0,)
STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                 "additionalProperties": False}
MODES = {
    "off": None,
    "forced": SpeculativeConfig(method=None),
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, forced=False),
    "forced+ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
}
GUARDS = {
    "ngram2": {"no_repeat_ngram_size": 2},
    "ngram3": {"no_repeat_ngram_size": 3},
    "penalty": {"repetition_penalty": 1.3},
    "both": {"no_repeat_ngram_size": 4, "repetition_penalty": 1.2},
}


def table(edges: dict[tuple[str, str], float], floor: float = -10.0) -> torch.Tensor:
    t = torch.full((V, V), floor)
    for (a, b), w in edges.items():
        t[ID[a], ID[b]] = w
    return t


# {"a": "abab... : after a letter the other letter wins, the closing quote comes second
LOOP = table({("{", '"a'): 5, ('"a', '": '): 5, ('": ', '"'): 5, ('"', "a"): 5, ("a", "b"): 5,
              ("b", "a"): 5, ("a", '"'): 3, ("b", '"'): 3, ('"', "}"): 4, ("}", "<eos>"): 5,
              ("b", "c"): 2, ("c", '"'): 5})


@pytest.fixture(scope="module")
def loop_model():
    return bigram_llama(LOOP)


def run(model, tok, schema, prompts, params, spec):
    compiled = compile_spec(normalize_schema(schema), tok)
    runner = LeanRunner(model, dtype=torch.float32, device=torch.device("cpu"))
    drafter = NgramDrafter(3, 1) if spec is not None and spec.method == "ngram" else None
    eng = Engine(runner, speculative=spec, drafter=drafter, max_batch_size=64)
    reqs = [Request(list(p), compiled.new_matcher(), params, EOS) for p in prompts]
    eng.run(reqs)
    return reqs


def text(req) -> str:
    return "".join(CHARS[t] for t in req.output_ids)


@pytest.mark.parametrize("mode", ["off", "forced+ngram"])
def test_ngram_guard_breaks_a_loop_and_the_output_completes(loop_model, tiny_tok, mode):
    prompt = [[ID["a"], ID["b"]]]
    looping = run(loop_model, tiny_tok, STRING_SCHEMA, prompt, SamplingParams(max_tokens=40), MODES[mode])[0]
    assert looping.finish_reason == "length" and "ababab" in text(looping)
    guarded = run(loop_model, tiny_tok, STRING_SCHEMA, prompt,
                  SamplingParams(max_tokens=40, no_repeat_ngram_size=3), MODES[mode])[0]
    assert guarded.finish_reason == "stop"
    assert json.loads(text(guarded)) == {"a": "abab"}  # the trigram "aba" would repeat next


def test_repetition_penalty_breaks_a_loop_toward_an_unseen_token(loop_model, tiny_tok):
    # after "ab", 'a' (seen, 5 / 1.5) loses to 'c' (unseen, 2 ... then penalised nothing)
    params = SamplingParams(max_tokens=40, repetition_penalty=3.0)
    req = run(loop_model, tiny_tok, STRING_SCHEMA, [[ID["d"]]], params, MODES["forced+ngram"])[0]
    assert req.finish_reason == "stop"
    assert json.loads(text(req)) == {"a": "abc"}


@pytest.mark.parametrize("guard", list(GUARDS))
def test_greedy_speculation_is_token_identical_with_the_guard(loop_model, tiny_model, tiny_tok, guard):
    params = SamplingParams(max_tokens=40, **GUARDS[guard])
    cases = [
        (loop_model, STRING_SCHEMA, [[ID["a"], ID["b"]], [ID["d"]]]),
        (tiny_model, Regex(r"(ab|c)+d{2,4}"), [[ID[c] for c in "abab"], [ID[c] for c in "dddd"]]),
        (tiny_model, {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
            "type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4}},
            "required": ["a", "b"], "additionalProperties": False},
         [[ID[c] for c in "abcab"], [ID["{"], ID['"a'], ID['": '], ID["1"], ID[","]]]),
    ]
    changed = 0
    for model, schema, prompts in cases:
        base = run(model, tiny_tok, schema, prompts, params, None)
        plain = run(model, tiny_tok, schema, prompts, SamplingParams(max_tokens=40), None)
        changed += sum(a.output_ids != c.output_ids for a, c in zip(base, plain))
        for mode in ("forced", "ngram", "forced+ngram"):
            spec = run(model, tiny_tok, schema, prompts, params, MODES[mode])
            for a, b in zip(base, spec):
                assert a.output_ids == b.output_ids, (mode, guard, text(a), text(b))
                assert a.finish_reason == b.finish_reason
    assert changed > 0  # the guard did change some outputs: the identity is not vacuous


# an array of three {"a": digit} objects: the key and punctuation repeat in every item
ITEMS = table({("[", "{"): 5, ("{", '"a'): 5, ('"a', '": '): 5, ('": ', "1"): 5, ('": ', "2"): 4,
               ('": ', "3"): 3, ("1", "}"): 5, ("2", "}"): 5, ("3", "}"): 5, ("}", ","): 5,
               (",", " "): 5, (" ", "{"): 5, ("]", "<eos>"): 5, ("}", "]"): 1})
ITEMS_SCHEMA = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
    "additionalProperties": False}}


@pytest.mark.parametrize("mode", ["off", "forced+ngram"])
def test_grammar_forced_structure_is_exempt_from_the_guard(tiny_tok, mode):
    model = bigram_llama(ITEMS)
    params = SamplingParams(max_tokens=60, no_repeat_ngram_size=2)
    req = run(model, tiny_tok, ITEMS_SCHEMA, [[ID["["]]], params, MODES[mode])[0]
    assert req.finish_reason == "stop"
    # the free choices (the digits) were guarded; the forced key kept its own token each time
    assert json.loads(text(req)) == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert req.output_ids.count(ID['"a']) == 3


def test_a_row_whose_allowed_tokens_are_all_banned_keeps_the_grammar_mask(tiny_model, tiny_tok):
    params = SamplingParams(max_tokens=10, no_repeat_ngram_size=1)  # bans every token seen
    for mode in ("off", "forced+ngram"):
        req = run(tiny_model, tiny_tok, Regex("[ab]{6}"), [[ID["c"]]], params, MODES[mode])[0]
        out = text(req)
        assert req.finish_reason == "stop" and len(out) == 6
        assert out[0] != out[1]  # the ban did act while something else was allowed


def test_guard_rows_unit():
    logits = torch.tensor([[2.0, -1.0, 0.5, float("-inf")],    # row 0: prefix [0, 1]
                           [2.0, -1.0, 0.5, float("-inf")],    # row 1: prefix [0, 1, 0]
                           [float("-inf"), 3.0, float("-inf"), float("-inf")]])  # only 1 allowed
    params = SamplingParams(repetition_penalty=2.0, no_repeat_ngram_size=2)
    out = apply_repetition_guard(logits, [[0, 1, 0, 1]], [2], [params], [[False, False, False]])
    # row 0: penalty on tokens 0, 1; the bigram (1, x) was never seen: no ban
    assert out[0].tolist() == [1.0, -2.0, 0.5, float("-inf")]
    # row 1: prefix ends with 0 and (0, 1) was seen: 1 is banned
    assert out[1].tolist() == [1.0, float("-inf"), 0.5, float("-inf")]
    # row 2: prefix [0, 1, 0, 1] bans 0 after 1? (1, 0) seen -> 0 banned (already -inf); only 1
    # is allowed and it is not banned: kept, penalised
    assert out[2].tolist() == [float("-inf"), 1.5, float("-inf"), float("-inf")]
    exempt = apply_repetition_guard(logits, [[0, 1, 0, 1]], [2], [params], [[True, True, True]])
    assert torch.equal(exempt, logits)
    lone = torch.tensor([[float("-inf"), 3.0, float("-inf"), float("-inf")]])
    banned_all = apply_repetition_guard(lone, [[1]], [1], [SamplingParams(no_repeat_ngram_size=1)], [[False]])
    assert torch.equal(banned_all, lone)  # nothing else allowed: the grammar mask alone


def test_ngram_bans_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        seq = torch.randint(0, 4, (12,), generator=gen).tolist()
        for n in (1, 2, 3):
            got = ngram_bans(seq, n, 5)
            for p in range(5, len(seq) + 1):
                hist = seq[:p]
                want = {hist[i + n - 1] for i in range(len(hist) - n + 1)
                        if hist[i:i + n - 1] == hist[len(hist) - n + 1:] or n == 1}
                assert got[p - 5] == want, (seq, n, p)


# -- sampling: exact for the modified distribution ---------------------------------------------

PROMPT = [ID[c] for c in "ababcab"]
SAMPLE_GUARD = {"no_repeat_ngram_size": 2, "repetition_penalty": 2.0}


class RandomQDrafter(Drafter):
    """Samples each draft from an arbitrary distribution (random logits processed like the
    target's: grammar mask, repetition guard, temperature), so q is not a point mass."""

    name = "random-q"

    def propose(self, states, k):
        for st in states:
            for _ in range(k):
                if st.cursor.exhausted:
                    break
                raw = 2.0 * torch.randn(V, generator=st.generator)
                q = probs_from_logits(st.draft_logits(raw))
                if not bool(q.sum() > 0):
                    break
                tok = int(torch.multinomial(q, 1, generator=st.generator))
                if not st.push(tok, q):
                    break


def sample(model, compiled, params, spec, drafter, n: int) -> tuple[Counter, list]:
    runner = LeanRunner(model, dtype=torch.float32, device=torch.device("cpu"))
    eng = Engine(runner, speculative=spec, drafter=drafter, max_batch_size=n)
    reqs = [Request(PROMPT, compiled.new_matcher(), SamplingParams(**{**params.__dict__, "seed": 7000 + i}),
                    EOS) for i in range(n)]
    eng.run(reqs)
    assert all(r.finish_reason == "stop" for r in reqs)
    return Counter(tuple(r.output_ids) for r in reqs), reqs


@pytest.mark.parametrize("drafter", ["ngram", "random-q"])
def test_speculative_sampling_with_the_guard_is_exact(tiny_model, tiny_tok, drafter):
    compiled = compile_spec(normalize_schema(Regex("(a|b|ab|c){2,3}")), tiny_tok)
    params = SamplingParams(temperature=1.0, max_tokens=8, **SAMPLE_GUARD)
    exact = exact_distribution(tiny_model, compiled, params, V, PROMPT)
    assert abs(sum(exact.values()) - 1.0) < 1e-4
    unguarded = exact_distribution(tiny_model, compiled, SamplingParams(temperature=1.0, max_tokens=8), V, PROMPT)
    tv = 0.5 * sum(abs(exact.get(k, 0.0) - unguarded.get(k, 0.0)) for k in set(exact) | set(unguarded))
    assert tv > 0.05  # the guard really changes the distribution being tested
    n = 2000
    if drafter == "ngram":
        spec, d = SpeculativeConfig(method="ngram", num_speculative_tokens=3), NgramDrafter(3, 1)
    else:
        spec, d = SpeculativeConfig(method="ngram", num_speculative_tokens=3, forced=False), RandomQDrafter()
    counts, reqs = sample(tiny_model, compiled, params, spec, d, n)
    drafted = sum(r.stats.drafted_tokens for r in reqs)
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    assert drafted > n and 0 < accepted < drafted
    assert gof(counts, exact, n) > 1e-3


# -- option values --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,option", [
    ({"repetition_penalty": 0.9}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
    ({"no_repeat_ngram_size": 2.0}, "no_repeat_ngram_size"),
    ({"no_repeat_ngram_size": 1000}, "no_repeat_ngram_size"),
])
def test_bad_guard_values_raise_config_error(kwargs, option):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert info.value.option == option


def test_guard_off_by_default():
    assert not SamplingParams().guarded
    assert SamplingParams(no_repeat_ngram_size=3).guarded and SamplingParams(repetition_penalty=1.1).guarded
