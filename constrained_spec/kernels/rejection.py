"""Batched masked rejection sampling: the verification step of speculative decoding.

Request i proposed k_i drafts (k_i may be 0); the target model scored k_i + 1 positions,
rows cu_num_drafts[i] + i ... cu_num_drafts[i + 1] + i of `target_logits`, already masked by
the grammar and tempered, so p~ = softmax(row) is the masked, renormalised target. Drafts are
flattened with cumulative offsets and outputs padded with -1 (the vLLM v1 layout).

Sampled requests accept draft x at its row with probability min(1, p~(x) / q(x)), i.e. when
uniform < p~(x) / q(x); q is `draft_probs` (the distribution x was drawn from) or, if None, a
point mass on x. At the first rejection the **recovered** token is sampled from
norm(max(0, p~ - q)); if every draft is accepted the **bonus** token is sampled from p~ of the
last row. This leaves the output distributed exactly as p~. Greedy requests accept while
draft == argmax(row) and emit the argmax at the first mismatch (or as the bonus).

Sampling from a distribution d uses argmax(d / e), e ~ Exp(1) i.i.d. (the exponential-race
form of the Gumbel trick, as vLLM does): no cumsum, no sync. Tokens with d = 0 score 0 and are
never picked; `exp_noise` must be positive and finite (Exp(1) draws are).

Edge cases, defined here and tested:

- A draft id outside [0, V) (-1 is the padding id) is always rejected; the token emitted at its
  position is then sampled from p~ (a padding slot was not drawn from q) or, if greedy, argmax.
- A row where every logit is -inf allows nothing: p~ = 0, every draft at it is rejected and the
  token emitted there is -1 (greedy too). The caller treats -1 as "the grammar allowed no
  token" (an error), never as a token id. No NaN is produced and nothing loops.
- An empty residual (max(0, p~ - q) == 0 everywhere, i.e. p~ == q) falls back to sampling p~.
- A draft with q(x) == 0 (it cannot have been drawn from q) is rejected.
- Ties in an argmax (greedy, or the sampling race) go to the lowest token id.

Implementations, same arguments and the same outputs for the same `uniform` / `exp_noise`:

- `rejection_sample_reference`: loops over requests and drafts; the definition.
- `_rejection_sample_torch`: vectorised over requests, one step per draft position.
- `rejection_sample_triton`: one program per row for the softmax statistics, then one program
  per request for acceptance and the emitted token.

They agree on every decision unless a uniform draw or two sampling scores lie within float
rounding of each other (summation orders differ, and GPU exp / division are approximate).

Which one runs on CPU was measured (benchmarks/kernels.py, 1 thread, K = 5): the reference
works on one [V] row at a time, which stays in cache, while the vectorised path streams
[requests, V] blocks through memory. On the embedded model's vocabulary the reference is
faster at every batch size; the vectorised path wins only on small vocabularies, where the
per-row Python overhead dominates (benchmarks/RESULTS.md, "Kernels (CPU)"). So "auto" /
"torch" on CPU take the reference above `_CPU_VECTORISED_MAX_VOCAB` and the vectorised path
below it; CUDA without Triton takes the vectorised path (no per-element host syncs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import Backend, check_triton_can_run, resolve_backend

_BLOCK = 4096  # Triton: logits per step of the loops over the vocabulary
_NEG_INF = float("-inf")
_CPU_VECTORISED_MAX_VOCAB = 8192  # measured crossover on CPU, see the module docstring


@dataclass
class RejectionOutput:
    """What verification decided for each of B requests (all int64, on the logits' device)."""

    output_tokens: torch.Tensor  # [B, max_k + 1] accepted drafts, then recovered / bonus; -1 pad
    num_accepted: torch.Tensor   # [B] drafts accepted (tokens emitted = num_accepted + 1)
    recovered: torch.Tensor      # [B] token sampled at the first rejection, -1 if none
    bonus: torch.Tensor          # [B] token sampled after all drafts were accepted, -1 if not


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: torch.Tensor | bool,
    uniform: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: Backend = "auto",
) -> RejectionOutput:
    """Verify every request's drafts against the masked target and emit one more token.

    Parameters
    ----------
    target_logits : torch.Tensor
        [sum(k_i + 1), V] float, masked (disallowed = -inf) and tempered. Request i owns rows
        cu_num_drafts[i] + i ... cu_num_drafts[i + 1] + i; the last is its bonus row.
    draft_tokens : torch.Tensor
        [sum k_i] int64 flattened drafts; ids outside [0, V) (-1 = padding) are rejected.
    cu_num_drafts : torch.Tensor
        [B + 1] int64 cumulative draft counts, cu_num_drafts[0] == 0.
    draft_probs : torch.Tensor, optional
        [sum k_i, V] float q each draft was drawn from (masked and renormalised if the draft
        was masked). None: point-mass drafts (q = 1 on the drafted token).
    greedy : torch.Tensor or bool
        [B] bool, or one bool for all requests: greedy requests accept while
        draft == argmax and emit the argmax.
    uniform : torch.Tensor, optional
        [sum k_i] float in [0, 1), acceptance draws. None: drawn from `generator`.
    exp_noise : torch.Tensor, optional
        [sum(k_i + 1), V] (the row of the emitted position is used) or [B, V] (one row per
        request) float Exp(1) noise for sampling recovered / bonus tokens. None: [B, V] drawn
        from `generator` (not drawn when `greedy` is True).
    generator : torch.Generator, optional
        Source of the missing draws (uniform first, then exp_noise).
    backend : {"auto", "torch", "triton"}
        "auto": Triton on CUDA, torch elsewhere (on CPU: the row-at-a-time reference for
        large vocabularies, the vectorised path for small ones; see the module docstring).

    Returns
    -------
    RejectionOutput
    """
    if resolve_backend(backend, target_logits.device) == "triton":
        implementation = rejection_sample_triton
    elif (target_logits.device.type == "cpu"
          and target_logits.shape[-1] > _CPU_VECTORISED_MAX_VOCAB):
        implementation = rejection_sample_reference
    else:
        implementation = _rejection_sample_torch
    return implementation(target_logits, draft_tokens, cu_num_drafts, draft_probs,
                          greedy=greedy, uniform=uniform, exp_noise=exp_noise,
                          generator=generator)


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: torch.Tensor | bool,
    uniform: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> RejectionOutput:
    """The definition, one request and one draft at a time. Arguments: `rejection_sample`."""
    greedy, uniform, exp_noise = _prepare(target_logits, draft_tokens, cu_num_drafts,
                                          draft_probs, greedy, uniform, exp_noise, generator)
    num_requests = cu_num_drafts.shape[0] - 1
    vocab = target_logits.shape[1]
    cu = cu_num_drafts.tolist()
    max_k = max((cu[i + 1] - cu[i] for i in range(num_requests)), default=0)
    out = _empty_output(num_requests, max_k, target_logits.device)

    for i in range(num_requests):
        first_row, k = cu[i] + i, cu[i + 1] - cu[i]
        num_accepted = 0
        for t in range(k):
            j, row = cu[i] + t, first_row + t
            x = int(draft_tokens[j])
            logits = target_logits[row].float()                              # [V]
            if not 0 <= x < vocab:
                accept = False
            elif greedy[i]:
                accept = bool(logits.max() > _NEG_INF) and x == int(logits.argmax())
            else:
                p_x = _prob_of(logits, x)                                    # p~(x)
                q_x = 1.0 if draft_probs is None else float(draft_probs[j, x])
                accept = q_x > 0 and float(uniform[j]) < p_x / q_x
            if not accept:
                break
            out.output_tokens[i, t] = x
            num_accepted += 1

        row = first_row + num_accepted
        logits = target_logits[row].float()
        is_recovered = num_accepted < k
        if greedy[i]:
            token = int(logits.argmax()) if logits.max() > _NEG_INF else -1
        else:
            p = _softmax_or_zero(logits)                                     # [V] p~
            dist = p
            x = int(draft_tokens[cu[i] + num_accepted]) if is_recovered else -1
            if 0 <= x < vocab:
                if draft_probs is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = (p - draft_probs[cu[i] + num_accepted].float()).clamp(min=0.0)
                if residual.max() > 0:
                    dist = residual
            # a sampled request means not every request is greedy, so _prepare drew noise
            assert exp_noise is not None
            noise = exp_noise[i if exp_noise.shape[0] == num_requests else row]
            token = _sample_by_exp_race(dist, noise)
        out.output_tokens[i, num_accepted] = token
        out.num_accepted[i] = num_accepted
        (out.recovered if is_recovered else out.bonus)[i] = token
    return out


