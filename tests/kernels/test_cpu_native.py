"""The q4 / q8 CPU kernels (`kernels.cpu_native`): results against the float32 product of the
file's dequantized weights, row invariance, the packs, and what happens without a compiler.

Every build this CPU can run is tested (an AVX-512-BF16 machine runs the AVX2 build too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from constrained_spec.kernels import cpu_native
from constrained_spec.model.weights import Int4Groups, Linear, Q8Groups

BUILDS = [b for b in cpu_native.BUILDS if cpu_native.available(b)] if cpu_native.available() else []
pytestmark = pytest.mark.skipif(not BUILDS, reason="the q4 kernel does not build on this machine")
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 17)


def groups(n: int, k: int, seed: int, *, half: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4
    minimum = -torch.rand(n, k // 32, generator=g) * 0.1
    if half:
        scale, minimum = scale.half().float(), minimum.half().float()
    return q, scale, minimum


def q8_groups(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    return q, (torch.rand(n, k // 32, generator=g) * 0.01).half().float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("half", [True, False])
def test_q4_equals_the_float32_product_of_the_dequantized_weights(build, half):
    q, scale, minimum = groups(96, 192, seed=1, half=half)
    p = cpu_native.pack(q, scale, minimum, build=build)
    assert p.half == half  # float16 scales kept as float16 (exact), others as float32
    w = Int4Groups.from_values(q, scale, minimum).dequantize()
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(2)).bfloat16()
    want = x.float() @ w.T
    y32 = cpu_native.matmul(x, p, out_dtype=torch.float32)
    assert rel_err(y32, want) < 1e-5  # torch's int4 kernel: ~3e-3 (bf16 scales and output)
    assert torch.equal(cpu_native.matmul(x, p), y32.bfloat16())  # bf16 out: the fp32 result, rounded


@pytest.mark.parametrize("build", BUILDS)
def test_q8_equals_the_float32_product_of_the_q8_0_values(build):
    q, scale = q8_groups(160, 128, seed=3)
    p = cpu_native.pack_q8(q, scale, build=build)
    w = (q.float().view(160, -1, 32) * scale[..., None]).view(160, 128)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = cpu_native.matmul(x, p, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and rel_err(y, x.float() @ w.T) < 1e-5
    assert torch.equal(cpu_native.matmul(x, p), y.bfloat16())  # bf16 by default


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_has_the_same_bits_among_any_number_of_rows(build, bits):
    if bits == 4:
        p = cpu_native.pack(*groups(64, 96, seed=5, half=True), build=build)
    else:
        p = cpu_native.pack_q8(*q8_groups(64, 96, seed=5), build=build)
    x = torch.randn(max(ROWS), 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    alone = torch.cat([cpu_native.matmul(x[i: i + 1], p) for i in range(max(ROWS))])
    for rows in ROWS:  # across the row blocks of 4 (AVX2), 8 (AVX-512) and 16 (AMX tiles)
        assert torch.equal(cpu_native.matmul(x[:rows], p), alone[:rows]), rows
    assert torch.equal(cpu_native.matmul(x[[5, 0, 3]], p), alone[[5, 0, 3]])  # any order


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("tiles", [1, 3, 13, 24, 37])
def test_a_row_has_the_same_bits_whatever_tiles_share_its_work(build, tiles):
    # the AVX2 build runs 1..8 tiles at once by the row count, the tile count and the threads
    # (q4_tiles / q4_unit): every split gives each row the one-tile block's bits
    n = tiles * cpu_native.tile(build)
    p = cpu_native.pack(*groups(n, 64, seed=7, half=False), build=build)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    alone = torch.cat([cpu_native.matmul(x[i: i + 1], p, out_dtype=torch.float32) for i in range(9)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):  # (torch's OpenMP threads are the kernels')
            torch.set_num_threads(threads)
            for rows in range(1, 10):
                got = cpu_native.matmul(x[:rows], p, out_dtype=torch.float32)
                assert torch.equal(got, alone[:rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("build", BUILDS)
def test_pack_gives_back_q_and_rejects_what_does_not_fit(build):
    q, scale, minimum = groups(32, 64, seed=7, half=False)
    assert torch.equal(cpu_native.unpack_q(cpu_native.pack(q, scale, minimum, build=build)), q)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.pack(q[:, :48], scale[:, :1], minimum[:, :1], build=build)  # K not a multiple of 32
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.pack(q[:4], scale[:4], minimum[:4], build=build)  # N not a multiple of the tile
    p = cpu_native.pack(q, scale, minimum, build=build)
    with pytest.raises(ValueError, match="inputs"):
        cpu_native.matmul(torch.zeros(1, 32), p)
    assert cpu_native.matmul(torch.zeros(0, 64), p).shape == (0, 32)
    assert cpu_native.matmul(torch.zeros(2, 3, 64), p).shape == (2, 3, 32)


def test_4_bit_groups_read_back_from_the_q4_pack_once_their_nibbles_are_dropped():
    q, scale, minimum = groups(64, 128, seed=8, half=True)
    lin = Linear(int4=Int4Groups.from_values(q, scale, minimum))
    want = lin.int4.dequantize()
    before = lin.nbytes()
    lin.prepare({"q4"})
    assert lin.int4.nibbles is None and lin.int4.q4 is not None  # q held once: in the pack
    assert torch.equal(lin.int4.values(), q) and torch.equal(lin.int4.dequantize(), want)
    # the float32 scales and mins are held in the pack only, as float16, and read back exactly
    assert lin.int4.held_tensors() == [lin.int4.q4.data]
    assert torch.equal(lin.int4.scale, scale) and torch.equal(lin.int4.min, minimum)
    assert lin.nbytes() == before - 64 * 4 * 4 * 2 + 64 * 4 * 2 * 2
    x = torch.randn(3, 128).bfloat16()
    assert rel_err(lin(x, "q4"), x.float() @ want.T) < 1e-2  # bf16 out
    lin.prepare({"int4"})  # torch's pack built from the q4 pack's values
    assert torch.equal(lin.int4.values(), q)


@pytest.mark.parametrize("build", BUILDS)
def test_q8_in_groups_of_16_equals_the_float32_product_row_invariant(build):
    g = torch.Generator().manual_seed(21)
    q = torch.randint(-32, 32, (64, 160), generator=g).to(torch.int8)  # Q6_K-like values
    scale = torch.rand(64, 10, generator=g) * 0.01 + 1e-4  # d * sc: not float16 values
    p = cpu_native.pack_q8(q, scale, build=build)
    assert p.group == 16 and not p.has_min and not p.half
    back = cpu_native.unpack_q8(p)
    assert torch.equal(back[0], q) and torch.equal(back[1], scale) and back[2] is None
    w = Q8Groups(q, scale).dequantize()
    x = torch.randn(max(ROWS), 160, generator=g).bfloat16()
    y = cpu_native.matmul(x, p, out_dtype=torch.float32)
    assert rel_err(y, x.float() @ w.T) < 1e-5
    alone = torch.cat([cpu_native.matmul(x[i: i + 1], p, out_dtype=torch.float32) for i in range(len(x))])
    for rows in ROWS:
        assert torch.equal(cpu_native.matmul(x[:rows], p, out_dtype=torch.float32), alone[:rows]), rows


@pytest.mark.parametrize("build", BUILDS)
def test_q8_with_mins_equals_the_float32_product_and_its_pack_reads_back(build):
    g = torch.Generator().manual_seed(16)
    q = torch.randint(0, 32, (96, 128), generator=g).to(torch.int8)  # Q5_1 / Q5_K-like values
    scale = (torch.rand(96, 4, generator=g) * 0.01).half().float()
    minimum = (-torch.rand(96, 4, generator=g) * 0.1).half().float()
    p = cpu_native.pack_q8(q, scale, minimum, build=build)
    assert p.has_min and p.half
    back = cpu_native.unpack_q8(p)
    assert torch.equal(back[0], q) and torch.equal(back[1], scale) and torch.equal(back[2], minimum)
    w = Q8Groups(q, scale, minimum).dequantize()
    x = torch.randn(5, 128, generator=g).bfloat16()
    y = cpu_native.matmul(x, p, out_dtype=torch.float32)
    assert rel_err(y, x.float() @ w.T) < 1e-5
    assert torch.equal(cpu_native.matmul(x, p), y.bfloat16())


def test_a_linear_of_8_bit_groups_alone_runs_q8_and_reads_back_from_its_pack():
    g = torch.Generator().manual_seed(17)
    q = torch.randint(-16, 16, (64, 96), generator=g).to(torch.int8)  # Q5_0-like
    groups = Q8Groups(q, (torch.rand(64, 3, generator=g) * 0.01).half().float())
    w = groups.dequantize()
    lin = Linear(q8=groups)
    assert lin.shape == (64, 96) and lin.supports("q8") and not lin.supports("q4")
    x = torch.randn(3, 96, generator=g).bfloat16()
    y = lin(x, "q8")
    assert y.dtype == torch.bfloat16 and rel_err(y, x.float() @ w.T) < 1e-2
    # the pack holds the values now, for every holder of the groups: the dense paths and the
    # groups themselves read them back from it
    assert groups.held_tensors() == [lin._packs["q8"].data] and groups.pack is lin._packs["q8"]
    assert torch.equal(groups.q, q) and torch.equal(groups.dequantize(), w)
    assert torch.equal(lin.dequantized(torch.float32), w) and lin.shape == (64, 96)
    assert torch.equal(lin(x, "bf16"), F.linear(x, w.bfloat16()))
    with pytest.raises(ValueError, match="dense weight, 4-bit groups or 8-bit groups"):
        Linear()


def test_an_lm_head_with_q8_0_values_runs_q8_and_keeps_its_pack():
    q, scale = q8_groups(64, 96, seed=9)
    w = (q.float().view(64, -1, 32) * scale[..., None]).view(64, 96)
    lin = Linear(dense=w.bfloat16(), q8=Q8Groups(q, scale), float_out=True)
    plain = Linear(dense=w.bfloat16())
    assert lin.supports("q8") and not plain.supports("q8") and not lin.supports("q4")
    lin.prepare({"q8"})
    assert lin.q8 is not None and lin.q8.pack is not None and lin.supports("q8")  # the values live in the pack now
    lin.prepare({"bf16"})  # a plan without q8 does not drop the only form of those values
    x = torch.randn(4, 96).bfloat16()
    y = lin(x, "q8")
    assert y.dtype == torch.float32 and rel_err(y, x.float() @ w.T) < 1e-5


def test_without_a_compiler_the_kernels_are_not_offered(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    from constrained_spec.settings import reload_settings

    reload_settings()
    cpu_native._library.cache_clear()
    try:
        assert not cpu_native.available()
        lin = Linear(int4=Int4Groups.from_values(*groups(32, 64, seed=10, half=True)))
        assert not lin.supports("q4")
        with pytest.raises(RuntimeError, match="not available"):
            cpu_native.tile()
    finally:
        monkeypatch.undo()
        reload_settings()
        cpu_native._library.cache_clear()
    assert cpu_native.available()


# -- exact decode attention ----------------------------------------------------------------------

def attention_reference(q, kc, vc, rows, scale, softcap=None):
    """float64 attention of each row over its own keys (rows: [3, R] slot, lo, hi)."""
    R, H, hd = q.shape
    G = H // kc.shape[2]
    out = torch.empty(R, H, hd, dtype=torch.float64)
    for r in range(R):
        s, lo, hi = (int(v) for v in rows[:, r])
        k, v = kc[s, lo:hi].double(), vc[s, lo:hi].double()
        for h in range(H):
            sc = (k[:, h // G] @ q[r, h].double()) * scale
            if softcap:
                sc = torch.tanh(sc / softcap) * softcap
            out[r, h] = torch.softmax(sc, 0) @ v[:, h // G]
    return out


def cache(slots: int, length: int, kv: int, hd: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, length, kv, hd, generator=g).bfloat16(),
            torch.randn(slots, length, kv, hd, generator=g).bfloat16())


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (4, 4, 32), (14, 2, 64)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_attention_equals_float64_attention_over_each_rows_own_keys(heads, softcap):
    H, KV, hd = heads
    if not cpu_native.attention_supports(hd, H, KV):
        pytest.skip(f"{hd} is not a multiple of this build's vector width")
    kc, vc = cache(3, 300, KV, hd, seed=11)
    R = 6
    q = torch.randn(R, H, hd, generator=torch.Generator().manual_seed(12)).bfloat16()
    # slots, first and past-last keys: causal rows, a window, one key, a long row
    rows = torch.tensor([[0, 0, 1, 2, 2, 1], [0, 0, 40, 0, 0, 150], [10, 11, 90, 1, 300, 290]],
                        dtype=torch.int32)
    got = cpu_native.attention(q, kc, vc, rows, hd ** -0.5, softcap)
    want = attention_reference(q, kc, vc, rows, hd ** -0.5, softcap)
    assert float((got.double() - want).abs().max()) < 1e-2  # bf16 out
    assert torch.equal(got, cpu_native.attention(q, kc, vc, rows, hd ** -0.5, softcap))


def test_attention_gives_a_row_the_bits_of_the_row_alone_whatever_the_call():
    H, KV, hd = 9, 3, 64
    kc, vc = cache(4, 700, KV, hd, seed=13)
    R = 13
    q = torch.randn(R, H, hd, generator=torch.Generator().manual_seed(14)).bfloat16()
    hi = torch.arange(500, 500 + R, dtype=torch.int32)  # a verify's rows: one more key each
    rows = torch.stack([torch.full((R,), 2, dtype=torch.int32), torch.zeros(R, dtype=torch.int32), hi])
    together = cpu_native.attention(q, kc, vc, rows, 0.125)
    for r in range(R):
        alone = cpu_native.attention(q[r: r + 1], kc, vc, rows[:, r: r + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], together[r]), r
    # among other requests' rows, in another slot and order
    other = torch.tensor([[0, 2, 3], [0, 0, 0], [650, int(hi[4]), 20]], dtype=torch.int32)
    mixed = cpu_native.attention(torch.stack([q[0], q[4], q[1]]), kc, vc, other, 0.125)
    assert torch.equal(mixed[1], together[4])


def test_attention_rejects_what_it_does_not_take_and_gives_zeros_for_a_row_without_keys():
    kc, vc = cache(1, 64, 1, 64, seed=15)
    q = torch.randn(2, 2, 64).bfloat16()
    rows = torch.tensor([[0, 0], [0, 5], [10, 5]], dtype=torch.int32)
    out = cpu_native.attention(q, kc, vc, rows, 0.125)
    assert torch.equal(out[1], torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_native.attention(q.float(), kc, vc, rows, 0.125)
    with pytest.raises(ValueError, match="do not match"):
        cpu_native.attention(q, kc, vc, rows[:, :1], 0.125)
    assert not cpu_native.attention_supports(64, 9, 2)  # heads not a multiple of kv heads
    assert not cpu_native.attention_supports(512, 8, 8)  # head dim past the kernel's maximum
