"""Mask logits in place with a packed token bitmask.

Bitmask layout (xgrammar / outlines-core): int32 tensor [rows, ceil(V / 32)]; bit j of word w
allows token 32 * w + j, so a word of -1 allows all 32 of its tokens. Disallowed logits become
-inf. The logits may be wider than the bitmask (a padded vocabulary: the tokens past the
bitmask width are masked) or narrower (the extra bits are ignored). `indices` maps each logits
row to a bitmask row, so the K + 1 verified positions of a request can share one mask buffer.

Three implementations with one signature:

- `apply_bitmask_reference`: plain torch, the definition.
- `apply_bitmask_torch`: the vectorised torch path (CPU; CUDA without Triton). It expands every bitmask byte through a
  [256, 8] table of +inf / -inf and takes `minimum(logits, limit)`, which vectorises; a
  `masked_fill_` with a random-looking mask is branchy and several times slower on CPU, as is
  xgrammar's C++ kernel (see benchmarks/kernels.py).
- `apply_bitmask_triton`: the Triton kernel (CUDA, or the CPU interpreter).

`apply_bitmask` dispatches by device.
"""

from __future__ import annotations

import functools
import sys

import torch

from ._backend import Backend, cdiv, check_triton_can_run, resolve_backend

# Rows per step of the torch path on CPU: keeps the [rows, V] limit tensor in cache (4 rows
# per step beat one step at large batches when measured: benchmarks/kernels.py).
_CPU_ROWS_PER_STEP = 4


def apply_bitmask_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """Set the logits the bitmask disallows to -inf, in place (plain torch; the definition).

    Parameters
    ----------
    logits : torch.Tensor
        [R, V] float32 / bfloat16 / float16, masked in place.
    bitmask : torch.Tensor
        [R', W] int32, W = ceil(V_mask / 32); bit j of word w allows token 32 * w + j.
        Logits columns from 32 * W on are disallowed; bits past V are ignored.
    indices : torch.Tensor, optional
        [R] integer: logits row i uses bitmask row indices[i]. None: row i uses row i
        (then R' >= R).
    """
    check_bitmask_args(logits, bitmask, indices)
    num_rows, vocab = logits.shape
    rows = bitmask[:num_rows] if indices is None else bitmask[indices.long()]  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((rows.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)         # [R, 32 W]
    width = min(vocab, allowed.shape[1])
    disallowed = torch.ones_like(logits, dtype=torch.bool)                    # [R, V]
    disallowed[:, :width] = ~allowed[:, :width]
    logits.masked_fill_(disallowed, float("-inf"))


def apply_bitmask_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """`apply_bitmask_reference` as a Triton kernel: one program per (row, 4096 logits)."""
    check_bitmask_args(logits, bitmask, indices)
    check_triton_can_run(logits.device)
    from . import _triton

    num_rows, vocab = logits.shape
    if num_rows == 0 or vocab == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_bitmask_triton needs unit stride along the vocabulary")
    block = 4096
    grid = (num_rows, cdiv(vocab, block))
    _triton.apply_bitmask_kernel[grid](
        logits, bitmask, indices if indices is not None else bitmask,
        vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0),
        HAS_INDICES=indices is not None, BLOCK=block,
    )


def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> None:
    """Set the logits the bitmask disallows to -inf, in place.

    Same arguments as `apply_bitmask_reference`. `backend`: "auto" runs Triton on CUDA and
    the vectorised torch path elsewhere; "torch" / "triton" force one.

    On the torch path a NaN logit stays NaN even where disallowed (the reference writes -inf).
    """
    if resolve_backend(backend, logits.device) == "triton":
        apply_bitmask_triton(logits, bitmask, indices)
    else:
        apply_bitmask_torch(logits, bitmask, indices)


def apply_bitmask_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """Vectorised torch path: logits = minimum(logits, +inf where allowed, -inf where not)."""
    check_bitmask_args(logits, bitmask, indices)
    if sys.byteorder != "little":  # the byte table below assumes little-endian words
        apply_bitmask_reference(logits, bitmask, indices)
        return
    num_rows, vocab = logits.shape
    rows = bitmask[:num_rows] if indices is None else bitmask[indices.long()]  # [R, W]
    width = min(vocab, 32 * rows.shape[1])
    table = _byte_limit_table(logits.dtype, logits.device)                      # [256, 8]
    row_bytes = rows.contiguous().view(torch.uint8).int()                       # [R, 4 W]
    step = _CPU_ROWS_PER_STEP if logits.device.type == "cpu" else max(num_rows, 1)
    for start in range(0, num_rows, step):
        stop = min(start + step, num_rows)
        limit = torch.nn.functional.embedding(row_bytes[start:stop], table)    # [r, 4 W, 8]
        part = logits[start:stop, :width]
        torch.minimum(part, limit.flatten(1)[:, :width], out=part)
    logits[:, width:] = float("-inf")


@functools.cache
def _byte_limit_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, k) is +inf if bit k of byte b is set, else -inf."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    table = torch.where(bits == 1, float("inf"), float("-inf"))
    return table.to(dtype=dtype, device=device)


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor,
                indices: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if indices is None:
        if bitmask.shape[0] < logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} "
                             "logits rows; pass indices to share rows")
    elif indices.shape != (logits.shape[0],):
        raise ValueError(f"indices must be [{logits.shape[0]}], got {tuple(indices.shape)}")
