"""Repetition-loop detection on token ids: stop an attempt that can no longer be the answer.

A small model decoding greedily sometimes falls into a loop: ``"0123456789"`` written again and
again inside a string, ``.1.1.1.1`` in a version, the same array item over and over. The grammar
keeps every such output valid so far, so the loop runs until ``max_tokens`` and the whole budget
is spent before a retry can start. :class:`LoopDetector` sees each committed token once and says
when the output has become periodic for long enough that it is almost certainly a loop; the
engine then ends the request with ``finish_reason == "loop"`` (an
:class:`~constrained_spec.errors.IncompleteOutputError` subclass for the user, which
``max_retries`` retries like any incomplete output).

The rule. For every candidate period ``p`` in ``1..MAX_PERIOD`` the detector keeps the length
``r_p`` of the current run of positions ``i`` with ``x[i] == x[i - p]``; the last ``r_p + p``
tokens are then periodic with period ``p`` (the span). A loop is reported when, for some ``p``,
the span covers at least ``MIN_REPEATS`` periods and at least ``MIN_LENGTH`` tokens. Exact
repetition only: a greedy loop is an exact cycle of tokens (the same context gives the same
argmax), while text that merely resembles itself (a list of similar items, counting numbers,
keys that recur in every array item with different values) breaks the run at every difference.

Why these numbers (measured with ``benchmarks/loops.py`` on the embedded model's tokenizer):

- ``MIN_LENGTH = 96`` tokens. Valid data does contain long exact repetition: placeholder hashes
  (64 ``0`` digits, ``0123456789abcdef`` four times), base64 padding, ``1234567890`` test
  strings. Over the 6,715 valid instances of JSONSchemaBench (all splits, compact layout) the
  longest periodic span is 64 tokens in all but one instance (a 162-token ``1234567890-``
  fixture, the only false positive). 96 tokens leave a 50% margin over 64 and still stop a loop
  long before a typical budget (256-512 tokens) runs out.
- ``MIN_REPEATS = 4``: a span must hold the unit four times, so three identical array items in
  a row (plausible, valid) never fire; for periods up to 24 tokens ``MIN_LENGTH`` decides.
- ``MAX_PERIOD = 64`` tokens: an array item of up to ~60 tokens (a small object) repeated is
  still caught (at 4 x 64 = 256 tokens at the most); longer periods would need more than a
  typical budget to show four repeats anyway, and each period costs a compare per token.

Structural loops are stopped sooner. A periodic span that contains a JSON string delimiter
(a token with a ``"`` in it: the span repeats whole values, keys or array items, not characters
inside one string) is reported from ``STRUCTURAL_MIN_LENGTH = 32`` tokens (still at least
``MIN_REPEATS`` periods). Measured the same way (``benchmarks/retries.py --spans``): of the
6,715 valid instances, none holds a structural periodic span of four periods at any length
(checked down to 8 tokens); every long periodic span in valid data is inside one string (the
hashes and fixtures above). 32 tokens is a third of ``MIN_LENGTH`` and makes a short item
(``"a", ``: 3-4 tokens) repeat eight times before it counts. On the benchmark tasks the
embedded model's loops over array items (``".sqlm", ".sqlm", ...``) stop 64 tokens sooner. The
rule applies where quotes delimit values: the caller passes the ids of the tokens that contain
one (JSON outputs and tool calls; none for free text, regexes and choices).

Cost: ``MAX_PERIOD`` integer compares per token, independent of the output length (the engine
runs it once per committed token), a few microseconds per token in Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: Longest repeated unit looked for, in tokens.
MAX_PERIOD = 64
#: Fewest copies of the unit in the periodic span.
MIN_REPEATS = 4
#: Fewest tokens in the periodic span.
MIN_LENGTH = 96
#: Fewest tokens in a periodic span that repeats whole JSON values (contains a quote).
STRUCTURAL_MIN_LENGTH = 32


@dataclass(frozen=True)
class Loop:
    """A detected loop: the output became periodic with ``period`` tokens from token ``start``
    (an offset into the output) and stayed so for ``length`` tokens."""

    period: int
    start: int
    length: int

    @property
    def repeats(self) -> float:
        """How many times the unit was written (``length / period``)."""
        return self.length / self.period


class LoopDetector:
    """Incremental check of the rule in the module docstring over the tokens of one output.

    Parameters
    ----------
    max_period, min_repeats, min_length:
        The rule's numbers (defaults :data:`MAX_PERIOD`, :data:`MIN_REPEATS`,
        :data:`MIN_LENGTH`).
    structural_tokens, structural_min_length:
        The ids of the tokens that delimit values (contain a ``"``; None: no structural rule)
        and the fewest tokens of a periodic span holding one (:data:`STRUCTURAL_MIN_LENGTH`).

    ``push`` / ``extend`` return the :class:`Loop` once it is found (and keep it on ``loop``);
    tokens pushed after that are ignored.
    """

    def __init__(self, *, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
                 min_length: int = MIN_LENGTH,
                 structural_tokens: frozenset[int] | None = None,
                 structural_min_length: int = STRUCTURAL_MIN_LENGTH) -> None:
        if max_period < 1 or min_repeats < 2 or min_length < 2 or structural_min_length < 2:
            raise ValueError("max_period >= 1, min_repeats >= 2 and min_length >= 2 are needed, "
                             f"got {max_period}, {min_repeats}, {min_length}")
        self.max_period = max_period
        self.min_repeats = min_repeats
        self.min_length = min_length
        # run r_p needed to fire for period p: span r_p + p >= max(min_length, min_repeats * p)
        self._need = [0] + [max(min_length, min_repeats * p) - p for p in range(1, max_period + 1)]
        self.structural_tokens = structural_tokens
        self.structural_min_length = structural_min_length
        self._need_structural = [0] + [max(structural_min_length, min_repeats * p) - p
                                       for p in range(1, max_period + 1)]
        self._last_structural = -1  # index of the last token that delimits a value
        self._runs = [0] * (max_period + 1)
        self._tail: list[int] = []  # the last max_period tokens, oldest first
        self.count = 0  # tokens seen
        self.loop: Loop | None = None

    def push(self, token: int) -> Loop | None:
        """Add the next output token; the loop if the output is now looping."""
        if self.loop is not None:
            return self.loop
        tail, runs, need = self._tail, self._runs, self._need
        n = len(tail)
        if self.structural_tokens is not None and token in self.structural_tokens:
            self._last_structural = self.count
        # a span of the last r_p + p tokens holds a delimiter when it starts at or before it
        delimited = self.count - self._last_structural
        need_s = self._need_structural
        found = 0
        for p in range(1, n + 1):
            if tail[n - p] == token:
                runs[p] += 1
                if not found and (runs[p] >= need[p] or (
                        runs[p] >= need_s[p] and runs[p] + p > delimited)):
                    found = p  # the shortest period: the unit itself, not a multiple of it
            else:
                runs[p] = 0
        tail.append(token)
        if n + 1 > self.max_period:
            del tail[0]
        self.count += 1
        if found:
            span = runs[found] + found
            self.loop = Loop(period=found, start=self.count - span, length=span)
        return self.loop

    def extend(self, tokens: Iterable[int]) -> Loop | None:
        """Add several tokens; the loop if one was found (at or before the last of them)."""
        for t in tokens:
            if self.push(t) is not None:
                break
        return self.loop


def find_loop(tokens: Iterable[int], **rule: Any) -> Loop | None:
    """The first loop in a whole token sequence (offline use: benchmarks, tests), or None."""
    return LoopDetector(**rule).extend(tokens)
