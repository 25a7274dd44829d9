"""Speculation statistics, kept per request and summed over a batch.

``acceptance_length`` = emitted tokens per target forward (1.0 without speculation).
``acceptance_rate_by_position[i]`` = of the steps that proposed at least i+1 drafts, the
fraction whose (i+1)-th draft was accepted.
``loops_detected`` = attempts stopped early by the repetition-loop detector (``loops.py``);
``loop_tokens_saved`` = the ``max_tokens`` budget they had left when stopped, which a loop
under a grammar would have spent (an upper bound: the loop might have ended by itself).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, read from the runner's prefix cache, not computed
    emitted_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forced_drafted: int = 0
    forced_tokens: int = 0  # forced drafts that were accepted
    proposed_at: list[int] = field(default_factory=list)  # steps with >= i+1 drafts
    accepted_at: list[int] = field(default_factory=list)  # steps whose draft i+1 was accepted
    prefill_s: float = 0.0
    drafting_s: float = 0.0
    grammar_s: float = 0.0
    target_forward_s: float = 0.0
    verification_s: float = 0.0
    step_s: float = 0.0
    attempts: int = 1
    loops_detected: int = 0
    loop_tokens_saved: int = 0

    def record_positions(self, drafted: int, accepted: int) -> None:
        while len(self.proposed_at) < drafted:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.proposed_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    def record_loop(self, budget_left: int) -> None:
        """An attempt was stopped by the loop detector with ``budget_left`` tokens unspent."""
        self.loops_detected += 1
        self.loop_tokens_saved += max(0, budget_left)

    @property
    def acceptance_length(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def decode_s(self) -> float:
        return self.step_s

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.step_s
        return self.emitted_tokens / total if total > 0 else 0.0

    def merge(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats()
        for name in ("prompt_tokens", "cached_prompt_tokens", "emitted_tokens", "target_forwards", "drafted_tokens",
                     "accepted_tokens", "forced_drafted", "forced_tokens", "prefill_s", "drafting_s",
                     "grammar_s", "target_forward_s", "verification_s", "step_s", "attempts",
                     "loops_detected", "loop_tokens_saved"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.proposed_at), len(other.proposed_at))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        out.proposed_at = [a + b for a, b in zip(pad(self.proposed_at), pad(other.proposed_at))]
        out.accepted_at = [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(acceptance_length=round(self.acceptance_length, 3),
                 acceptance_rate=round(self.acceptance_rate, 3),
                 acceptance_rate_by_position=[round(x, 3) for x in self.acceptance_rate_by_position],
                 tokens_per_s=round(self.tokens_per_s, 2))
        return d
