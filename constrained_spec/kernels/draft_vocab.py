"""Target-vocabulary bitmasks applied to an EAGLE-3 compressed draft vocabulary.

An EAGLE-3 head predicts over Vd draft tokens (e.g. 32k of a 128k target vocabulary);
`d2t[i]` is the absolute target id of draft id i. Draft token i is allowed iff its target token
d2t[i] is. d2t is injective, so each draft bit comes from one target bit and packing the draft
words is a plain OR (equivalently a sum) with no collisions. Target ids outside the target
bitmask's width count as disallowed, as in apply_bitmask.

Two ops, each with a torch reference (the definition), a Triton kernel and a dispatcher:

- `bitmask_to_draft_vocab`: [R, ceil(Vt / 32)] target bitmask -> [R, ceil(Vd / 32)] draft one.
- `apply_target_bitmask_to_draft_logits`: mask draft logits in place straight from the target
  bitmask (fused; defined as converting the bitmask, then apply_bitmask).

The torch references are already vectorised (one gather of Vd words per row), so the
dispatchers use them on CPU.
"""

from __future__ import annotations

import torch

from ._backend import Backend, cdiv, check_triton_can_run, resolve_backend
from .apply_bitmask import apply_bitmask_reference, apply_bitmask_torch, check_bitmask_args


def d2t_from_offsets(d2t_offsets: torch.Tensor) -> torch.Tensor:
    """Absolute target ids from the offsets public EAGLE-3 checkpoints store.

    Parameters
    ----------
    d2t_offsets : torch.Tensor
        [Vd] integer, target_id = draft_id + d2t_offsets[draft_id].

    Returns
    -------
    torch.Tensor
        [Vd] int64 absolute target id of each draft id (the `d2t` the ops here take).
    """
    draft_ids = torch.arange(d2t_offsets.shape[0], device=d2t_offsets.device)
    return draft_ids + d2t_offsets.long()


