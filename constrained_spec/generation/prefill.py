"""Prompts read a chunk per step, in the same forward as the running requests' decode rows.

Without it, admitting a request prefills its whole prompt before the next step, and every
running request waits that long for its next token (a 300-token prompt is most of a second
on two AVX2 cores). On a row-invariant runner (`LeanRunner.row_invariant`) a prompt row has
the same bits in a step's forward, beside decode and verify rows, as in a forward of its own
(the runner's module docstring), so the engine instead admits a request with the longest
cached prefix of its prompt restored (`model.prefix_cache`) and feeds the rest, at most
`CHUNK_TOKENS` prompt rows per step over all such requests (oldest first), as rows without
logits in the step's one forward. A request decodes from the step after its last prompt row.
Outputs do not change (tested); what changes is when tokens arrive: running requests go on
committing while a prompt is read, in steps longer by the chunk's rows, and a new request's
first token comes after ``ceil(rest / CHUNK_TOKENS)`` steps at most, sooner when it is alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: prompt rows a step may carry, over all requests still reading their prompt
CHUNK_TOKENS = 64


class PrefillQueue:
    """The admitted requests whose prompt is not all in the runner's cache yet."""

    def __init__(self, runner: Any, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.runner = runner
        self.chunk_tokens = chunk_tokens
        self._left: dict[int, tuple[Any, list[int]]] = {}  # id(request) -> (request, prompt rows left)

    def __len__(self) -> int:
        return len(self._left)

    def holds(self, req: Any) -> bool:
        """Whether ``req`` is still reading its prompt (it does not decode this step)."""
        return id(req) in self._left

    def admit(self, reqs: Sequence[Any]) -> None:
        """Queue fresh requests (each with an empty slot): their cached prefix restored now,
        the rest of ``prompt_ids[:-1]`` left for the steps. Raises ValueError (before touching
        any slot) for a prompt longer than the runner's context."""
        for r in reqs:
            if len(r.prompt_ids) > self.runner.max_context:
                raise ValueError(f"the prompt has {len(r.prompt_ids)} tokens, more than the model's "
                                 f"context of {self.runner.max_context}")
        for r in reqs:
            prompt = r.prompt_ids[:-1]
            n = self.runner.prefiller.start(r.slot, prompt)
            r.stats.cached_prompt_tokens = n
            r.stats.prompt_tokens = len(r.prompt_ids)
            if n < len(prompt):
                self._left[id(r)] = (r, list(prompt[n:]))

    def take(self) -> list[tuple[Any, list[int]]]:
        """This step's prompt rows: ``(request, rows)``, oldest request first, at most
        `chunk_tokens` rows in all. Finished (cancelled) requests leave the queue here."""
        for key, (r, _) in list(self._left.items()):
            if r.finished:
                del self._left[key]
        out, budget = [], self.chunk_tokens
        for r, rows in self._left.values():
            if budget <= 0:
                break
            out.append((r, rows[:budget]))
            budget -= len(out[-1][1])
        return out

    def advance(self, taken: Sequence[tuple[Any, list[int]]]) -> None:
        """The runner holds ``taken``'s rows now; a request whose prompt is complete leaves the
        queue (its whole blocks go to the prefix cache)."""
        for r, rows in taken:
            key = id(r)
            _, left = self._left[key]
            del left[: len(rows)]
            if not left:
                del self._left[key]
                self.runner.prefiller.finish(r.slot, r.prompt_ids[:-1])

    def drop(self, req: Any) -> None:
        self._left.pop(id(req), None)
