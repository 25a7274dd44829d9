"""Prompt prefixes computed once (model/prefix_cache.py): what a cached prefix gives is what a
computed one gives, bit for bit; the cache stays within its bytes; chains match from the start."""

from __future__ import annotations

import itertools

import pytest
import torch
from cs_testlib import tiny_llama
from test_engine_tiny import EOS, SCHEMAS
from test_exact_rows import random_tokens, runner_for

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.model import prefix_cache
from constrained_spec.model.prefix_cache import BLOCK, PrefixCache
from constrained_spec.schemas import normalize_schema


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=40, max_positions=2048)


def next_logits(runner, slot: int, tokens: list[int]) -> torch.Tensor:
    """Logits of ``tokens`` fed one at a time after what ``slot`` holds."""
    return torch.cat([runner.forward([slot], [[t]], [1]) for t in tokens])


@pytest.mark.parametrize("kernel", ["bf16", "int4"])
def test_a_prefix_read_from_the_cache_gives_the_bits_a_computed_one_gives(model, kernel):
    if kernel == "int4":
        from test_runner_int4 import quantized_tiny_llama

        model = quantized_tiny_llama()
    shared = random_tokens(5 * BLOCK + 3, 1)
    first, second = shared + random_tokens(20, 2), shared + random_tokens(9, 3)
    runner = runner_for(model, kernel)
    a = runner.new_slot()
    assert runner.prefill([a], [first]) == [len(first)]  # nothing cached yet
    b = runner.new_slot()
    computed = runner.prefill([b], [second])  # the shared whole blocks come from the cache
    assert computed == [len(second) - 5 * BLOCK]
    after = random_tokens(6, 4)
    cached = next_logits(runner, b, after)

    fresh = runner_for(model, kernel)
    fresh.prefiller.cache.max_bytes = 0  # no cache: every prompt on the plan's prefill path
    c = fresh.new_slot()
    assert fresh.prefill([c], [second]) == [len(second)]
    plain = next_logits(fresh, c, after)
    # the cached path writes the values the row-invariant path computes for every position
    again = runner_for(model, kernel)
    d = again.new_slot()
    again.prefiller.cache.clear()
    again.prefill([d], [second])
    assert torch.equal(cached, next_logits(again, d, after))
    assert torch.allclose(cached, plain, atol=0.1, rtol=0)  # the plan's prefill kernels: close


def test_batched_prompts_read_and_fill_the_cache_as_each_alone(model):
    runner = runner_for(model, "bf16")
    base = random_tokens(3 * BLOCK, 5)
    prompts = [base + random_tokens(n, 6 + n) for n in (1, 17, 40)] + [random_tokens(30, 9)]
    slots = [runner.new_slot() for _ in prompts]
    runner.prefill(slots, prompts)
    after = random_tokens(3, 10)
    together = [next_logits(runner, s, after) for s in slots]
    for p, want in zip(prompts, together):
        alone = runner_for(model, "bf16")
        s = alone.new_slot()
        alone.prefill([s], [p])
        assert torch.equal(next_logits(alone, s, after), want)


def test_greedy_outputs_are_the_same_whether_prefixes_are_found_or_not(tiny_model, tiny_tok):
    from test_exact_rows import runner_for as exact_runner

    params = SamplingParams(max_tokens=24)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    compiled = [compile_spec(normalize_schema(s), tiny_tok) for s in SCHEMAS]
    system = [5, 6, 7, 8, 9, 10, 11, 12] * 5  # a shared "system message"
    prompts = [system + [3 + i, 4, 3 + i] for i in range(3)]

    def run(cache: bool) -> tuple[list[Request], int]:
        from constrained_spec.drafters.ngram import NgramDrafter

        runner = exact_runner(tiny_model, "bf16")
        if not cache:
            runner.prefiller.cache.max_bytes = 0
        eng = Engine(runner, speculative=spec, drafter=NgramDrafter(4, 1), max_batch_size=4)
        reqs = [Request(list(p), c.new_matcher(), params, EOS) for p, c in itertools.product(prompts, compiled)]
        eng.run(reqs)
        return reqs, sum(r.stats.cached_prompt_tokens for r in reqs)

    found, cached = run(True)
    computed, none = run(False)
    assert cached > 0 and none == 0
    assert [(r.output_ids, r.finish_reason) for r in found] == [(r.output_ids, r.finish_reason) for r in computed]


def test_a_long_prompt_takes_the_plan_prefill_and_is_not_cached(model, monkeypatch):
    monkeypatch.setattr(prefix_cache, "INVARIANT_MAX", 3 * BLOCK)
    runner = runner_for(model, "bf16")
    long_prompt = random_tokens(4 * BLOCK, 11)
    s = runner.new_slot()
    assert runner.prefill([s], [long_prompt]) == [len(long_prompt)]
    assert len(runner.prefiller.cache) == 0
    t = runner.new_slot()
    assert runner.prefill([t], [long_prompt]) == [len(long_prompt)]  # never read either


def test_kept_hidden_states_come_back_with_their_block(model):
    runner = runner_for(model, "bf16")
    runner.enable_features([1, 2])
    prompt = random_tokens(2 * BLOCK + 5, 12)
    a, b = runner.new_slot(), runner.new_slot()
    runner.prefill([a], [prompt])
    assert runner.prefill([b], [prompt]) == [5]
    assert torch.equal(runner.features(a, 0, len(prompt), [1, 2]), runner.features(b, 0, len(prompt), [1, 2]))


def _fill(cache: PrefixCache, tokens: list[int], blocks: int) -> None:
    cache.add(tokens, blocks, lambda i: [torch.full((BLOCK, 4), float(i))])  # 256 bytes a block


def test_the_cache_stays_within_its_bytes_and_drops_the_least_recent_first():
    cache = PrefixCache(max_bytes=5 * 256)
    a, b = list(range(3 * BLOCK)), list(range(100, 100 + 3 * BLOCK))
    _fill(cache, a, 3)
    _fill(cache, b, 3)  # 6 blocks: one over, a's oldest goes... its last block first
    assert cache.bytes <= cache.max_bytes and len(cache) == 5
    assert len(cache.match(b)) == 3
    assert len(cache.match(a)) == 2  # a's chain lost its end, never its start
    _fill(cache, list(range(200, 200 + 5 * BLOCK)), 5)
    assert len(cache) == 5 and cache.bytes == 5 * 256 and len(cache.match(b)) == 0


def test_a_block_is_found_only_after_the_blocks_before_it():
    cache = PrefixCache(max_bytes=1 << 20)
    prompt = list(range(2 * BLOCK))
    _fill(cache, prompt, 2)
    assert len(cache.match(prompt + [7])) == 2
    assert len(cache.match(prompt[BLOCK:] + prompt[:BLOCK])) == 0  # the second block first: no
    assert len(cache.match(prompt[:BLOCK] + [0] * BLOCK)) == 1  # the first block alone
    assert len(cache.match(prompt[: 2 * BLOCK - 1])) == 1  # a partial block is never matched