def _rejection_sample_torch(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: torch.Tensor | bool,
    uniform: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> RejectionOutput:
    """The reference vectorised over requests: one step per draft position, not per draft.

    For small vocabularies on CPU and for CUDA without Triton. Like the reference it reads
    only the rows it needs (step t looks at draft t of the requests that accepted drafts
    0 .. t-1), so a batch that rejects early costs little. Elementwise `torch.where` over
    [rows, V] is avoided: on CPU it runs far slower than arithmetic (measured).
    """
    greedy, uniform, exp_noise = _prepare(target_logits, draft_tokens, cu_num_drafts,
                                          draft_probs, greedy, uniform, exp_noise, generator)
    device = target_logits.device
    num_requests = cu_num_drafts.shape[0] - 1
    k = cu_num_drafts[1:] - cu_num_drafts[:-1]                               # [B]
    max_k = int(k.max()) if num_requests else 0
    out = _empty_output(num_requests, max_k, device)
    if num_requests == 0:
        return out
    any_greedy = bool(greedy.any())
    num_accepted = _accept_vectorised(target_logits, draft_tokens, cu_num_drafts, draft_probs,
                                      greedy, uniform, k, max_k, any_greedy)
    positions = torch.arange(max_k, device=device)
    drafts_padded = torch.cat([draft_tokens, draft_tokens.new_full((1,), -1)])
    draft_at = (cu_num_drafts[:-1, None] + positions).clamp(max=draft_tokens.shape[0])  # [B, max_k]
    out.output_tokens[:, :max_k] = torch.where(positions < num_accepted[:, None],
                                               drafts_padded[draft_at], -1)

    # The emitted token of each request, at row first_row + num_accepted.
    requests = torch.arange(num_requests, device=device)
    emit_row = cu_num_drafts[:-1] + requests + num_accepted                  # [B]
    is_recovered = num_accepted < k
    token = _emit_vectorised(target_logits, drafts_padded, cu_num_drafts, draft_probs, greedy,
                             exp_noise, num_accepted, emit_row, is_recovered, any_greedy)
    out.output_tokens[requests, num_accepted] = token
    out.num_accepted.copy_(num_accepted)
    out.recovered.copy_(torch.where(is_recovered, token, -1))
    out.bonus.copy_(torch.where(is_recovered, -1, token))
    return out


def _accept_vectorised(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                       cu_num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                       greedy: torch.Tensor, uniform: torch.Tensor, k: torch.Tensor,
                       max_k: int, any_greedy: bool) -> torch.Tensor:
    """Acceptance, one draft position at a time for the requests still accepting: [B] the
    number of drafts each request accepted (`_rejection_sample_torch`'s first step; ``k``:
    [B] drafts per request, ``max_k`` its max)."""
    num_requests, vocab = k.shape[0], target_logits.shape[1]
    num_accepted = torch.zeros(num_requests, dtype=torch.long, device=target_logits.device)
    accepting = k > 0                                                        # [B]
    for t in range(max_k):
        req = (accepting & (k > t)).nonzero().flatten()                      # [n]
        if req.numel() == 0:
            break
        j = cu_num_drafts[req] + t                                           # [n] draft index
        x = draft_tokens[j]
        valid = (x >= 0) & (x < vocab)
        x = torch.where(valid, x, 0)
        logits = target_logits.index_select(0, j + req).float()              # [n, V]
        e, total = _exp_rows(logits)                                         # p~ = e / total
        p_x = e.gather(1, x[:, None]).flatten() / total                      # [n]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[j, x].float()
        accept = valid & (q_x > 0) & (uniform[j] < p_x / torch.where(q_x > 0, q_x, 1.0))
        if any_greedy:
            row_max, row_argmax = logits.max(dim=-1)
            accept_greedy = valid & (row_max > _NEG_INF) & (x == row_argmax)
            accept = torch.where(greedy[req], accept_greedy, accept)
        num_accepted[req] += accept.long()
        accepting[req] = accept
    return num_accepted


def _emit_vectorised(target_logits: torch.Tensor, drafts_padded: torch.Tensor,
                     cu_num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     greedy: torch.Tensor, exp_noise: torch.Tensor | None,
                     num_accepted: torch.Tensor, emit_row: torch.Tensor,
                     is_recovered: torch.Tensor, any_greedy: bool) -> torch.Tensor:
    """[B] the token each request emits at ``emit_row``: the argmax for a greedy request, else
    a draw from the residual at a rejection (p~ where the residual is empty) or from p~ (the
    bonus); -1 where the row allows nothing (`_rejection_sample_torch`'s second step).
    ``drafts_padded`` is the drafts with one -1 after them."""
    num_requests, vocab = emit_row.shape[0], target_logits.shape[1]
    num_drafts = drafts_padded.shape[0] - 1
    logits = target_logits.index_select(0, emit_row).float()                 # [B, V]
    token = torch.full_like(num_accepted, -1)
    if any_greedy:
        row_max, row_argmax = logits.max(dim=-1)
        token = torch.where(row_max > _NEG_INF, row_argmax, -1)
    if exp_noise is None:  # _prepare draws noise unless every request is greedy
        return token
    e, total = _exp_rows(logits)
    p = e / total[:, None]                                                   # [B, V] p~
    j = cu_num_drafts[:-1] + num_accepted                                    # rejected draft
    x = torch.where(is_recovered, drafts_padded[j], -1)
    x_valid = (x >= 0) & (x < vocab)
    if draft_probs is None:
        residual = p.clone()
        residual[x_valid.nonzero().flatten(), x[x_valid]] = 0.0
    elif num_drafts:
        q = draft_probs.index_select(0, j.clamp(max=num_drafts - 1)).float()
        residual = (p - q).clamp_(min=0.0)
    else:
        residual = p
    use_p = ~(x_valid & (residual.amax(dim=-1) > 0))                        # empty: sample p~
    residual[use_p] = p[use_p]
    noise = (exp_noise if exp_noise.shape[0] == num_requests
             else exp_noise.index_select(0, emit_row))
    best, best_at = (residual / noise).max(dim=-1)
    return torch.where(greedy, token, torch.where(best > 0, best_at, -1))


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: torch.Tensor | bool,
    uniform: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> RejectionOutput:
    """Triton: row statistics (one program per row), then one program per request."""
    check_triton_can_run(target_logits.device)
    from . import _triton

    greedy, uniform, exp_noise = _prepare(target_logits, draft_tokens, cu_num_drafts,
                                          draft_probs, greedy, uniform, exp_noise, generator)
    all_greedy = exp_noise is None  # _prepare draws noise unless every request is greedy
    device = target_logits.device
    num_requests = cu_num_drafts.shape[0] - 1
    num_rows, vocab = target_logits.shape
    max_k = int((cu_num_drafts[1:] - cu_num_drafts[:-1]).max()) if num_requests else 0
    out = _empty_output(num_requests, max_k, device)
    if num_requests == 0:
        return out
    if target_logits.stride(1) != 1 or (draft_probs is not None and draft_probs.stride(1) != 1):
        raise ValueError("rejection_sample_triton needs unit stride along the vocabulary")
    if exp_noise is not None and exp_noise.stride(1) != 1:
        exp_noise = exp_noise.contiguous()

    row_max = torch.empty(num_rows, dtype=torch.float32, device=device)
    row_sum = torch.empty(num_rows, dtype=torch.float32, device=device)
    row_argmax = torch.empty(num_rows, dtype=torch.int64, device=device)
    _triton.rejection_row_stats_kernel[(num_rows,)](
        target_logits, target_logits.stride(0), row_max, row_sum, row_argmax, vocab,
        COMPUTE_SUM=not all_greedy, BLOCK=_BLOCK,
    )
    # Placeholders stand in for tensors a constexpr flag or the greedy flag keeps unread.
    noise = exp_noise if exp_noise is not None else row_max[:, None]
    q = draft_probs if draft_probs is not None else target_logits
    _triton.rejection_sample_kernel[(num_requests,)](
        target_logits, target_logits.stride(0),
        draft_tokens.contiguous().long(), cu_num_drafts.contiguous().long(),
        q, q.stride(0), greedy.to(torch.int32), uniform.float().contiguous(),
        noise, noise.stride(0), row_max, row_sum, row_argmax,
        out.output_tokens, out.output_tokens.stride(0),
        out.num_accepted, out.recovered, out.bonus, vocab,
        HAS_Q=draft_probs is not None,
        NOISE_PER_REQUEST=noise.shape[0] == num_requests,
        BLOCK=_BLOCK,
    )
    return out


def _prepare(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor | bool,
    uniform: torch.Tensor | None,
    exp_noise: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check shapes; turn `greedy` into a [B] bool tensor; draw missing randomness.

    Every implementation calls this, so one generator state gives one outcome everywhere.
    """
    device = target_logits.device
    num_requests = cu_num_drafts.shape[0] - 1
    num_drafts = draft_tokens.shape[0]
    num_rows, vocab = target_logits.shape if target_logits.dim() == 2 else (-1, -1)
    if target_logits.dim() != 2 or num_rows != num_drafts + num_requests:
        raise ValueError(f"target_logits must be [sum(k_i + 1), V] = [{num_drafts} + "
                         f"{num_requests}, V], got {tuple(target_logits.shape)}")
    if draft_tokens.dim() != 1 or cu_num_drafts.dim() != 1 or num_requests < 0:
        raise ValueError("draft_tokens must be [sum k_i] and cu_num_drafts [B + 1]")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab):
        raise ValueError(f"draft_probs must be [{num_drafts}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    if isinstance(greedy, bool):
        all_greedy = greedy
        greedy = torch.full((num_requests,), greedy, dtype=torch.bool, device=device)
    else:
        if greedy.shape != (num_requests,):
            raise ValueError(f"greedy must be a bool or [{num_requests}], "
                             f"got {tuple(greedy.shape)}")
        # a host tensor is checked for free; a device one would cost a sync (noise is drawn)
        all_greedy = greedy.device.type == "cpu" and bool(greedy.all())
        greedy = greedy.to(device=device, dtype=torch.bool)
    if uniform is None:
        uniform = torch.rand(num_drafts, generator=generator, device=device)
    elif uniform.shape != (num_drafts,):
        raise ValueError(f"uniform must be [{num_drafts}], got {tuple(uniform.shape)}")
    if exp_noise is None:
        if not all_greedy:
            exp_noise = torch.empty(num_requests, vocab, device=device).exponential_(
                generator=generator)
    elif exp_noise.shape[0] not in (num_rows, num_requests) or exp_noise.shape[1:] != (vocab,):
        raise ValueError(f"exp_noise must be [{num_rows}, {vocab}] or [{num_requests}, "
                         f"{vocab}], got {tuple(exp_noise.shape)}")
    return greedy, uniform, exp_noise


def _exp_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, V] float32 -> (e = exp(logits - row max), total = e.sum(-1)), so p~ = e / total.

    A row that is all -inf gives e = 0 and total = 1 (p~ = 0, no NaN).
    """
    row_max = logits.amax(dim=-1)
    e = torch.exp(logits - torch.where(row_max > _NEG_INF, row_max, 0.0)[:, None])
    total = e.sum(dim=-1)
    return e, torch.where(total > 0, total, 1.0)


def _shifted_exp(logits: torch.Tensor) -> torch.Tensor | None:
    """exp(l - max) of a [V] float32 row; None if the row is all -inf."""
    row_max = logits.max()
    if row_max == _NEG_INF:
        return None
    return torch.sub(logits, row_max).exp_()


def _softmax_or_zero(logits: torch.Tensor) -> torch.Tensor:
    """softmax of a [V] float32 row, as exp(l - max) / sum; all zeros if the row is all -inf."""
    e = _shifted_exp(logits)
    return torch.zeros_like(logits) if e is None else e.div_(e.sum())


def _prob_of(logits: torch.Tensor, x: int) -> float:
    """``_softmax_or_zero(logits)[x]`` to the bit (the same float32 e[x] / sum(e)) without
    dividing the other V - 1 entries: a sampled draft's acceptance reads one probability."""
    e = _shifted_exp(logits)
    return 0.0 if e is None else float(e[x] / e.sum())


def _sample_by_exp_race(dist: torch.Tensor, noise: torch.Tensor) -> int:
    """One draw from dist / sum(dist): argmax(dist / noise); -1 if dist is all zero.

    A zero-probability token scores 0 and is never picked (noise is positive and finite).
    """
    best, best_at = (dist / noise).max(dim=-1)
    return int(best_at) if best > 0 else -1


def _empty_output(num_requests: int, max_k: int, device: torch.device) -> RejectionOutput:
    def minus_ones(*shape: int) -> torch.Tensor:
        return torch.full(shape, -1, dtype=torch.int64, device=device)

    return RejectionOutput(output_tokens=minus_ones(num_requests, max_k + 1),
                           num_accepted=torch.zeros(num_requests, dtype=torch.int64,
                                                    device=device),
                           recovered=minus_ones(num_requests), bonus=minus_ones(num_requests))
