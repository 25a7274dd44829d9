"""Speculation sized to the load: how many of its drafts each request verifies this step.

A draft row is worth verifying only if the tokens it is expected to add pay for the time it
adds to the step. Both sides are measured as the engine runs:

* the step's cost curve: step seconds ≈ ``fixed + per_row * rows``, a least-squares line over
  the recent steps (`CostCurve`); on one core a row costs little next to the weights' read
  at batch 1 and almost as much as a whole decode row at batch 8 (benchmarks/RESULTS.md,
  "Serving under concurrency");
* each request's acceptance of its model drafts (`Acceptance`): of the model-drafted
  positions verification reached, the share it accepted, per position in a run of model
  drafts, shrunk towards the engine-wide share while the request has few of its own.

Draft ``j`` of a request is accepted only if every draft before it is, so its expected gain is
``P_j``, the product of the acceptance of each draft up to it: 1 for a forced token (the
grammar's only continuation: accepted), the request's acceptance at its run position for a
model draft. The
step keeps the positions with the highest ``P_j`` while each still raises the step's expected
tokens per second: adding a row of gain ``g`` helps iff ``g / per_row > tokens / seconds``
(`plan_cuts`; the candidates taken in decreasing ``P``, each request's prefix by
construction, since ``P`` never rises along a request). Forced tokens at a request's start
have ``P = 1`` and are always kept.

What it never changes: which tokens are emitted. Verification is lossless whatever the
drafts (a shorter proposal only means fewer tokens per step), so greedy outputs are the same
with the budget on or off, batched or alone (tested).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

#: steps the cost line is fitted over
COST_WINDOW = 128
#: observations before the budget cuts anything (until then every draft is verified)
MIN_STEPS = 16
#: pseudo-observations of the engine-wide acceptance in a request's own estimate
PRIOR_WEIGHT = 4.0


@dataclass
class CostCurve:
    """Step seconds against verified rows, fitted over the last ``window`` steps."""

    window: int = COST_WINDOW
    _obs: deque = field(default_factory=deque)

    def observe(self, rows: int, seconds: float) -> None:
        self._obs.append((rows, seconds))
        while len(self._obs) > self.window:
            self._obs.popleft()

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_row)`` seconds, or None while the steps seen cannot tell them apart
        (too few, or all of one row count)."""
        n = len(self._obs)
        if n < MIN_STEPS:
            return None
        xs = [float(r) for r, _ in self._obs]
        ys = [s for _, s in self._obs]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx < 1e-9 * n or sxx / n < 0.25:  # no spread in rows: no slope to read
            return None
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if slope <= 0:  # noise beyond the rows' cost: rows look free, keep every draft
            return None
        fixed = max(my - slope * mx, 0.0)
        return fixed, slope


#: run positions told apart by `Acceptance` (later ones share the last)
RUN_POSITIONS = 8


def run_index(forced: Sequence[bool]) -> list[int]:
    """Per draft, its place in the run of model drafts it belongs to (0: the first model draft
    after the step's start or after a forced token); -1 for a forced draft."""
    out, n = [], 0
    for f in forced:
        if f:
            out.append(-1)
            n = 0
        else:
            out.append(min(n, RUN_POSITIONS - 1))
            n += 1
    return out


@dataclass
class Acceptance:
    """Per run position (`run_index`), the model drafts verification reached and accepted:
    for one request, or the whole engine. A copied value that starts to match tends to go
    on matching, so the chance rises along a run: one rate per position, not one in all."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * RUN_POSITIONS)
    reached: list[float] = field(default_factory=lambda: [0.0] * RUN_POSITIONS)

    def record(self, forced: Sequence[bool], accepted: int) -> None:
        """Of a proposal's drafts (``forced`` per position) the first ``accepted`` were
        accepted: the model drafts up to the first refused one were reached."""
        for j, m in enumerate(run_index(forced)):
            if j > accepted:
                break
            if m >= 0:
                self.reached[m] += 1
                self.accepted[m] += j < accepted

    def rate(self, m: int, prior: Acceptance | None = None) -> float:
        """The chance that a model draft at run position ``m`` is accepted once reached; with
        ``prior`` (the engine-wide counts), its rate at ``m`` stands for ``PRIOR_WEIGHT``
        observations (0.5 where nothing is seen yet)."""
        base = 0.5 if prior is None else prior.rate(m)
        return (self.accepted[m] + PRIOR_WEIGHT * base) / (self.reached[m] + PRIOR_WEIGHT)


def chain_gains(forced: Sequence[bool], mine: Acceptance, prior: Acceptance | None = None) -> list[float]:
    """``P_j`` for each draft of one proposal: the chance that it and every draft before it
    are accepted (a forced draft is, given its prefix; a model draft at its run position's
    rate)."""
    out, p = [], 1.0
    for m in run_index(forced):
        p *= 1.0 if m < 0 else mine.rate(m, prior)
        out.append(p)
    return out


def plan_cuts(gains: Sequence[Sequence[float]], fixed: float, per_row: float) -> list[int]:
    """How many drafts each request keeps (a prefix of its proposal), given each draft's
    gain ``P_j`` (non-increasing along a request) and the step's cost line: the drafts that
    raise the step's expected tokens per second, best first. A gain of 1 is always kept."""
    keep = [0] * len(gains)
    tokens = float(len(gains))  # each request's bonus (or recovered) token
    seconds = fixed + per_row * len(gains)  # each request's first row
    order = sorted(((g, b, j) for b, row in enumerate(gains) for j, g in enumerate(row)),
                   key=lambda t: (-t[0], t[1], t[2]))
    for g, b, j in order:
        if j != keep[b]:  # not the next of its request (an equal gain further on): skip
            continue
        if g < 1.0 and g * seconds <= per_row * tokens:
            break  # this and every later candidate lowers tokens per second
        keep[b] += 1
        tokens += g
        seconds += per_row
    return keep


class DraftBudget:
    """The engine's budget: observes steps and verdicts, cuts proposals (module docstring)."""

    def __init__(self) -> None:
        self.cost = CostCurve()
        self.overall = Acceptance()
        self.cut_rows = 0  # draft rows the budget left out (all steps)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def record(self, mine: Acceptance, forced: Sequence[bool], accepted: int) -> None:
        """A request's verdict: of its drafts (``forced`` per position), the first
        ``accepted`` were accepted."""
        mine.record(forced, accepted)
        self.overall.record(forced, accepted)

    def cuts(self, proposals: Sequence[tuple[Acceptance, Sequence[bool]]]) -> list[int] | None:
        """Drafts to keep per request (``proposals``: its acceptance and which of its drafts
        are forced); None while the cost line is not known (keep everything)."""
        line = self.cost.fit()
        if line is None:
            return None
        gains = [chain_gains(forced, mine, self.overall) for mine, forced in proposals]
        keep = plan_cuts(gains, *line)
        self.cut_rows += sum(len(f) - k for (_, f), k in zip(proposals, keep))
        return keep
