"""EAGLE-3 draft vocabulary: bitmask conversion and fused draft-logit masking.

The references are checked against the definition (draft bit i == target bit d2t[i]); the
Triton kernels run on the CPU interpreter against the references.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: kernels run on CPU

import pytest
import torch

from constrained_spec.kernels import (
    apply_target_bitmask_to_draft_logits,
    apply_target_bitmask_to_draft_logits_reference,
    bitmask_to_draft_vocab,
    bitmask_to_draft_vocab_reference,
    d2t_from_offsets,
)
from constrained_spec.kernels._backend import triton_available

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install triton); the Triton "
    "kernels are tested on CPU under TRITON_INTERPRET=1 when it is")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    bitmask = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 3, (rows, words), generator=gen)
    return torch.where(kind == 0, 0, torch.where(kind == 1, -1, bitmask)).to(torch.int32)


def random_d2t(target_vocab: int, draft_vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted distinct target ids, like EAGLE-3's most-frequent-token vocabularies."""
    return torch.randperm(target_vocab, generator=gen)[:draft_vocab].sort().values


def unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """[R, W] int32 -> [R, 32 W] bool, straight from the layout definition."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)


def test_d2t_from_offsets_gives_absolute_target_ids():
    offsets = torch.tensor([0, 0, 3, 3, 10])
    assert d2t_from_offsets(offsets).tolist() == [0, 1, 5, 6, 14]
    assert d2t_from_offsets(offsets.int()).dtype == torch.int64


@pytest.mark.parametrize(("target_vocab", "draft_vocab"), [(100, 33), (1000, 64), (64, 1)])
def test_draft_bit_is_set_iff_target_bit_of_d2t_is_set(target_vocab, draft_vocab):
    gen = torch.Generator().manual_seed(target_vocab)
    bitmask = random_bitmask(5, -(-target_vocab // 32), gen)
    d2t = random_d2t(target_vocab, draft_vocab, gen)
    draft = bitmask_to_draft_vocab_reference(bitmask, d2t)
    assert draft.dtype == torch.int32 and draft.shape == (5, -(-draft_vocab // 32))
    bits = unpack(draft)
    assert torch.equal(bits[:, :draft_vocab], unpack(bitmask)[:, d2t])
    assert not bits[:, draft_vocab:].any()              # padding bits of the last word


def test_target_ids_past_the_bitmask_width_are_disallowed():
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # targets 0..63 allowed
    d2t = torch.tensor([0, 63, 64, 500])
    assert unpack(bitmask_to_draft_vocab_reference(bitmask, d2t))[0, :4].tolist() == [
        True, True, False, False]
    logits = torch.zeros(1, 4)
    apply_target_bitmask_to_draft_logits_reference(logits, bitmask, d2t)
    assert torch.isneginf(logits).tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("rows", "target_vocab", "draft_vocab"), [
    (2, 128256, 32000), (2, 151936, 32001), (3, 49153, 8191), (200, 300, 77), (41, 33, 33),
])
def test_bitmask_to_draft_vocab_matches_reference(backend, rows, target_vocab, draft_vocab):
    gen = torch.Generator().manual_seed(rows + target_vocab + draft_vocab)
    bitmask = random_bitmask(rows, -(-target_vocab // 32), gen)
    bitmask[0] = -1                                     # all allowed: every draft word is -1
    bitmask[-1] = 0                                     # none allowed
    d2t = random_d2t(target_vocab, draft_vocab, gen)
    expected = bitmask_to_draft_vocab_reference(bitmask, d2t)
    assert torch.equal(bitmask_to_draft_vocab(bitmask, d2t, backend=backend), expected)
    assert (expected[-1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "target_vocab", "draft_vocab", "logits_width"), [
    (3, 128256, 32000, 32000), (2, 151936, 32001, 32064), (120, 300, 77, 77),
    (30, 1000, 100, 90),
])
def test_fused_draft_logit_masking_matches_reference(backend, dtype, rows, target_vocab,
                                                     draft_vocab, logits_width):
    gen = torch.Generator().manual_seed(rows * target_vocab + draft_vocab)
    requests = max(rows // 6, 1)                        # K + 1 draft rows share a request mask
    bitmask = random_bitmask(requests, -(-target_vocab // 32), gen)
    indices = torch.randint(0, requests, (rows,), generator=gen)
    d2t = random_d2t(target_vocab, draft_vocab, gen)
    logits = torch.randn(rows, logits_width, generator=gen).to(dtype)
    expected = logits.clone()
    apply_target_bitmask_to_draft_logits_reference(expected, bitmask, d2t, indices)
    got = logits.clone()
    apply_target_bitmask_to_draft_logits(got, bitmask, d2t, indices, backend=backend)
    assert torch.equal(got, expected)
    # and the definition: draft logit i survives iff target token d2t[i] is allowed
    width = min(logits_width, draft_vocab)
    allowed = unpack(bitmask)[indices][:, d2t[:width]]
    assert torch.equal(torch.isneginf(expected[:, :width]), ~allowed)
    assert torch.isneginf(expected[:, width:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_masking_without_index_map_uses_row_i(backend):
    gen = torch.Generator().manual_seed(7)
    bitmask = random_bitmask(5, 10, gen)                # 2 spare rows past the logits rows
    d2t = random_d2t(320, 50, gen)
    logits = torch.randn(3, 50, generator=gen)
    expected = logits.clone()
    apply_target_bitmask_to_draft_logits_reference(expected, bitmask[:3], d2t)
    apply_target_bitmask_to_draft_logits(logits, bitmask, d2t, backend=backend)
    assert torch.equal(logits, expected)
