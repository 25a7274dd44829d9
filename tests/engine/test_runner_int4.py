"""The int4 weight path of LeanRunner: exact 4-bit weights (as dequantized from a Q4_1 GGUF)
run on torch's int4 kernel and give the logits of the same weights computed densely."""

from __future__ import annotations

import copy

import pytest
import torch
from cs_testlib import tiny_llama

from constrained_spec.model.quant import TYPES
from constrained_spec.model.runner import LeanRunner, exact_4bit_groups, linear
from constrained_spec.model.weights import Int4Groups

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch build has no CPU int4 kernel")


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """What a Q4_1 GGUF round trip leaves: each group of 32 inputs is d * q + m, q in 0..15,
    with d and m stored as float16 (as llama.cpp does)."""
    N, K = weight.shape
    G = TYPES["Q4_1"].block  # one group per Q4_1 block
    g = weight.float().view(N, K // G, G)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.round((g - m) / d).clamp(0, 15)
    return (q * d + m).view(N, K)


def quantized_tiny_llama():
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                        layer.mlp.down_proj):
                lin.weight.copy_(q4_1(lin.weight))
    return model


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch's int4 pack of ``weight`` when every group of it is exactly 4-bit, else None."""
    groups = Int4Groups.from_dense(weight)
    return None if groups is None else groups.int4_pack()


def test_pack_int4_refuses_weights_that_are_not_4_bit():
    torch.manual_seed(0)
    assert pack_int4(torch.randn(64, 64)) is None
    assert pack_int4(torch.randn(64, 48)) is None  # K not a multiple of the group
    assert pack_int4(torch.randn(64, 64).bfloat16()) is None  # only exact float32 input


def test_int4_linear_matches_the_dense_product_of_the_same_weights():
    torch.manual_seed(1)
    w = q4_1(torch.randn(96, 128))
    packed = pack_int4(w)
    assert packed is not None
    x = torch.randn(5, 128).bfloat16()
    got = linear(x, packed).float()
    want = x.float() @ w.t()
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item(), rtol=0)
    # row-independent: one row alone gives the same bits as inside the batch
    assert torch.equal(linear(x[2:3], packed), linear(x, packed)[2:3])


def test_exact_4bit_groups_cover_every_linear_only_when_exact():
    assert exact_4bit_groups(tiny_llama()) is None
    packs = exact_4bit_groups(quantized_tiny_llama())
    assert packs is not None and len(packs) == 2 * 4  # qkv, o, gate_up, down per layer


def test_runner_on_int4_weights_follows_the_float32_model():
    model = quantized_tiny_llama()
    packs = exact_4bit_groups(model)
    ref = LeanRunner(model, dtype=torch.float32, device=CPU)
    fast = LeanRunner(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16, device=CPU,
                       groups=packs)
    dense = LeanRunner(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16, device=CPU)
    assert fast.quantized_linears == 8 and dense.quantized_linears == 0
    prompt = [3, 9, 4, 1, 7, 2, 8, 5]
    outs = []
    for runner in (ref, fast, dense):
        slot = runner.new_slot()
        first = runner.forward([slot], [prompt], [3])  # int4 kernel (8 rows)
        step = runner.forward([slot], [[6, 2]], [2])  # incremental, on the cache
        long = runner.forward([slot], [list(range(1, 16))], [15])  # past FEW_ROWS: dense
        outs.append(torch.cat([first, step, long]))
    want, got, bf16 = outs
    # as close to the float32 model as dense bf16 weights are (the int4 path keeps the 4-bit
    # values exactly; only the scale and zero point are rounded to bf16)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= max(2 * (bf16 - want).abs().max().item(), 0.02 * scale)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


def test_quantize_for_drafting_packs_every_matrix_and_stays_close():
    """A draft model's runner: any weights on the int8 kernel, LM head included."""
    model = tiny_llama(vocab_size=48)
    dense = LeanRunner(model, dtype=torch.bfloat16, device=CPU)
    approx = LeanRunner(model, dtype=torch.bfloat16, device=CPU)
    assert approx.quantize_for_drafting() == 4 * model.config.num_hidden_layers + 1
    assert approx.plan.lm_head == "int8" and approx.lm_head_weight.packed_kernels == ("int8",)
    ids = [[3, 7, 11, 5, 9, 2]]
    outs = []
    for runner in (dense, approx):
        slot = runner.new_slot()
        outs.append(runner.forward([slot], ids, [6]).float())
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1)
    assert bool((cos > 0.999).all()), cos
    assert not torch.equal(outs[0], outs[1])  # it did change the arithmetic
    # float32 (or any device but the CPU in bf16): nothing to do
    assert LeanRunner(model, dtype=torch.float32, device=CPU).quantize_for_drafting() == 0
