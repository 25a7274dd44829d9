"""Lossless speculative SAMPLING: the distribution of sampled sequences is unchanged.

On a tiny model and a grammar with a small, enumerable language, the exact probability of
every token sequence is computed from the model (masked, renormalised, temperature, top-k,
top-p: the one definition in ``sampling.py``). Sequences sampled with speculation off and on
are each tested against it with a chi-square goodness-of-fit test at significance 0.001
(fixed seeds, so the test is deterministic).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from cs_testlib import CHARS
from scipy.stats import chisquare

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.runner import LlamaRunner
from constrained_spec.sampling import process_logits
from constrained_spec.schemas import Regex, normalize_schema

ALPHA = 1e-3
PROMPT = [CHARS.index(c) for c in "ababcab"]


def exact_distribution(model, compiled, params: SamplingParams, vocab: int) -> dict[tuple, float]:
    """P(sequence) for every complete token sequence, by walking the grammar."""
    out: dict[tuple, float] = {}
    words = (vocab + 31) // 32

    def walk(prefix: list[int], matcher, prob: float) -> None:
        if matcher.is_terminated() or matcher.must_stop():
            out[tuple(t for t in prefix if t != 0)] = out.get(tuple(t for t in prefix if t != 0), 0) + prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1:].float()
        mask = torch.empty((1, words), dtype=torch.int32)
        matcher.fill_bitmask(mask, 0)
        allowed = torch.tensor([(int(mask[0, t >> 5]) >> (t & 31)) & 1 for t in range(vocab)], dtype=torch.bool)
        logits[0, ~allowed] = float("-inf")
        logits = process_logits(logits, torch.tensor([params.temperature]), torch.tensor([params.top_k]),
                                torch.tensor([params.top_p]))
        probs = logits.softmax(-1)[0]
        for t in torch.nonzero(probs > 0).flatten().tolist():
            m = matcher.fork()
            assert m.accept(t)
            walk(prefix + [t], m, prob * float(probs[t]))

    walk([], compiled.new_matcher(), 1.0)
    return out


def sample(model, compiled, params, spec, n: int) -> Counter:
    runner = LlamaRunner(model, dtype=torch.float32, device=torch.device("cpu"))
    drafter = NgramDrafter(3, 1) if spec is not None and spec.method == "ngram" else None
    eng = Engine(runner, speculative=spec, drafter=drafter, max_batch_size=n)
    reqs = [Request(PROMPT, compiled.new_matcher(),
                    SamplingParams(**{**params.__dict__, "seed": 1000 + i}), (0,)) for i in range(n)]
    eng.run(reqs)
    assert all(r.finish_reason == "stop" for r in reqs)
    return Counter(tuple(r.output_ids) for r in reqs), reqs


def gof(counts: Counter, exact: dict[tuple, float], n: int) -> float:
    assert set(counts) <= set(exact), set(counts) - set(exact)
    keys = sorted(exact, key=lambda k: -exact[k])
    # pool rare outcomes so every expected count is >= 5
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:
        e = exact[k] * n
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            rest_o += counts.get(k, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)],
                         ids=["plain", "topk_topp"])
def test_speculative_sampling_preserves_sequence_distribution(tiny_model, tiny_tok, temperature,
                                                              top_k, top_p):
    compiled = compile_spec(normalize_schema(Regex("(a|b|ab|c){2,3}")), tiny_tok)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=8)
    exact = exact_distribution(tiny_model, compiled, params, tiny_tok.vocab_size)
    assert abs(sum(exact.values()) - 1.0) < 1e-4
    n = 2500
    off, _ = sample(tiny_model, compiled, params, None, n)
    on, reqs = sample(tiny_model, compiled, params,
                      SpeculativeConfig(method="ngram", num_speculative_tokens=3), n)
    # the speculative run really drafted, accepted some and rejected some
    drafted = sum(r.stats.drafted_tokens for r in reqs)
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    assert drafted > n and 0 < accepted < drafted
    assert gof(off, exact, n) > ALPHA
    assert gof(on, exact, n) > ALPHA
