"""The q4 kernel with int8 activations (``cs_q4i8_gemm`` and the native forward's ``int8``):
its numerics are exactly the stated scheme, it is row-invariant on every build this CPU runs,
and where the CPU has no integer dot products its byte pairs give the same bits.

The scheme (cpu_native.c): each row's groups of 32 inputs are quantized as llama.cpp's Q8_0
quantizes them (d = max|x| / 127, xq = round(x / d)) but with d kept in float32 and ties
rounded to even (Q8_0: away from zero); y = sum over groups of (scale * d) * (xq . q)
+ min * d * sum(xq), the min term on the quantized inputs as llama.cpp takes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from constrained_spec.kernels import cpu_native, native_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_forward  # noqa: E402
from test_native_forward import decode_and_verify, model_of, runner, tokens  # noqa: E402

native_calls = test_native_forward.native_calls  # its fixture: rows of each native forward call

pytestmark = pytest.mark.skipif(not cpu_native.int8_activations(),
                                reason="the native kernels do not load here")
# |int8 - bf16| logits <= TINY_TOLERANCE * max |bf16 logit| on the tiny random models (measured:
# llama3 2.8%, gemma2 5.3%, qwen3 5.1%; an int8 product with its groups' scales mixed up, or
# without the mins, is off by far more)
TINY_TOLERANCE = 0.1
BUILDS = [b for b in cpu_native.BUILDS if cpu_native.available(b) and cpu_native.int8_activations(b)]


def weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = torch.rand(N, K // 32, generator=g) * 0.02
    minimum = -torch.rand(N, K // 32, generator=g) * 0.1
    return q, scale, minimum


def dequantized(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    return scale.repeat_interleave(32, 1) * q + minimum.repeat_interleave(32, 1)


def q8_0(x: torch.Tensor, half_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as Q8_0 blocks of 32: (xq [M, K / 32, 32], d [M, K / 32]); ``half_scale``: d
    rounded to float16 after quantizing, as llama.cpp stores it."""
    xg = x.float().view(x.shape[0], -1, 32)
    d = xg.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    t = xg * inv[..., None]
    xq = torch.round(t)  # ties to even, as the kernel (llama.cpp's roundf: away from zero)
    return xq, (d.half().float() if half_scale else d)


def scheme(x: torch.Tensor, q, scale, minimum) -> torch.Tensor:
    """The stated scheme in float64: sum_g (scale * d) * (xq . q) + min * d * sum(xq)."""
    xq, d = q8_0(x, half_scale=False)
    qg = q.double().view(q.shape[0], -1, 32)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), qg)
    sums = xq.double().sum(-1) * d.double()
    return (dots * scale.double()[None] * d.double()[:, None]).sum(-1) + sums @ minimum.double().T


@pytest.mark.parametrize("build", BUILDS)
def test_int8_activation_product_is_the_q8_0_scheme_with_float32_scales(build):
    q, scale, minimum = weight(64, 256, 0)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[2, :32] = 0  # an all-zero group: scale 0, no division by it
    got = cpu_native.matmul(x, cpu_native.pack(q, scale, minimum, build=build),
                            out_dtype=torch.float32, int8_act=True)
    want = scheme(x, q, scale, minimum)
    # integer dots are exact; what remains is float32 rounding in the per-group epilogue
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # ... and it is not the bf16 product (the quantization is really applied)
    exact = x.float() @ dequantized(q, scale, minimum).T
    assert (got - exact).abs().max() > 1e-4 * exact.abs().max()


@pytest.mark.parametrize("build", BUILDS)
def test_int8_activation_error_stays_within_half_a_step_per_input(build):
    q, scale, minimum = weight(128, 512, 2)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = cpu_native.matmul(x, cpu_native.pack(q, scale, minimum, build=build),
                            out_dtype=torch.float32, int8_act=True)
    w = dequantized(q, scale, minimum)
    exact = x.double() @ w.double().T
    # each input moves by at most d / 2, d = max|x| / 127 of its group
    _, d = q8_0(x, half_scale=False)
    bound = (d.double()[:, None, :] / 2 * w.double().abs().view(128, -1, 32).sum(-1)[None]).sum(-1)
    assert ((got.double() - exact).abs() <= bound * 1.001 + 1e-6).all()


def test_int8_activations_make_llama_cpps_q8_0_errors():
    q, scale, minimum = weight(256, 576, 7)
    g = torch.Generator().manual_seed(8)
    # heavy-tailed rows, as a model's activations are
    x = (torch.randn(32, 576, generator=g) * torch.exp(torch.randn(32, 576, generator=g))).bfloat16()
    w = dequantized(q, scale, minimum).double()
    exact = x.double() @ w.T
    ours = cpu_native.matmul(x, cpu_native.pack(q, scale, minimum), out_dtype=torch.float32, int8_act=True)
    xq, d = q8_0(x, half_scale=True)  # llama.cpp: the block scale stored as float16
    theirs = (xq * d[..., None]).view(32, 576).double() @ w.T
    # the same quantization: they differ by ~2% of their error (the float16 scale, ties), and
    # their errors are the same size (measured: 1.000 +- 0.002 over seeds); an int8 product
    # taking the min term on the exact sums of x instead is ~1.3x off
    err = (theirs - exact).norm()
    assert (ours.double() - theirs).norm() <= 0.05 * err
    assert 0.99 * err <= (ours.double() - exact).norm() <= 1.01 * err


