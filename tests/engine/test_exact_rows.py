"""An exact runner computes every row as it would be computed alone (tiny random models, ms).

- A verify forward of K+1 rows gives each row the same bits as K+1 1-row decodes, and so does
  the same verify batched with other requests of other lengths (padding), in bfloat16, on the
  dense bf16 kernel and on the int4 kernel.
- A prompt gives the same KV cache prefilled whole, in chunks, or batched with other prompts.
- In float32 (MKL's GEMM is not row-invariant) a batch of prompts still fills each prompt's
  cache as it would alone: the runner prefills them one at a time.
"""

from __future__ import annotations

import pytest
import torch
from cs_testlib import tiny_llama

from constrained_spec.model.plan import KernelPlan
from constrained_spec.model.runner import KEY_BLOCK, LeanRunner, exact_4bit_groups

CPU = torch.device("cpu")
V = 40


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=V, max_positions=2048)


@pytest.fixture(scope="module")
def int4_model():
    from test_runner_int4 import quantized_tiny_llama

    return quantized_tiny_llama()


def runner_for(model, kernel: str) -> LeanRunner:
    if kernel == "int4":
        groups = exact_4bit_groups(model)
        if groups is None:
            pytest.skip("no CPU int4 kernel in this torch build")
        runner = LeanRunner(model, dtype=torch.bfloat16, device=CPU, groups=groups)
    else:
        runner = LeanRunner(model, dtype=torch.bfloat16, device=CPU)
    runner.set_plan(KernelPlan(prefill=kernel, decode=[(1 << 30, kernel)], lm_head="bf16"))
    assert runner.exact
    return runner


@pytest.mark.parametrize("kernel", ["bf16", "int4"])
@pytest.mark.parametrize("prompt_len", [3, 60, 64, 130, 700])
def test_verify_rows_and_batched_rows_equal_one_row_decodes(model, int4_model, kernel, prompt_len):
    runner = runner_for(int4_model if kernel == "int4" else model, kernel)
    prompt, drafts = random_tokens(prompt_len, 1), random_tokens(6, 2)
    alone = runner.new_slot()
    runner.forward([alone], [prompt], [0])
    decodes = torch.cat([runner.forward([alone], [[t]], [1]) for t in drafts])  # [6, V]

    verify = runner.new_slot()
    runner.forward([verify], [prompt], [0])
    assert torch.equal(runner.forward([verify], [drafts], [6]), decodes)

    # the same verify among a shorter and a longer request, each verifying fewer rows
    short, long_, mine = runner.new_slot(), runner.new_slot(), runner.new_slot()
    runner.forward([short, mine, long_], [prompt[:2], prompt, prompt + random_tokens(90, 3)], [0, 0, 0])
    logits = runner.forward([short, mine, long_], [drafts[:1], drafts, drafts[:3]], [1, 6, 3])
    assert torch.equal(logits[1:7], decodes)


def test_a_prompt_fills_the_same_cache_whole_chunked_or_batched(model):
    runner = runner_for(model, "bf16")
    prompt = random_tokens(300, 4)
    whole, chunked, batched, other = (runner.new_slot() for _ in range(4))
    runner.forward([whole], [prompt], [0])
    for a, b in ((0, 37), (37, 100), (100, 300)):
        runner.forward([chunked], [prompt[a:b]], [0])
    runner.forward([other, batched], [random_tokens(500, 5), prompt], [0, 0])
    for cache in runner.k_cache + runner.v_cache:
        assert torch.equal(cache[chunked, :300], cache[whole, :300])
        assert torch.equal(cache[batched, :300], cache[whole, :300])


def test_float32_prompts_batched_fill_each_cache_as_alone(model):
    runner = LeanRunner(model, dtype=torch.float32, device=CPU)
    prompts = [random_tokens(n, n) for n in (5, 40, 130)]
    together = [runner.new_slot() for _ in prompts]
    runner.forward(together, prompts, [0] * 3)
    for slot, p in zip(together, prompts):
        alone = runner.new_slot()
        runner.forward([alone], [p], [0])
        for cache in runner.k_cache + runner.v_cache:
            assert torch.equal(cache[slot, : len(p)], cache[alone, : len(p)])


def test_a_runner_that_is_not_exact_reads_only_the_keys_it_needs(model):
    runner = LeanRunner(model, dtype=torch.bfloat16, device=CPU, exact=False)
    s = runner.new_slot()
    runner.forward([s], [random_tokens(70, 6)], [0])
    assert runner._batch([s], [[1, 2]], "decode").Lk == 72
    runner.exact = True
    assert runner._batch([s], [[1, 2]], "decode").Lk == KEY_BLOCK  # whole key chunks


