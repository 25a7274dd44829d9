"""The Triton kernels, in one module that only the Triton wrappers import (lazily).

Each kernel mirrors the torch reference named in its docstring; the wrappers (launch grid,
argument checks) sit beside those references in apply_bitmask.py, draft_vocab.py and
rejection.py. Row offsets are computed in int64: rows * V passes 2**31 at a few thousand rows
of a 150k vocabulary.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def apply_bitmask_kernel(
    logits_ptr,          # [R, V] float, masked in place
    bitmask_ptr,         # [R', W] int32
    indices_ptr,         # [R] int: bitmask row of each logits row (read if HAS_INDICES)
    vocab,               # V
    num_words,           # W
    logits_row_stride,
    bitmask_row_stride,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,  # logits per program, a multiple of 32
):
    """apply_bitmask_reference: program (row, block) masks logits[row, block]."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    mask_row = tl.load(indices_ptr + row).to(tl.int64) if HAS_INDICES else row
    words_at = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    # Words past the bitmask width read as 0: the padded vocabulary is disallowed.
    words = tl.load(bitmask_ptr + mask_row * bitmask_row_stride + words_at,
                    mask=words_at < num_words, other=0)                    # [BLOCK / 32]
    bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1                # [BLOCK / 32, 32]
    disallowed = tl.reshape(bits == 0, (BLOCK,))
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * logits_row_stride + tokens, float("-inf"),
             mask=(tokens < vocab) & disallowed)


@triton.jit
def _target_bit(bitmask_row_ptr, target, num_words):
    """Whether the target-vocabulary bitmask row allows `target` (ids past it: no)."""
    in_mask = (target >= 0) & (target < num_words * 32)
    word = tl.load(bitmask_row_ptr + (target >> 5), mask=in_mask, other=0)
    return ((word >> (target & 31).to(tl.int32)) & 1).to(tl.int32)


@triton.jit
def bitmask_to_draft_vocab_kernel(
    bitmask_ptr,         # [R, Wt] int32 target-vocabulary bitmask
    d2t_ptr,             # [Vd] int64 target id of each draft id
    out_ptr,             # [R, Wd] int32 draft-vocabulary bitmask (written)
    draft_vocab,         # Vd
    target_words,        # Wt
    draft_words,         # Wd
    bitmask_row_stride,
    out_row_stride,
    WORDS: tl.constexpr,  # draft words per program
):
    """bitmask_to_draft_vocab_reference: gather each draft id's target bit, pack 32 a word."""
    row = tl.program_id(0).to(tl.int64)
    out_words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)            # [WORDS]
    draft_ids = out_words[:, None] * 32 + tl.arange(0, 32)[None, :]        # [WORDS, 32]
    target = tl.load(d2t_ptr + draft_ids, mask=draft_ids < draft_vocab, other=-1)
    bits = _target_bit(bitmask_ptr + row * bitmask_row_stride, target, target_words)
    # Bits are distinct powers of two (bit 31 is -2**31), so the sum is the OR, no overflow.
    packed = tl.sum(bits << tl.arange(0, 32)[None, :], axis=1)            # [WORDS] int32
    tl.store(out_ptr + row * out_row_stride + out_words, packed, mask=out_words < draft_words)


