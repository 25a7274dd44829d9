"""The n-gram drafter (prompt lookup): copy what followed the last n tokens earlier on.

Structured extraction copies values from the prompt, and the schema in the system message
holds every key, so the continuation of the longest recent match (n from ``max_n`` down to
``min_n``) is often right. Each drafted position is checked against the grammar fork; the
proposal stops at the first token the grammar forbids. Drafts are point masses (q = 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from constrained_spec.drafters.base import Drafter, DraftState


def lookup(context: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The up-to-``k`` tokens that followed the most recent earlier match of the context's tail."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = list(context[L - n:])
        first = tail[0]
        # most recent match first: scan backwards over start positions
        for start in range(L - n - 1, -1, -1):
            if context[start] == first and list(context[start:start + n]) == tail:
                follow = list(context[start + n: start + n + k])
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    name = "ngram"
    resumable = True  # stateless: can continue any proposal, e.g. after forced tokens

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, states: Sequence[DraftState], k: int) -> None:
        for st in states:
            ctx = st.context + st.tokens  # continue after any forced drafts
            for tok in lookup(ctx, k, self.max_n, self.min_n):
                if not st.push(tok):
                    break
