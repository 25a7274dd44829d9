"""Logits processing shared by the target and every drafter.

One definition of the sampled distribution, so p and q are processed the same way:

    p̃ = top_p(top_k(softmax(masked_logits / temperature)))

The grammar mask is applied FIRST (disallowed = -inf), so top-k and top-p choose among the
tokens the grammar allows. Greedy rows (temperature 0) are left as masked logits; the
verifier takes their argmax.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Apply temperature, top-k and top-p to masked logits, row-wise, in place where possible.

    Parameters
    ----------
    logits: float [N, V], already grammar-masked (disallowed = -inf).
    temperature: float [N]; rows with 0 are greedy and are returned unchanged.
    top_k: long [N]; 0 = off.
    top_p: float [N]; 1.0 = off.

    Returns
    -------
    float [N, V] logits whose softmax is the sampling distribution (kept tokens keep their
    relative weights; dropped ones are -inf).
    """
    sampled = temperature > 0
    if not bool(sampled.any()):
        return logits
    t = torch.where(sampled, temperature, torch.ones_like(temperature))
    logits = logits / t[:, None]
    if bool((top_k > 0).any()):
        V = logits.shape[-1]
        k = torch.where((top_k > 0) & sampled, top_k.clamp(max=V), torch.full_like(top_k, V))
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool(((top_p < 1.0) & sampled).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p[:, None]
        drop_sorted &= sampled[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probs_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Softmax that maps an all -inf row to all zeros instead of NaN."""
    probs = logits.softmax(dim=-1)
    return torch.nan_to_num(probs, nan=0.0)
