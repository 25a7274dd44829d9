"""Row invariance of the linear kernels and of the exact attention, on the machine the tests run.

An exact runner (`constrained_spec.runner.LeanRunner`) relies on two measured properties of the
kernels under it: a row multiplied among any number of rows comes out with the same bits as
alone (`weights.ROW_INVARIANT_KERNELS`), and SDPA reduces a query over keys read in whole
`runner.KEY_BLOCK` blocks from position 0 the same way whatever the number of queries, the
masked keys past its own block, or the batch. If a torch build or a CPU breaks either, these
tests say which (and the exactness guarantee does not hold there).
"""

from __future__ import annotations

import pytest
import torch

from constrained_spec.runner import KEY_BLOCK, WINDOW_KEY_BLOCK, sdpa
from constrained_spec.weights import ROW_INVARIANT_KERNELS, Int4Groups, Linear

ROWS = (1, 2, 3, 6, 7, 13, 24, 33, 64)


def exact_int4_linear(n: int, k: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    minimum = -torch.rand(n, k // 32, generator=g) * 0.1
    return Linear(int4=Int4Groups.from_values(q, scale, minimum))


@pytest.mark.parametrize("kernel", sorted(ROW_INVARIANT_KERNELS))
def test_row_invariant_kernels_give_a_row_the_same_bits_among_any_number_of_rows(kernel):
    lin = exact_int4_linear(96, 128, seed=1)
    if not lin.supports(kernel):
        pytest.skip(f"no {kernel} kernel in this torch build")
    x = torch.randn(max(ROWS), 128, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([lin(x[i: i + 1], kernel) for i in range(max(ROWS))])
    for rows in ROWS:
        assert torch.equal(lin(x[:rows], kernel), alone[:rows]), f"{kernel}: {rows} rows"


def test_an_exact_bf16_product_gives_a_row_the_same_bits_among_any_number_of_rows():
    # K > 1024: oneDNN's 1-row GEMV reduces in another order than its GEMM (padded to 2 rows)
    g = torch.Generator().manual_seed(3)
    lin = Linear(dense=(torch.randn(64, 1536, generator=g) * 0.05).bfloat16())
    x = torch.randn(max(ROWS), 1536, generator=g).bfloat16()
    alone = torch.cat([lin(x[i: i + 1], "bf16", row_invariant=True) for i in range(max(ROWS))])
    for rows in ROWS:
        assert torch.equal(lin(x[:rows], "bf16", row_invariant=True), alone[:rows]), rows


def test_float32_is_not_listed_as_row_invariant():
    # MKL's fp32 GEMM blocks by shape: a row among 6 differs from the row alone (measured),
    # which is why an exact plan keeps decode and the LM head off fp32
    assert "fp32" not in ROW_INVARIANT_KERNELS


def sdpa_row(q, k, v, pos: int, start: int, keys: int, window: int | None = None):
    """One query at ``pos`` (a row of ``q`` [H, P, hd]) over keys ``start..keys-1`` of k / v
    [KV, P, hd], masked causally (and to ``window``), through SDPA as the runner calls it."""
    j = torch.arange(start, keys)
    visible = j <= pos if window is None else (j <= pos) & (j > pos - window)
    return sdpa(q[None, :, pos: pos + 1], k[None, :, start:keys], v[None, :, start:keys],
                visible[None, None, None])[0, :, 0]


def qkv(positions: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    H, KV, hd = 6, 2, 16
    return [torch.randn(n, positions, hd, generator=g).bfloat16() for n in (H, KV, KV)]


def test_attention_reduces_a_query_over_the_same_key_blocks_whatever_keys_follow():
    q, k, v = qkv(1400, seed=3)
    for pos in (0, 5, 63, 64, 200, 511, 700, 1100):
        own = -(-(pos + 1) // KEY_BLOCK) * KEY_BLOCK  # a 1-row decode reads up to its own block
        alone = sdpa_row(q, k, v, pos, 0, own)
        for extra in (1, 2, 5):  # a verify forward, a longer request in the batch
            longer = min(own + extra * KEY_BLOCK, 1400 - 1400 % KEY_BLOCK)
            assert torch.equal(sdpa_row(q, k, v, pos, 0, longer), alone), (pos, extra)


def test_attention_of_a_query_does_not_depend_on_the_other_queries_or_the_batch():
    q, k, v = qkv(640, seed=4)
    keys, T = 640, 6
    pos = torch.arange(300, 300 + T)
    mask = (torch.arange(keys)[None] <= pos[:, None])[None, None]  # [1, 1, T, keys]
    together = sdpa(q[None, :, 300:300 + T], k[None, :, :keys], v[None, :, :keys], mask)[0]
    batched = sdpa(q[None, :, 300:300 + T].expand(3, -1, -1, -1), k[None, :, :keys].expand(3, -1, -1, -1),
                   v[None, :, :keys].expand(3, -1, -1, -1), mask.expand(3, -1, -1, -1))
    for t in range(T):
        alone = sdpa_row(q, k, v, 300 + t, 0, keys)
        assert torch.equal(together[:, t], alone) and torch.equal(batched[2, :, t], alone), t


def test_window_attention_reduces_the_same_way_from_any_earlier_window_block():
    q, k, v = qkv(2200, seed=5)
    window = 300
    for pos in (900, 1300, 2000):
        first = (pos - window + 1) // WINDOW_KEY_BLOCK * WINDOW_KEY_BLOCK
        own = -(-(pos + 1) // KEY_BLOCK) * KEY_BLOCK
        alone = sdpa_row(q, k, v, pos, first, own, window)
        for earlier in range(0, first, WINDOW_KEY_BLOCK):  # a batch with an earlier request
            assert torch.equal(sdpa_row(q, k, v, pos, earlier, own + KEY_BLOCK, window), alone), (pos, earlier)


@pytest.mark.parametrize("keys", [1, 70, 1000])
def test_a_single_query_padded_to_two_is_its_attention(keys):
    # the runner's sdpa sends one query twice (the CPU kernel's one-query path is slower):
    # the result is that query's attention, to bf16 rounding
    q, k, v = qkv(keys, seed=6)
    pos = keys - 1
    got = sdpa_row(q, k, v, pos, 0, keys).float()
    G = q.shape[0] // k.shape[0]
    kk, vv = k.float().repeat_interleave(G, 0), v.float().repeat_interleave(G, 0)
    scores = (q[:, pos].float()[:, None] * kk[:, :keys]).sum(-1) / q.shape[-1] ** 0.5  # [H, keys]
    want = (scores.softmax(-1)[:, :, None] * vv[:, :keys]).sum(1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
