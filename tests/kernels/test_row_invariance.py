"""Row invariance of the linear kernels and of the exact attention, on the machine the tests run.

An exact runner (`constrained_spec.model.runner.LeanRunner`) relies on two properties of the kernels
under it: a row multiplied among any number of rows comes out with the same bits as alone
(`weights.ROW_INVARIANT_KERNELS`, measured), and `exact_attention.chunked_attention` gives a
query the same bits whatever the other queries of the call, the batch, the masked key chunks
past its own or the first key a window layer reads (it calls the kernel in one shape only). If
a torch build or a CPU breaks either, these tests say which (and the exactness guarantee does
not hold there).
"""

from __future__ import annotations

import pytest
import torch

from constrained_spec.model.attention import KEY_CHUNK, QUERY_GROUP, chunk_mask, chunked_attention
from constrained_spec.model.runner import WINDOW_KEY_BLOCK, sdpa
from constrained_spec.model.weights import ROW_INVARIANT_KERNELS, Int4Groups, Linear, Q8Groups

ROWS = (1, 2, 3, 6, 7, 13, 24, 33, 64)


def exact_int4_linear(n: int, k: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    minimum = -torch.rand(n, k // 32, generator=g) * 0.1
    return Linear(int4=Int4Groups.from_values(q, scale, minimum))


def exact_q8_linear(n: int, k: int, seed: int) -> Linear:
    """A dense weight carrying its Q8_0 values (as a GGUF's LM head does): for the q8 kernel."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    w = (q.float().view(n, -1, 32) * scale[..., None]).view(n, k)
    return Linear(dense=w.bfloat16(), q8=Q8Groups(q, scale))


@pytest.mark.parametrize("kernel", sorted(ROW_INVARIANT_KERNELS))
def test_row_invariant_kernels_give_a_row_the_same_bits_among_any_number_of_rows(kernel):
    lin = exact_q8_linear(96, 128, seed=1) if kernel == "q8" else exact_int4_linear(96, 128, seed=1)
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


def qkv(positions: int, seed: int, heads: tuple[int, int, int] = (9, 3, 64)):
    """q [H, P, hd], k / v [KV, P, hd] in bf16 (default: the embedded model's attention)."""
    g = torch.Generator().manual_seed(seed)
    H, KV, hd = heads
    return [torch.randn(n, positions, hd, generator=g).bfloat16() for n in (H, KV, KV)]


def attend(q, k, v, positions, keys: int, *, first: int = 0, window: int | None = None, batch: int = 1):
    """`chunked_attention` of the queries at ``positions`` (rows of one request; ``batch``
    copies of it) over keys ``first..keys-1``, masked causally (and to ``window``), as the
    exact runner calls it -> [batch, T, H * hd]."""
    pos = torch.tensor(positions)
    j = torch.arange(first, keys)
    visible = j[None] <= pos[:, None]
    if window is not None:
        visible &= j[None] > pos[:, None] - window
    H, KV = q.shape[0], k.shape[0]
    qs = q[:, pos].permute(1, 0, 2)[None].expand(batch, -1, -1, -1)  # [B, T, H, hd]
    ks = k[:, first:keys].permute(1, 0, 2)[None].expand(batch, -1, -1, -1)  # [B, S, KV, hd]
    vs = v[:, first:keys].permute(1, 0, 2)[None].expand(batch, -1, -1, -1)
    mask = chunk_mask(visible[None].expand(batch, -1, -1), heads=H, kv_heads=KV, dtype=q.dtype)
    return chunked_attention(qs, ks, vs, mask)


def chunks_to(pos: int) -> int:
    """Keys a 1-row decode at ``pos`` reads: up to its own chunk's end."""
    return -(-(pos + 1) // KEY_CHUNK) * KEY_CHUNK


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 32), (4, 4, 16)])
def test_chunked_attention_gives_a_verify_row_the_bits_of_a_one_row_decode(heads):
    # the rows of a verify (T of them, spanning chunk and query-group boundaries), the same
    # rows batched with other requests and over more chunks (a longer request in the batch)
    q, k, v = qkv(1400, seed=3, heads=heads)
    for start in (0, 5, 250, 700, 1020):
        for T in (1, 2, 6, QUERY_GROUP, QUERY_GROUP + 5):
            rows = list(range(start, start + T))
            alone = torch.cat([attend(q, k, v, [p], chunks_to(p))[0] for p in rows])
            own = chunks_to(rows[-1])
            assert torch.equal(attend(q, k, v, rows, own)[0], alone), (start, T)
            longer = min(own + 2 * KEY_CHUNK, 1400 - 1400 % KEY_CHUNK)
            assert torch.equal(attend(q, k, v, rows, longer, batch=3)[2], alone), (start, T, "batch")


def test_chunked_attention_of_a_window_layer_does_not_depend_on_the_first_key_read():
    q, k, v = qkv(2600, seed=5)
    window = 300
    for pos in (900, 1300, 2000):
        first = (pos - window + 1) // WINDOW_KEY_BLOCK * WINDOW_KEY_BLOCK
        alone = attend(q, k, v, [pos], chunks_to(pos), first=first, window=window)
        for earlier in range(0, first, WINDOW_KEY_BLOCK):  # a batch with an earlier request
            got = attend(q, k, v, [pos], chunks_to(pos) + KEY_CHUNK, first=earlier, window=window)
            assert torch.equal(got, alone), (pos, earlier)


def test_chunked_attention_is_attention():
    q, k, v = qkv(3 * KEY_CHUNK, seed=7)
    rows = [3, 130, KEY_CHUNK - 1, KEY_CHUNK, 2 * KEY_CHUNK + 20]
    got = attend(q, k, v, rows, 3 * KEY_CHUNK)[0].float().view(len(rows), 9, 64)
    kk, vv = k.float().repeat_interleave(3, 0), v.float().repeat_interleave(3, 0)  # [H, P, hd]
    for i, p in enumerate(rows):
        scores = (q[:, p].float()[:, None] * kk[:, : p + 1]).sum(-1) / 8  # [H, p + 1]
        want = (scores.softmax(-1)[:, :, None] * vv[:, : p + 1]).sum(1)
        assert torch.allclose(got[i], want, atol=2e-2, rtol=2e-2), p


def test_chunk_mask_refuses_keys_that_are_not_whole_chunks():
    with pytest.raises(ValueError, match="whole chunks"):
        chunk_mask(torch.ones(1, 1, KEY_CHUNK + 1, dtype=torch.bool), heads=2, kv_heads=1,
                   dtype=torch.bfloat16)


def sdpa_row(q, k, v, pos: int, keys: int):
    """One query at ``pos`` (a row of ``q`` [H, P, hd]) over keys ``0..keys-1`` of k / v
    [KV, P, hd], masked causally, through `runner.sdpa` (a not-exact decode's attention)."""
    visible = torch.arange(keys) <= pos
    return sdpa(q[None, :, pos: pos + 1], k[None, :, :keys], v[None, :, :keys],
                visible[None, None, None])[0, :, 0]


@pytest.mark.parametrize("keys", [1, 70, 1000])
def test_a_single_query_padded_to_two_is_its_attention(keys):
    # the runner's sdpa sends one query twice (the CPU kernel's one-query path is slower):
    # the result is that query's attention, to bf16 rounding
    q, k, v = qkv(keys, seed=6, heads=(6, 2, 16))
    pos = keys - 1
    got = sdpa_row(q, k, v, pos, keys).float()
    G = q.shape[0] // k.shape[0]
    kk, vv = k.float().repeat_interleave(G, 0), v.float().repeat_interleave(G, 0)
    scores = (q[:, pos].float()[:, None] * kk[:, :keys]).sum(-1) / q.shape[-1] ** 0.5  # [H, keys]
    want = (scores.softmax(-1)[:, :, None] * vv[:, :keys]).sum(1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
