"""Log-probabilities of the emitted tokens, from the logits the verifier already has.

Every emitted token -- accepted draft or the verifier's own token -- was chosen at a position
whose target logits the verification forward computed (`engine.Engine._score`): its logprob
costs no extra forward, and under speculation it is the one a forward without speculation
gives at that position (the decode rows are row-invariant, docs/exactness.md), so logprobs are
exact with drafting on.

Which distribution (``logprobs_mode``):

``"masked"`` (the default)
    The model's next-token distribution **restricted to the tokens the grammar allows there and
    renormalized** (temperature 1, no top-k / top-p, no repetition penalty): the distribution
    the constrained output is actually drawn from at temperature 1. What a confidence or a
    reranking score over constrained outputs needs: the probability mass the grammar removed
    is not counted against the answer, and ``top_logprobs`` lists only tokens the output could
    have had. A token the grammar forced has logprob 0.
``"raw"``
    The model's own distribution over the whole vocabulary, before the grammar mask (what
    vLLM returns by default, ``logprobs_mode="raw_logprobs"``): how much the model itself
    wanted each token; ``top_logprobs`` may list tokens the grammar forbade.

A row's values are float32 ``log_softmax`` of that row's logits (`SamplingParams.logprobs`,
``logprobs_mode``; the options are checked there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

LogprobsMode = Literal["masked", "raw"]

@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its logprob, and the ``top`` alternatives at its position as
    ``(token_id, logprob)``, most likely first (``top_logprobs`` of them; the token itself is
    listed there only if it is among them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                 top: int) -> list[TokenLogprob]:
    """For each ``rows[i]`` of ``logits`` [R, V]: the logprob of ``tokens[i]`` and the ``top``
    most likely tokens of that row (log_softmax in float32; a masked-out entry is -inf)."""
    if rows.numel() == 0:
        return []
    lp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).view(-1).tolist()
    if top:
        values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        alts = [[(int(t), float(v)) for t, v in zip(ti, vi) if v != float("-inf")]
                for ti, vi in zip(ids.tolist(), values.tolist())]
    else:
        alts = [[] for _ in chosen]
    return [TokenLogprob(int(t), float(c), tuple(a))
            for t, c, a in zip(tokens.tolist(), chosen, alts)]


def request_rows(wanted: Sequence[bool], num_rows: Sequence[int]) -> list[int]:
    """The rows of a step's logits [N + B, V] (request b's ``num_rows[b]`` rows in order) that
    belong to the requests that want logprobs."""
    out: list[int] = []
    row = 0
    for want, n in zip(wanted, num_rows):
        if want:
            out.extend(range(row, row + n))
        row += n
    return out
