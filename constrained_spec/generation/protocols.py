"""The contract between the request frontend and an engine: what `api.Generator` and the
serving loop (`serving.EngineLoop`) call on the thing that runs requests.

An engine takes `engine.Request` objects (prompt ids, a grammar matcher or None, sampling
params, eos ids), runs them in batches, and finishes each with its output ids, a finish reason
and its `SpecStats` (or a typed error). `engine.Engine` is ours; another engine implements the
same four calls (docs/extending.md, "Add an engine").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from constrained_spec.generation.engine import Request


@runtime_checkable
class BatchEngine(Protocol):
    """Runs requests in batches; requests join (`admit`) and leave (`reap`) between steps."""

    running: list[Request]  # admitted and not yet reaped, finished or not

    def admit(self, reqs: Sequence[Request]) -> list[Request]:
        """Start ``reqs`` (one batched prefill where it can); returns those that could not be
        admitted (each finished with its typed error, holding nothing)."""
        ...

    def safe_step(self) -> bool:
        """One step for every running request; a fault ends the requests it belongs to, never
        the caller. Returns whether a shared stage of the step failed."""
        ...

    def reap(self) -> None:
        """Drop the finished requests from ``running`` and free what they held."""
        ...

    def run(self, requests: Iterable[Request]) -> list[Request]:
        """Admit and step until every request has finished; returns them, finished."""
        ...