@triton.jit
def apply_target_bitmask_to_draft_logits_kernel(
    logits_ptr,          # [R, V] draft logits, masked in place
    bitmask_ptr,         # [R', Wt] int32 target-vocabulary bitmask
    indices_ptr,         # [R] int: bitmask row of each logits row (read if HAS_INDICES)
    d2t_ptr,             # [Vd] int64 target id of each draft id
    vocab,               # V, the draft logits width
    draft_vocab,         # Vd, len(d2t)
    target_words,        # Wt
    logits_row_stride,
    bitmask_row_stride,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """apply_target_bitmask_to_draft_logits_reference, without building the draft bitmask."""
    row = tl.program_id(0).to(tl.int64)
    mask_row = tl.load(indices_ptr + row).to(tl.int64) if HAS_INDICES else row
    draft_ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    target = tl.load(d2t_ptr + draft_ids, mask=draft_ids < draft_vocab, other=-1)
    allowed = _target_bit(bitmask_ptr + mask_row * bitmask_row_stride, target, target_words)
    tl.store(logits_ptr + row * logits_row_stride + draft_ids, float("-inf"),
             mask=(draft_ids < vocab) & (allowed == 0))


@triton.jit
def rejection_row_stats_kernel(
    logits_ptr,          # [T, V] masked target logits
    logits_row_stride,
    row_max_ptr,         # [T] float32 (written): max logit, -inf if the row allows nothing
    row_sum_ptr,         # [T] float32 (written): sum(exp(logits - max)), 0 for such a row
    row_argmax_ptr,      # [T] int64 (written): first index of the max, 0 for such a row
    vocab,
    COMPUTE_SUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per-row max, first argmax and softmax denominator (two passes over the row)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_row_stride
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        block_best, block_at = tl.max(x, axis=0, return_indices=True,
                                      return_indices_tie_break_left=True)
        best_at = tl.where(block_best > best, start + block_at, best_at)  # ties: first wins
        best = tl.maximum(best, block_best)
    total = tl.full([], 1.0, tl.float32)              # unused when every request is greedy
    if COMPUTE_SUM:
        total = tl.zeros([], tl.float32)
        shift = tl.where(best > float("-inf"), best, 0.0)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            total += tl.sum(tl.exp(x - shift), axis=0)
    tl.store(row_max_ptr + row, best)
    tl.store(row_sum_ptr + row, total)
    tl.store(row_argmax_ptr + row, best_at.to(tl.int64))


@triton.jit
def _row_softmax(row_max_ptr, row_sum_ptr, row):
    """(alive, shift, row_sum) of a masked row from rejection_row_stats_kernel's outputs, so
    that p~ = exp(logit - shift) / row_sum; a row allowing nothing (not alive) has
    exp(-inf - 0) / 1 = 0."""
    row_max = tl.load(row_max_ptr + row)
    alive = row_max > float("-inf")
    shift = tl.where(alive, row_max, 0.0)
    row_sum = tl.where(alive, tl.load(row_sum_ptr + row), 1.0)
    return alive, shift, row_sum


@triton.jit
def _accept_drafts(
    logits_ptr, logits_row_stride, draft_ptr, q_ptr, q_row_stride, uniform_ptr,
    row_max_ptr, row_sum_ptr, row_argmax_ptr,
    out_row_ptr,         # the request's output row: accepted drafts written at 0, 1, ...
    start, end, first_row, greedy, vocab,
    HAS_Q: tl.constexpr,
):
    """Acceptance of one request's drafts start .. end - 1 (rows first_row ...): walk them;
    after the first rejection nothing more is accepted. Returns the number accepted."""
    num_accepted = tl.zeros([], tl.int64)
    rejected = tl.zeros([], tl.int32)
    for j in range(start, end):
        row = first_row + (j - start)
        x = tl.load(draft_ptr + j)
        valid = (x >= 0) & (x < vocab)                 # -1 padding is always rejected
        x_safe = tl.where(valid, x, 0)
        alive, shift, row_sum = _row_softmax(row_max_ptr, row_sum_ptr, row)
        logit = tl.load(logits_ptr + row * logits_row_stride + x_safe).to(tl.float32)
        p_x = tl.exp(logit - shift) / row_sum
        if HAS_Q:
            q_x = tl.load(q_ptr + j * q_row_stride + x_safe).to(tl.float32)
        else:
            q_x = tl.full([], 1.0, tl.float32)
        u = tl.load(uniform_ptr + j)
        accept_sampled = (q_x > 0) & (u < p_x / tl.where(q_x > 0, q_x, 1.0))
        accept_greedy = alive & (x == tl.load(row_argmax_ptr + row))
        accept = valid & (rejected == 0) & tl.where(greedy, accept_greedy, accept_sampled)
        tl.store(out_row_ptr + (j - start), x, mask=accept)
        num_accepted += accept.to(tl.int64)
        rejected = tl.where(accept, rejected, 1)
    return num_accepted


@triton.jit
def _race_p_and_residual(
    logits_row_ptr,      # the emitting row's masked logits
    q_row_ptr,           # q of the rejected draft (read if HAS_Q and x_valid)
    noise_row_ptr,
    x, x_valid,          # the rejected draft (-1 when every draft was accepted)
    shift, row_sum,      # from _row_softmax
    sample_end,          # vocab, or 0 for a greedy request (no sampling pass)
    vocab,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Sample by argmax(dist / noise), for dist = p~ and dist = residual in one pass. A token
    with dist = 0 scores 0, and only a positive best score picks a token: returns the token
    drawn from p~ and the one drawn from the residual, each -1 where nothing scored > 0."""
    best_p = tl.zeros([], tl.float32)
    best_p_at = tl.full([], -1, tl.int32)
    best_r = tl.zeros([], tl.float32)
    best_r_at = tl.full([], -1, tl.int32)
    for b in range(0, sample_end, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        in_vocab = offs < vocab
        logits = tl.load(logits_row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        p = tl.exp(logits - shift) / row_sum
        if HAS_Q:
            # (tl.where, not `in_vocab & x_valid`: the interpreter mis-types tensor & scalar)
            q = tl.load(q_row_ptr + offs, mask=tl.where(x_valid, in_vocab, False),
                        other=0.0).to(tl.float32)
            residual = tl.maximum(p - q, 0.0)
        else:
            residual = tl.where(offs == x, 0.0, p)
        noise = tl.load(noise_row_ptr + offs, mask=in_vocab, other=1.0)
        top, top_at = tl.max(p / noise, axis=0, return_indices=True,
                             return_indices_tie_break_left=True)
        best_p_at = tl.where(top > best_p, b + top_at, best_p_at)
        best_p = tl.maximum(best_p, top)
        top, top_at = tl.max(residual / noise, axis=0, return_indices=True,
                             return_indices_tie_break_left=True)
        best_r_at = tl.where(top > best_r, b + top_at, best_r_at)
        best_r = tl.maximum(best_r, top)
    return best_p_at, best_r_at


@triton.jit
def rejection_sample_kernel(
    logits_ptr,          # [T, V] masked target logits, T = sum(k_i + 1)
    logits_row_stride,
    draft_ptr,           # [N] int64 drafts, N = sum(k_i)
    cu_ptr,              # [B + 1] int64 cumulative draft counts
    q_ptr,               # [N, V] draft probabilities (read if HAS_Q)
    q_row_stride,
    greedy_ptr,          # [B] int32
    uniform_ptr,         # [N] float32 acceptance draws
    noise_ptr,           # [T, V] or [B, V] float32 Exp(1) noise
    noise_row_stride,
    row_max_ptr, row_sum_ptr, row_argmax_ptr,   # [T] from rejection_row_stats_kernel
    out_ptr,             # [B, max_k + 1] int64, pre-filled with -1
    out_row_stride,
    num_accepted_ptr, recovered_ptr, bonus_ptr,  # [B] int64 (written)
    vocab,
    HAS_Q: tl.constexpr,
    NOISE_PER_REQUEST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """rejection_sample_reference: program i verifies request i, then samples its last token."""
    req = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + req)
    end = tl.load(cu_ptr + req + 1)
    first_row = start + req
    greedy = tl.load(greedy_ptr + req) != 0
    out_row_ptr = out_ptr + req * out_row_stride
    num_accepted = _accept_drafts(logits_ptr, logits_row_stride, draft_ptr, q_ptr, q_row_stride,
                                  uniform_ptr, row_max_ptr, row_sum_ptr, row_argmax_ptr,
                                  out_row_ptr, start, end, first_row, greedy, vocab, HAS_Q)

    # The emitted token: recovered (at the first rejection) or bonus (all accepted).
    is_recovered = num_accepted < end - start
    row = first_row + num_accepted
    j = start + num_accepted
    x = tl.load(draft_ptr + j, mask=is_recovered, other=-1)
    x_valid = (x >= 0) & (x < vocab)
    alive, shift, row_sum = _row_softmax(row_max_ptr, row_sum_ptr, row)
    noise_row = req if NOISE_PER_REQUEST else row
    sample_end = tl.where(greedy, 0, vocab)           # greedy requests need no sampling pass
    best_p_at, best_r_at = _race_p_and_residual(
        logits_ptr + row * logits_row_stride, q_ptr + j * q_row_stride,
        noise_ptr + noise_row * noise_row_stride, x, x_valid, shift, row_sum, sample_end, vocab,
        HAS_Q, BLOCK)
    # An empty residual (p == q) falls back to p; a row allowing nothing gives -1.
    sampled = tl.where(is_recovered & (best_r_at >= 0), best_r_at, best_p_at).to(tl.int64)
    greedy_token = tl.where(alive, tl.load(row_argmax_ptr + row), -1)
    token = tl.where(greedy, greedy_token, sampled)
    tl.store(out_row_ptr + num_accepted, token)
    tl.store(num_accepted_ptr + req, num_accepted)
    tl.store(recovered_ptr + req, tl.where(is_recovered, token, -1))
    tl.store(bonus_ptr + req, tl.where(is_recovered, -1, token))