@pytest.mark.parametrize("build", BUILDS)
def test_int8_activations_give_a_row_the_same_bits_among_any_number_of_rows(build):
    q, scale, minimum = weight(96 if build == "avx2" else 112, 192, 4)
    packed = cpu_native.pack(q, scale, minimum, build=build)
    x = torch.randn(11, 192, generator=torch.Generator().manual_seed(5)).bfloat16()
    alone = torch.cat([cpu_native.matmul(x[i: i + 1], packed, int8_act=True) for i in range(11)])
    for rows in (2, 7, 11):
        assert torch.equal(cpu_native.matmul(x[:rows], packed, int8_act=True), alone[:rows])


def test_int8_activations_take_only_4_bit_packs():
    q = torch.randint(-127, 128, (64, 64))
    packed = cpu_native.pack_q8(q, torch.rand(64, 2))
    with pytest.raises(ValueError, match="4-bit pack"):
        cpu_native.matmul(torch.randn(1, 64), packed, int8_act=True)


@pytest.mark.parametrize("name", ["llama3", "gemma2", "qwen3"])
def test_int8_native_verify_rows_are_one_row_decodes_close_to_bf16(name, native_calls):
    model = model_of(name)
    V = model.config.vocab_size
    prompt, drafts = tokens(V, 30, 3), tokens(V, 7, 4)
    bf16, _ = decode_and_verify(runner(model, native=True), prompt, drafts)
    r = runner(model, native=True)
    r.int8_activations = True
    decodes, verify = decode_and_verify(r, prompt, drafts)
    assert "q4|int8" in r._native_stacks and r._native_stacks["q4|int8"] is not None
    assert native_calls == [1] * 7 + [7] + [1] * 7 + [7]
    assert torch.equal(verify, decodes)  # speculation on = off
    assert not torch.equal(decodes, bf16)  # the int8 products really ran
    assert (decodes - bf16).abs().max() <= TINY_TOLERANCE * bf16.abs().max()


@pytest.mark.parametrize("build", BUILDS)
def test_int8_products_at_the_largest_values_neither_saturate_nor_wrap(build):
    # every 4-bit value 15 and every input at +-127 steps: a byte pair sums to +-3810 and a
    # group's 8 steps to +-30480 in int16 on a CPU without integer dot products (one step more,
    # or a saturating add, would be wrong), and a group's dot product is +-60960
    q = torch.full((64, 256), 15)
    scale, minimum = torch.full((64, 8), 0.01), torch.full((64, 8), -0.05)
    x = torch.ones(4, 256)
    x[1] = -1
    x[2, ::2] = -1  # alternating signs: pairs cancel
    x[3, :128] = -3.0
    got = cpu_native.matmul(x.bfloat16(), cpu_native.pack(q, scale, minimum, build=build),
                            out_dtype=torch.float32, int8_act=True)
    want = scheme(x.bfloat16(), q, scale, minimum)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def int8_results() -> tuple[torch.Tensor, torch.Tensor]:
    """A product and a tiny model's decode and verify logits, with int8 activations."""
    q, scale, minimum = weight(64, 256, 6)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    product = cpu_native.matmul(x, cpu_native.pack(q, scale, minimum), out_dtype=torch.float32, int8_act=True)
    model = model_of("llama3")
    r = runner(model, native=True)
    r.int8_activations = True
    logits, _ = decode_and_verify(r, tokens(model.config.vocab_size, 10, 8), [5, 6])
    assert "q4|int8" in r._native_stacks
    return product, logits


def test_without_integer_dot_products_byte_pairs_give_the_same_bits():
    with_vnni = int8_results()
    mp = pytest.MonkeyPatch()
    flags = cpu_native._cpu_flags() - {"avx512_vnni", "avx_vnni"}
    mp.setattr(cpu_native, "_cpu_flags", lambda: flags)
    cpu_native._library.cache_clear()
    try:
        assert cpu_native.int8_instructions() == "pairs"
        without = int8_results()
    finally:
        mp.undo()
        cpu_native._library.cache_clear()
    assert torch.equal(without[0], with_vnni[0])
    assert torch.equal(without[1], with_vnni[1])


def test_native_forward_refuses_int8_activations_where_the_kernels_do_not_load(monkeypatch):
    monkeypatch.setattr(cpu_native, "int8_activations", lambda build=None: False)
    with pytest.raises(ValueError, match="int8 activations"):
        native_forward.NativeForward([], heads=1, kv_heads=1, head_dim=16, eps=1e-6, scale=1.0,
                                     softcap=None, norm_offset=False, gelu=False, int8_activations=True)