def bitmask_to_draft_vocab_reference(bitmask: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Convert a target-vocabulary bitmask to the draft vocabulary (plain torch).

    Parameters
    ----------
    bitmask : torch.Tensor
        [R, Wt] int32 target bitmask, Wt = ceil(Vt / 32).
    d2t : torch.Tensor
        [Vd] int64 absolute target id of each draft id.

    Returns
    -------
    torch.Tensor
        [R, ceil(Vd / 32)] int32: draft bit i is set iff target bit d2t[i] is set.
    """
    _check_bitmask_and_d2t(bitmask, d2t)
    allowed = _target_bits(bitmask, d2t)                                    # [R, Vd] bool
    num_rows, draft_vocab = allowed.shape
    num_words = cdiv(draft_vocab, 32)
    padded = torch.zeros(num_rows, num_words * 32, dtype=torch.int32, device=bitmask.device)
    padded[:, :draft_vocab] = allowed.int()
    # int32 place values; bit 31 is -2**31, so the sum of distinct bits never overflows.
    place = torch.ones(32, dtype=torch.int32, device=bitmask.device) << torch.arange(
        32, dtype=torch.int32, device=bitmask.device)
    return (padded.view(num_rows, num_words, 32) * place).sum(-1, dtype=torch.int32)


def bitmask_to_draft_vocab_triton(bitmask: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """`bitmask_to_draft_vocab_reference` as a Triton kernel (one program per 32 words)."""
    _check_bitmask_and_d2t(bitmask, d2t)
    check_triton_can_run(bitmask.device)
    from . import _triton

    num_rows = bitmask.shape[0]
    draft_words = cdiv(d2t.shape[0], 32)
    out = torch.empty(num_rows, draft_words, dtype=torch.int32, device=bitmask.device)
    if num_rows == 0 or draft_words == 0:
        return out
    bitmask, d2t = bitmask.contiguous(), d2t.contiguous().long()
    words = 32
    grid = (num_rows, cdiv(draft_words, words))
    _triton.bitmask_to_draft_vocab_kernel[grid](
        bitmask, d2t, out, d2t.shape[0], bitmask.shape[1], draft_words,
        bitmask.stride(0), out.stride(0), WORDS=words,
    )
    return out


def bitmask_to_draft_vocab(
    bitmask: torch.Tensor, d2t: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Convert a target-vocabulary bitmask to the draft vocabulary.

    See `bitmask_to_draft_vocab_reference`. `backend`: "auto" runs Triton on CUDA and the
    torch reference elsewhere; "torch" / "triton" force one.
    """
    if resolve_backend(backend, bitmask.device) == "triton":
        return bitmask_to_draft_vocab_triton(bitmask, d2t)
    return bitmask_to_draft_vocab_reference(bitmask, d2t)


def apply_target_bitmask_to_draft_logits_reference(
    draft_logits: torch.Tensor,
    bitmask: torch.Tensor,
    d2t: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """Set the draft logits the target bitmask disallows to -inf, in place (plain torch).

    Parameters
    ----------
    draft_logits : torch.Tensor
        [R, V] float draft logits, V normally len(d2t); columns from len(d2t) on are masked.
    bitmask : torch.Tensor
        [R', Wt] int32 target-vocabulary bitmask.
    d2t : torch.Tensor
        [Vd] int64 absolute target id of each draft id.
    indices : torch.Tensor, optional
        [R] integer: draft logits row i uses bitmask row indices[i]. None: row i uses row i.
    """
    _check_bitmask_and_d2t(bitmask, d2t)
    draft_bitmask = bitmask_to_draft_vocab_reference(bitmask, d2t)         # [R', Wd]
    apply_bitmask_reference(draft_logits, draft_bitmask, indices)


def apply_target_bitmask_to_draft_logits_triton(
    draft_logits: torch.Tensor,
    bitmask: torch.Tensor,
    d2t: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """The fused Triton kernel: one program per (row, 4096 draft logits)."""
    _check_bitmask_and_d2t(bitmask, d2t)
    check_bitmask_args(draft_logits, bitmask, indices)
    check_triton_can_run(draft_logits.device)
    from . import _triton

    num_rows, vocab = draft_logits.shape
    if num_rows == 0 or vocab == 0:
        return
    if draft_logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_target_bitmask_to_draft_logits_triton needs unit stride "
                         "along the vocabulary")
    d2t = d2t.contiguous().long()
    block = 4096
    grid = (num_rows, cdiv(vocab, block))
    _triton.apply_target_bitmask_to_draft_logits_kernel[grid](
        draft_logits, bitmask, indices if indices is not None else bitmask, d2t,
        vocab, d2t.shape[0], bitmask.shape[1], draft_logits.stride(0), bitmask.stride(0),
        HAS_INDICES=indices is not None, BLOCK=block,
    )


def apply_target_bitmask_to_draft_logits(
    draft_logits: torch.Tensor,
    bitmask: torch.Tensor,
    d2t: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> None:
    """Set the draft logits the target bitmask disallows to -inf, in place.

    See `apply_target_bitmask_to_draft_logits_reference`. `backend`: "auto" runs the fused
    Triton kernel on CUDA; elsewhere the bitmask is converted (only the rows in use) and the
    fast torch `apply_bitmask` path masks the logits.
    """
    if resolve_backend(backend, draft_logits.device) == "triton":
        apply_target_bitmask_to_draft_logits_triton(draft_logits, bitmask, d2t, indices)
        return
    check_bitmask_args(draft_logits, bitmask, indices)
    if indices is None:
        bitmask = bitmask[: draft_logits.shape[0]]
    draft_bitmask = bitmask_to_draft_vocab_reference(bitmask, d2t)
    apply_bitmask_torch(draft_logits, draft_bitmask, indices)


def _target_bits(bitmask: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """[R, Vd] bool: whether each row of the target bitmask allows d2t[i]."""
    in_mask = (d2t >= 0) & (d2t < 32 * bitmask.shape[1])                    # [Vd]
    target = torch.where(in_mask, d2t, 0)
    words = bitmask[:, target >> 5]                                         # [R, Vd]
    bits = (words >> (target & 31).int()) & 1
    return (bits == 1) & in_mask


def _check_bitmask_and_d2t(bitmask: torch.Tensor, d2t: torch.Tensor) -> None:
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must be an integer [draft_vocab] tensor, got {d2t.dtype} "
                         f"{tuple(d2t.shape)}")