def test_an_exact_plan_runs_every_decode_row_count_on_one_row_invariant_kernel():
    from constrained_spec.model.plan import _decode_buckets
    from constrained_spec.model.weights import ROW_INVARIANT_KERNELS

    times = {1: {"fp32": 1.0, "bf16": 3.0, "int4": 2.0},  # ms per forward of that many rows
             6: {"fp32": 2.0, "bf16": 2.6, "int4": 2.5},
             24: {"fp32": 3.0, "bf16": 4.0, "int4": 9.0}}
    assert {k for _, k in _decode_buckets(times)} == {"fp32"}
    exact = _decode_buckets(times, exact=True)
    assert len(exact) == 1 and exact[0][1] in ROW_INVARIANT_KERNELS
    assert exact[0][1] == "bf16"  # closest to the fastest over 1, 6 and 24 rows (int4: 3x at 24)


def test_an_exact_runner_ignores_row_buckets_of_a_fixed_plan(model):
    runner = LeanRunner(model, dtype=torch.bfloat16, device=CPU)
    runner.set_plan(KernelPlan.parse("prefill=bf16,decode=int8:4/bf16,lm_head=bf16"))
    s = runner.new_slot()
    assert runner._batch([s], [[1] * 12], "decode").kernel == "int8"  # the 1-row kernel
    runner.exact = False
    assert runner._batch([s], [[1] * 12], "decode").kernel == "bf16"


def family_names() -> list[str]:
    from test_runner_families import FAMILIES

    # phi3's longrope picks its factors from the last position of each call (as transformers
    # does per sequence): a verify crossing that position differs from 1-row decodes, by design
    return [f for f in FAMILIES if f != "phi3"]


@pytest.mark.parametrize("name", family_names())
def test_every_lean_family_computes_verify_and_batched_rows_as_one_row_decodes(name):
    from test_runner_families import model_of

    fam_model = model_of(name)
    runner = LeanRunner(fam_model, dtype=torch.bfloat16, device=CPU)
    vocab = fam_model.config.vocab_size
    prompt = [3 + t % (vocab - 3) for t in random_tokens(70, 7)]
    drafts = [3 + t % (vocab - 3) for t in random_tokens(6, 8)]
    alone = runner.new_slot()
    runner.forward([alone], [prompt], [0])
    decodes = torch.cat([runner.forward([alone], [[t]], [1]) for t in drafts])
    mine, other = runner.new_slot(), runner.new_slot()
    runner.forward([other, mine], [prompt[:2], prompt], [0, 0])
    assert torch.equal(runner.forward([other, mine], [drafts[:1], drafts], [1, 6])[1:], decodes)


@pytest.mark.parametrize("prompt_len", [37, 300, 700])
def test_the_embedded_model_verifies_rows_as_one_row_decodes_in_its_own_plan(embedded, prompt_len):
    """At the embedded model's shapes (9 query heads over 3, head dim 64), where SDPA reduces
    a query among several in another order than alone, and its plan's kernels."""
    runner = embedded.runner
    assert runner.exact
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
    drafts = torch.randint(100, 40000, (6,), generator=g).tolist()
    slots = [runner.new_slot() for _ in range(4)]
    try:
        alone, verify, other = slots[0], slots[1], slots[2]
        runner.forward([alone], [prompt], [0])
        decodes = torch.cat([runner.forward([alone], [[t]], [1]) for t in drafts])
        runner.forward([verify], [prompt], [0])
        assert torch.equal(runner.forward([verify], [drafts], [6]), decodes)
        runner.forward([other, slots[3]], [prompt[:20], prompt], [0, 0])
        logits = runner.forward([other, slots[3]], [drafts[:2], drafts], [2, 6])
        assert torch.equal(logits[2:], decodes)
    finally:
        for s in slots:
            runner.free_slot(s)


def test_exact_is_the_default_on_a_cpu_and_a_bad_value_names_the_variable(cs_env, model):
    from constrained_spec.errors import ConfigError
    from constrained_spec.model.plan import exact_mode

    cuda = torch.device("cuda")
    cs_env(CONSTRAINED_SPEC_EXACT=None)
    assert exact_mode() is True and exact_mode(CPU) is True
    assert exact_mode(cuda) is False  # the chunked attention is a CPU kernel
    assert LeanRunner(model, dtype=torch.bfloat16, device=CPU).exact
    cs_env(CONSTRAINED_SPEC_EXACT="0")  # the opt-out
    assert exact_mode() is False and not LeanRunner(model, dtype=torch.bfloat16, device=CPU).exact
    cs_env(CONSTRAINED_SPEC_EXACT="1")
    assert exact_mode() is True
    with pytest.raises(ConfigError, match="CPU only"):
        exact_mode(cuda)  # asked for where it cannot hold: said, not ignored
    with pytest.raises(ConfigError, match="CONSTRAINED_SPEC_EXACT"):
        cs_env(CONSTRAINED_SPEC_EXACT="yes please")
    with pytest.raises(ConfigError, match="CONSTRAINED_SPEC_EXACT"):
        exact_mode()  # and on every read until the value is fixed
