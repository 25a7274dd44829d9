"""Logits processing shared by the target and every drafter.

One definition of the sampled distribution, so p and q are processed the same way:

    p̃ = top_p(top_k(softmax(guard(masked_logits) / temperature)))

The grammar mask is applied FIRST (disallowed = -inf), so top-k and top-p choose among the
tokens the grammar allows. Greedy rows (temperature 0) are left as (masked, guarded) logits;
the verifier takes their argmax.

``guard`` is the opt-in repetition guard (``repetition_penalty``, ``no_repeat_ngram_size``).
It is a function of the row's own prefix: the output so far plus the drafts before that
position (never the prompt: extraction copies values from it). Applied identically at every
verified position, the target's distribution is modified the same way with and without
speculation, so greedy outputs stay token-identical and rejection sampling stays exact (for
the modified distribution). Two rules keep it from fighting the grammar:

- a position where the grammar forces the continuation (JSON keys, punctuation: the
  matcher's jump-forward string is non-empty) is left alone: repeated structure is not a loop;
- if the ban would leave a row with no allowed token, the row keeps the grammar mask alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Apply temperature, top-k and top-p to masked logits, row-wise, in place where possible.

    Parameters
    ----------
    logits: float [N, V], already grammar-masked (disallowed = -inf).
    temperature: float [N]; rows with 0 are greedy and are returned unchanged.
    top_k: long [N]; 0 = off.
    top_p: float [N]; 1.0 = off. However small, the most likely token is kept.

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
        # drop a token when the mass strictly before it already reaches top_p
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p[:, None]
        drop_sorted &= sampled[:, None]
        # the most likely token always stays: a top_p that underflows float32 (< ~1e-45 is 0)
        # would otherwise drop every token, as would rounding in the cumsum
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probs_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Softmax that maps an all -inf row to all zeros instead of NaN."""
    probs = logits.softmax(dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def ngram_bans(prefix: Sequence[int], n: int, rows_from: int) -> list[set[int]]:
    """For each position ``p`` in ``rows_from .. len(prefix)``: the tokens that would complete
    an n-gram already present in ``prefix[:p]`` (transformers' ``no_repeat_ngram_size``)."""
    seen: dict[tuple[int, ...], set[int]] = {}
    out: list[set[int]] = []
    for p in range(len(prefix) + 1):
        if p >= rows_from:
            out.append(set(seen.get(tuple(prefix[p - n + 1:p]), ())) if p >= n - 1 else set())
        if p >= n - 1 and p < len(prefix):  # the n-gram ending at position p
            seen.setdefault(tuple(prefix[p - n + 1:p]), set()).add(prefix[p])
    return out


def apply_repetition_guard(logits: torch.Tensor, prefixes: Sequence[Sequence[int]],
                           first_rows: Sequence[int], params: Sequence[object],
                           exempt: Sequence[Sequence[bool]]) -> torch.Tensor:
    """Apply the repetition guard of each request to its verified rows (see module docstring).

    Parameters
    ----------
    logits: float [N, V], grammar-masked; request b owns ``len(prefixes[b]) - first_rows[b] + 1``
        consecutive rows.
    prefixes: per request, its output so far followed by its drafts (the history of its last row).
    first_rows: per request, the length of the output so far (the prefix length of its first row).
    params: per request, its ``SamplingParams`` (``repetition_penalty``, ``no_repeat_ngram_size``).
    exempt: per request, per row: True where the grammar forces the continuation.

    Returns
    -------
    float [N, V] logits (a new tensor when anything changed).
    """
    pen_rows: list[int] = []
    pen_cols: list[int] = []
    pen_vals: list[float] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    row = 0
    for prefix, start, prm, ex in zip(prefixes, first_rows, params, exempt):
        count = len(prefix) - start + 1
        penalty = float(getattr(prm, "repetition_penalty", 1.0))
        n = int(getattr(prm, "no_repeat_ngram_size", 0))
        bans = ngram_bans(prefix, n, start) if n > 0 else None
        for j in range(count):
            if ex[j] if j < len(ex) else False:
                continue
            if penalty != 1.0:
                toks = set(prefix[:start + j])
                pen_rows += [row + j] * len(toks)
                pen_cols += toks
                pen_vals += [penalty] * len(toks)
            if bans is not None and bans[j]:
                ban_rows += [row + j] * len(bans[j])
                ban_cols += bans[j]
        row += count
    if not pen_rows and not ban_rows:
        return logits
    logits = logits.clone()
    dev = logits.device
    if pen_rows:
        r = torch.tensor(pen_rows, dtype=torch.long, device=dev)
        c = torch.tensor(pen_cols, dtype=torch.long, device=dev)
        pen = torch.tensor(pen_vals, dtype=logits.dtype, device=dev)
        vals = logits[r, c]
        logits[r, c] = torch.where(vals > 0, vals / pen, vals * pen)
    if ban_rows:
        rows = sorted(set(ban_rows))
        local = {row: i for i, row in enumerate(rows)}
        index = torch.tensor(rows, dtype=torch.long, device=dev)
        sub = logits[index]  # [R, V]: only the rows with bans
        banned = torch.zeros(sub.shape, dtype=torch.bool, device=dev)
        banned[torch.tensor([local[row] for row in ban_rows], dtype=torch.long, device=dev),
               torch.tensor(ban_cols, dtype=torch.long, device=dev)] = True
        # a row whose every allowed token is banned keeps the grammar mask alone
        left = (torch.isfinite(sub) & ~banned).any(dim=-1, keepdim=True)
        logits[index] = sub.masked_fill(banned & left, float("-inf"))
    return logits
