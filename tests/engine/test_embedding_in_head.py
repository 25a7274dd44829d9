"""A tied embedding held once: its rows gathered from the LM head's 8-bit pack, bit for bit."""

from __future__ import annotations

import pytest
import torch

from constrained_spec.kernels import cpu_native
from constrained_spec.model.weights import Linear, Q8Groups

needs_q8 = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels do not build here")


def _groups(n: int, k: int, seed: int, *, with_min: bool) -> Q8Groups:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # Q8_0's float16 d
    minimum = (torch.rand(n, k // 32, generator=g) - 0.5).half().float() if with_min else None
    return Q8Groups(q, scale, minimum)


@needs_q8
@pytest.mark.parametrize("with_min", [False, True])
def test_embedding_rows_gathered_from_the_q8_pack_equal_the_dense_rows(with_min):
    n = 8 * cpu_native.tile()
    groups = _groups(n, 96, seed=3, with_min=with_min)
    dense = groups.dequantize(torch.bfloat16)
    head = Linear(q8=groups, float_out=True)
    head.prepare({"q8"})
    assert groups.pack is not None and groups.held_tensors() == [groups.pack.data]  # one copy
    ids = torch.tensor([[0, n - 1, 5, 5], [n // 2, 1, cpu_native.tile(), 0]])
    rows = head.rows(ids, torch.bfloat16)
    assert rows.shape == (2, 4, 96) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, dense[ids])  # bit for bit, repeats and tile edges included
    assert torch.equal(head.rows(torch.arange(n), torch.bfloat16), dense)


def test_embedding_rows_before_packing_equal_the_dense_rows():
    groups = _groups(32, 64, seed=4, with_min=False)
    ids = torch.tensor([3, 31, 3])
    assert torch.equal(groups.rows(ids, torch.bfloat16), groups.dequantize(torch.bfloat16)[ids])


@needs_q8
def test_the_embedded_model_holds_its_tied_embedding_only_in_the_head_pack():
    """Fails if a dense copy of the embedding comes back beside the LM head's pack."""
    from constrained_spec.model.loading import _EMBED, load_model
    from constrained_spec.model.mapped import map_tensors

    loaded = load_model(None, quiet=True)
    runner = loaded.runner
    if runner._kernel(runner.lm_head_weight, runner.plan.lm_head) != "q8":
        pytest.skip("the plan here does not run the LM head on the q8 kernel")
    assert loaded.model.model.embed_tokens.weight.is_meta  # never read from the folder
    assert runner._embed is None and runner.head.dense is None
    head = runner.head.q8
    assert head is not None and head.held_tensors() == [runner.head._packs["q8"].data]
    assert runner.resident_bytes() == sum(lin.nbytes() for lin in runner.linears()) + runner.head.nbytes()
    stored = map_tensors(loaded.path / "weights.safetensors", {_EMBED})[_EMBED]
    ids = torch.tensor([[0, 1, 17, 4096, stored.shape[0] - 1]])
    assert torch.equal(runner.embed_rows(ids), stored[ids])  # the file's dense rows, bit for bit
