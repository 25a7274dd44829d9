"""The forced drafter: the grammar's forced continuation, proposed as point-mass drafts.

Where the grammar allows exactly one continuing string (JSON keys, punctuation, the closing
of an object under a strict schema), the matcher's jump-forward tokens are drafted with q = 1.
They are certain where the mask allows one token; where the forced *string* could tokenize
another way they are drafts like any other, and verification decides.
"""

from __future__ import annotations

from collections.abc import Sequence

from constrained_spec.drafters.base import Drafter, DraftState


class ForcedDrafter(Drafter):
    name = "forced"

    def __init__(self, max_tokens: int = 16) -> None:
        self.max_tokens = max_tokens

    def propose(self, states: Sequence[DraftState], k: int | None = None) -> None:
        cap = self.max_tokens if k is None else k
        for st in states:
            # jump-forward may stop at a tokenization boundary; ask again after each batch
            while st.num_forced < cap and not st.cursor.exhausted:
                forced = st.cursor.forced_tokens()
                if not forced:
                    break
                pushed = 0
                budget = cap - st.num_forced
                for tok in forced[:budget]:
                    if not st.push(tok):
                        break
                    st.forced_at.append(len(st.tokens) - 1)
                    pushed += 1
                st.num_forced += pushed
                if pushed < min(len(forced), budget):
                    break
