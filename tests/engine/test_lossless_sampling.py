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
from cs_testlib import CHARS, exact_distribution, gof

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import Regex, normalize_schema

ALPHA = 1e-3
PROMPT = [CHARS.index(c) for c in "ababcab"]


def sample(model, compiled, params, spec, n: int) -> tuple[Counter[tuple[int, ...]], list[Request]]:
    runner = LeanRunner(model, dtype=torch.float32, device=torch.device("cpu"))
    drafter = NgramDrafter(3, 1) if spec is not None and spec.method == "ngram" else None
    eng = Engine(runner, speculative=spec, drafter=drafter, max_batch_size=n)
    reqs = [Request(PROMPT, compiled.new_matcher(),
                    SamplingParams(**{**params.__dict__, "seed": 1000 + i}), (0,)) for i in range(n)]
    eng.run(reqs)
    assert all(r.finish_reason == "stop" for r in reqs)
    return Counter(tuple(r.output_ids) for r in reqs), reqs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)],
                         ids=["plain", "topk_topp"])
def test_speculative_sampling_preserves_sequence_distribution(tiny_model, tiny_tok, temperature,
                                                              top_k, top_p):
    compiled = compile_spec(normalize_schema(Regex("(a|b|ab|c){2,3}")), tiny_tok)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=8)
    exact = exact_distribution(tiny_model, compiled, params, tiny_tok.vocab_size, PROMPT)
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
