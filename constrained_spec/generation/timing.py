"""Where a decoding step's time goes: one `StepTimer` per step, charged to its requests.

The engine measures each stage of a step once for the whole batch (a stage is one batched
call), then charges every request of the step an equal share in its `SpecStats`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from constrained_spec.generation.stats import SpecStats

Stage = Literal["drafting", "grammar", "forward", "verify", "commit"]


@dataclass
class StepTimer:
    """Seconds per stage of one step.

    ``drafting`` is the wall time of the proposal, including ``grammar``: the time the
    drafts' grammar forks spent filling masks, accepting drafts and finding forced tokens
    (`drafters.base.GrammarCursor` measures it). `charge` books the two apart, and books
    ``commit`` (the real matchers taking the emitted tokens) as grammar time too.
    """

    started: float = field(default_factory=time.perf_counter)
    drafting: float = 0.0
    grammar: float = 0.0
    forward: float = 0.0
    verify: float = 0.0
    commit: float = 0.0

    @contextmanager
    def measure(self, stage: Stage) -> Iterator[None]:
        """Add the time the ``with`` block takes to ``stage``."""
        t0 = time.perf_counter()
        yield
        setattr(self, stage, getattr(self, stage) + time.perf_counter() - t0)

    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.perf_counter() - self.started

    def charge(self, stats: Sequence[SpecStats]) -> None:
        """One target forward and an equal share of every stage to each request's stats."""
        n = len(stats)
        total = time.perf_counter() - self.started
        for st in stats:
            st.target_forwards += 1
            st.drafting_s += (self.drafting - self.grammar) / n
            st.grammar_s += (self.grammar + self.commit) / n
            st.target_forward_s += self.forward / n
            st.verification_s += self.verify / n
            st.step_s += total / n
