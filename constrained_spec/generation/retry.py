"""Resumed retries: a retry that keeps the good part of a failed attempt and its cache.

A failed attempt that ran out of ``max_tokens`` or was stopped by the loop detector
(``finish_reason`` in :data:`~constrained_spec.generation.engine.RESUMABLE`) wrote a
grammar-valid prefix that is wrong only from some point on. A from-start retry (``retry_from=
"start"``) throws all of it away, prefills the prompt again and writes the whole output again.
A resumed retry (``retry_from="resume"``) instead:

1. cuts the failed output at a *resume point* (:func:`resume_point`);
2. starts the retry with that prefix as its output so far: a fresh grammar matcher replayed
   over the prefix (every prefix of accepted tokens is accepted again, token for token), the
   loop detector fed the prefix, and the failed attempt's cache slot, cut to
   ``prompt + prefix[:-1]`` (the engine's cache invariant), so nothing is prefilled again;
3. samples the rest like any retry (the retry's seed and temperature). ``max_tokens`` bounds
   the whole output, kept prefix included: what a caller sizes it for (and what the prompt
   check reserves room for) is the length of the output returned.

What a resumed retry samples from: the model's distribution of the continuation given the
prompt and the kept prefix, at the retry's temperature, under the grammar -- the same
distribution a from-start retry would reach at that point had it sampled the same prefix.

The resume point (why there):

- a **loop** (loops.py): the output became periodic from ``loop.start``. For JSON the output
  is cut before the token that opened the value the loop began in (the innermost string, or
  else array, open at ``loop.start``): a loop usually starts a little after the value went
  wrong (``"Aeropus_Aeropus_..."``, an array of one item copied), so that value is written
  again; outside JSON, or with no string or array open there, at ``loop.start``.
- **max_tokens** (``"length"``): for JSON, the output is cut before the token that opened the
  innermost string still open at the end (a string that never closed ran away), or, when no
  string is open, the innermost open array (an array that kept growing); the retry writes that
  value again. With nothing to point at (no JSON, a reasoning model's output) the retry starts
  from the beginning of the output, still without a second prefill.
- a resumed retry that **fails again** shows that its kept prefix leads nowhere: the next
  retry starts the output from the beginning (still on the prompt's cache).

Any token boundary is grammar-safe (the matcher is replayed over the kept tokens), so the cut
only chooses what is written again. Measured against today's retries in
``benchmarks/retries.py`` (docs/quality.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from constrained_spec.generation.engine import RESUMABLE, Request
from constrained_spec.generation.loops import LoopDetector

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = {ord("["): "[", ord("{"): "{"}
_CLOSE = (ord("]"), ord("}"))


def quote_tokens(decoded: Sequence[bytes]) -> frozenset[int]:
    """The ids of the tokens whose bytes hold a ``"`` (``decoded``: token id -> bytes): where a
    JSON output crosses from one value to the next, for the loop detector's structural rule."""
    return frozenset(i for i, b in enumerate(decoded) if _QUOTE in b)


def can_resume(req: Request) -> bool:
    """Whether a retry can resume from ``req``: it ended unfinished (not in an error) and its
    slot, with the cache, was kept for the retry."""
    return req.finish_reason in RESUMABLE and req.keep_slot and req.slot >= 0


def open_value_start(token_ids: Sequence[int], decoded: Sequence[bytes]) -> int | None:
    """The index of the token that opened the innermost JSON string still open at the end of
    ``token_ids``, or else of the innermost open array; None when neither is open.

    ``decoded``: token id -> the bytes it decodes to (``TokenizerData.decoded``). A byte-level
    scan: the bytes that delimit JSON (quote, backslash, brackets) never occur inside a
    multi-byte UTF-8 character."""
    stack: list[tuple[str, int]] = []  # open arrays / objects: (kind, token index)
    string_at: int | None = None  # token index of the open string's quote
    escaped = False
    for i, tok in enumerate(token_ids):
        piece = decoded[tok] if 0 <= tok < len(decoded) else b""
        for byte in piece:
            if string_at is not None:
                if escaped:
                    escaped = False
                elif byte == _BACKSLASH:
                    escaped = True
                elif byte == _QUOTE:
                    string_at = None
            elif byte == _QUOTE:
                string_at = i
            elif byte in _OPEN:
                stack.append((_OPEN[byte], i))
            elif byte in _CLOSE and stack:
                stack.pop()
    if string_at is not None:
        return string_at
    arrays = [i for kind, i in stack if kind == "["]
    return arrays[-1] if arrays else None


def resume_point(req: Request, decoded: Sequence[bytes] | None, *, resumed: bool = False) -> int:
    """How many of ``req``'s output tokens a resumed retry keeps (see the module docstring);
    ``decoded`` None: the output is not JSON; ``resumed``: ``req`` was itself a resumed retry
    that failed again (its kept prefix did not lead anywhere: start the output again)."""
    if resumed:
        return 0
    out = req.output_ids
    end = len(out)
    if req.finish_reason == "loop" and req.loops is not None and req.loops.loop is not None:
        end = req.loops.loop.start
        if decoded is None:
            return end
    elif decoded is None:
        return 0
    start = open_value_start(out[:end], decoded)
    if start is None:
        return end if end < len(out) else 0
    return start


def resume(retry: Request, failed: Request, keep: int) -> None:
    """Turn ``retry`` (a fresh request for the retry: its own matcher, sampling and seed) into
    one that continues ``failed``'s first ``keep`` output tokens from ``failed``'s cache slot,
    which moves to ``retry`` (the engine cuts it to ``prompt + prefix[:-1]`` on admission).

    The prompt must be the same token for token (the cache holds it)."""
    if retry.prompt_ids != failed.prompt_ids:
        raise ValueError("a resumed retry needs the failed attempt's prompt, token for token")
    if not 0 <= keep <= len(failed.output_ids):
        raise ValueError(f"cannot keep {keep} of {len(failed.output_ids)} output tokens")
    prefix = failed.output_ids[:keep]
    if retry.matcher is not None:
        for tok in prefix:
            if not retry.matcher.accept(tok):  # the same grammar accepted it before
                raise ValueError(f"token {tok} of the kept prefix is refused by the retry's grammar")
    if retry.loops is not None:
        retry.loops = LoopDetector(max_period=retry.loops.max_period,
                                   min_repeats=retry.loops.min_repeats,
                                   min_length=retry.loops.min_length,
                                   structural_tokens=retry.loops.structural_tokens,
                                   structural_min_length=retry.loops.structural_min_length)
        retry.loops.extend(prefix)
    retry.output_ids = list(prefix)
    if retry.params.logprobs is not None:  # the kept tokens' values: the same positions
        retry.logprobs = list(failed.logprobs[:keep])
    retry.resumed = True
    retry.slot, failed.slot = failed.slot, -1
