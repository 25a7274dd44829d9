"""quant: the one table of GGUF quantization types agrees with gguf-py's layouts and with the
kernels it names, and the packs carry their own group size (a type with groups of 16, such as
Q6_K's sub-blocks, reads back exactly and goes only to the kernels that take it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from constrained_spec.kernels import cpu_native
from constrained_spec.model.quant import TYPES
from constrained_spec.model.weights import INT4_KERNEL_GROUPS, Int4Groups, Linear, Q8Groups


def test_block_layouts_are_gguf_pys():
    gguf = pytest.importorskip("gguf")
    sizes = gguf.constants.GGML_QUANT_SIZES
    for name, t in TYPES.items():
        assert sizes[gguf.GGMLQuantizationType[name]] == (t.block, t.block_bytes), name
        assert t.name == name
        if t.group is not None:
            assert t.block % t.group == 0, name


def test_each_kernel_gets_the_groups_it_multiplies():
    kinds = {"q4": "int4", "q8": "int8"}
    for name, t in TYPES.items():
        assert (t.unpack is None) == (t.groups is None), name
        assert t.groups is None or t.group is not None, name
        if t.kernel is not None:
            assert t.groups == kinds[t.kernel], name
            assert t.group in cpu_native.GROUPS[{"q4": 4, "q8": 8}[t.kernel]], name  # it takes them


def test_the_types_the_plan_requantizes_to_int8():
    """Lossy already, and no 4-bit kernel runs the file's own values."""
    assert {n for n, t in TYPES.items() if t.int8_worth_it} == {
        "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K"}


def _groups_of_16(n: int, k: int, *, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-32, 32)
    q = torch.randint(lo, hi, (n, k), generator=g)
    scale = (torch.rand(n, k // 16, generator=g) * 0.01 + 1e-4).half().float()
    return q, scale


def test_a_pack_carries_its_group_and_dequantizes_by_it():
    q, scale = _groups_of_16(32, 64, bits=8)
    q8 = Q8Groups(q.to(torch.int8), scale)
    assert q8.group == 16
    want = scale.repeat_interleave(16, dim=1) * q.float()
    assert torch.equal(q8.dequantize(), want)
    q4, scale4 = _groups_of_16(32, 64, bits=4, seed=1)
    minimum = -scale4 * 8
    g4 = Int4Groups.from_values(q4, scale4, minimum)
    assert g4.group == 16
    assert torch.equal(g4.dequantize(), scale4.repeat_interleave(16, dim=1) * q4.float()
                       + minimum.repeat_interleave(16, dim=1))
    assert Int4Groups.from_values(q4, scale4[:, ::2], minimum[:, ::2]).group == 32
    with pytest.raises(ValueError, match="whole groups"):
        Q8Groups(q.to(torch.int8), scale[:, :3])  # 64 inputs in 3 groups


def test_a_group_no_kernel_takes_stays_on_the_dense_kernels():
    q, scale = _groups_of_16(32, 64, bits=8)
    # 8-bit groups of 16 with mins: no kernel takes them (Q6_K's carry none)
    lin = Linear(q8=Q8Groups(q.to(torch.int8), scale, -scale))
    assert not lin.supports("q8")
    assert lin.supports("fp32") and lin.supports("bf16")
    x = torch.randn(3, 64)
    want = scale.repeat_interleave(16, dim=1) * q.float() - scale.repeat_interleave(16, dim=1)
    assert torch.equal(lin(x, "fp32"), F.linear(x, want))
    q4, scale4 = _groups_of_16(32, 64, bits=4)
    lin4 = Linear(int4=Int4Groups.from_values(q4, scale4, torch.zeros_like(scale4)))
    assert 16 not in INT4_KERNEL_GROUPS
    assert not lin4.supports("int4") and not lin4.supports("q4")
    if cpu_native.available():
        with pytest.raises(ValueError, match="groups of 16 without mins"):
            cpu_native.pack_q8(q.to(torch.int8), scale, -scale)
        with pytest.raises(ValueError, match="group"):
            cpu_native.pack(q4.to(torch.uint8), scale4, torch.zeros_like(scale4))


def test_q6_k_groups_of_16_run_on_the_q8_kernel():
    q, scale = _groups_of_16(32, 64, bits=8)
    lin = Linear(q8=Q8Groups(q.to(torch.int8), scale))
    if not cpu_native.available():
        pytest.skip("the native kernels do not build here")
    assert lin.supports("q8")
    x = torch.randn(3, 64).bfloat16()
    want = x.float() @ (scale.repeat_interleave(16, dim=1) * q.float()).T
    got = lin(x, "q8")
    assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("name", ["Q5_K", "Q6_K"])
def test_k_quant_blocks_unpack_to_gguf_pys_values_exactly(name):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    t = TYPES[name]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (48, t.block_bytes), dtype=np.uint8)
    scales = np.array(rng.uniform(-0.02, 0.02, 48 * 2), dtype=np.float16).view(np.uint8)
    if name == "Q5_K":  # finite d and dmin (random bytes may be NaN / inf)
        blocks[:, 0:4] = scales.reshape(48, 4)
    else:  # finite d, at the end of the block
        blocks[:, 208:210] = scales.reshape(48, 4)[:, :2]
    want = getattr(gguf.quants, name).dequantize_blocks(blocks)
    q, scale, minimum = t.unpack(blocks)
    assert q.dtype == np.int8 and scale.shape[1] == 256 // t.group
    assert (minimum is not None) == t.has_min
    got = Q8Groups(torch.from_numpy(q), torch.from_numpy(scale),
                   None if minimum is None else torch.from_numpy(minimum)).dequantize()
    assert torch.equal(got, torch.from_numpy(want).float())  # the file's values, bit for bit
