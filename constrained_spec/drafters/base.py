"""The drafter interface: how proposals are made, masked and recorded.

A drafter extends a :class:`DraftState` per request. Every draft goes through the state's
:class:`GrammarCursor`, a FORK of the request's matcher: position i of the proposal is masked
by the grammar state after the accepted prefix plus drafts 1..i-1, and the cursor records that
state's bitmask as target mask row i. So one walk yields both the masked drafts and the K+1
mask rows the verifier applies to the target logits. The real matcher is never touched here.

A drafter returns nothing; it appends to ``state.tokens`` (through ``state.push``) and, for
sampled drafts, the distribution q each token was drawn from (``None`` = point mass, q = 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from constrained_spec.generation.timing import StepTimer

T = TypeVar("T")


class GrammarCursor:
    """A throw-away fork of a matcher that records one bitmask row per visited position."""

    masked = True  # a push is checked against the position's mask row first

    def __init__(self, matcher: Any | None, rows: torch.Tensor, timer: StepTimer | None = None, *,
                 note_forced: bool = False) -> None:
        # rows: int32 [max_rows, W], this request's slice of the step's bitmask buffer;
        # timer: the step's, whose "grammar" stage the fork's work is added to
        self._fork = matcher.fork() if matcher is not None else None
        self._rows = rows
        self._filled = -1  # index of the last filled row
        self._pos = 0  # drafts pushed so far
        self._timer = timer
        self.seconds = 0.0  # the fork's CPU time (`_timed`): the request's grammar work
        self.calls = 0  # ... in this many calls
        self._dead = False  # a push was refused: no position beyond this one is valid
        # note_forced: record, per row, whether the grammar forces the continuation there (the
        # repetition guard leaves such rows alone); forced_rows[i] is set when row i is filled
        self._note_forced = note_forced and self._fork is not None
        self.forced_rows: dict[int, bool] = {}
        self._forced_cache: tuple[int, list[int]] | None = None
        if self._fork is None:
            # free text: every row allows everything. Filled now, not lazily: push() never
            # reads a row here, and the verifier masks every row of a batch that mixes free
            # text with schemas (an unfilled row is whatever the buffer held)
            rows.fill_(-1)
            self._filled = rows.shape[0] - 1

    @property
    def constrained(self) -> bool:
        return self._fork is not None

    def row(self) -> torch.Tensor:
        """The mask row (int32 [W]) for the next draft position, filled on first use."""
        if self._filled < self._pos:
            if self._fork is None:
                self._rows[self._pos].fill_(-1)
            else:
                self._timed(self._fork.fill_bitmask, self._rows, self._pos)
                if self._note_forced:
                    self.forced_rows[self._pos] = bool(self.forced_tokens())
            self._filled = self._pos
        return self._rows[self._pos]

    def allows(self, token: int) -> bool:
        if self._fork is None:
            return True
        word = int(self.row()[token >> 5])
        return bool((word >> (token & 31)) & 1)

    def push(self, token: int) -> bool:
        """Advance the fork by ``token``; False (fork unchanged) if the grammar forbids it."""
        if self._dead or self._pos + 1 >= self._rows.shape[0]:
            return False
        if self._fork is not None:
            if not self.allows(token):
                return False
            if not self._timed(self._fork.accept, token):
                # refused where the mask allowed it: the fork is not to be trusted further
                self._dead = self.masked
                return False
            if self._fork.is_terminated():
                # nothing can follow a stop token: no further drafts
                self._dead = True
        self._pos += 1
        return True

    def forced_tokens(self) -> list[int]:
        if self._fork is None:
            return []
        if self._forced_cache is not None and self._forced_cache[0] == self._pos:
            return self._forced_cache[1]
        out = self._timed(self._fork.forced_tokens)
        self._forced_cache = (self._pos, out)
        return out

    def finish(self) -> int:
        """Fill the row after the last draft (the bonus row); returns the number of rows."""
        self.row()
        return self._pos + 1

    @property
    def exhausted(self) -> bool:
        return self._dead

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a call on the fork), its time added to the step's grammar time and
        its CPU time (this thread's: waits for the GIL or a core do not count) to ``seconds``."""
        t0 = time.thread_time()
        self.calls += 1
        try:
            if self._timer is None:
                return fn(*args)
            with self._timer.measure("grammar"):
                return fn(*args)
        finally:
            self.seconds += time.thread_time() - t0


class AcceptCursor(GrammarCursor):
    """A cursor that records no mask rows, for a verifier that fills its own (vLLM's engine):
    a push is checked by the fork's ``accept`` alone (a refused token leaves the fork as it
    was), which is all the forced and n-gram drafters need. Drafters that read a row
    (`DraftState.draft_logits`) cannot run on it."""

    masked = False

    def __init__(self, matcher: Any | None, max_rows: int, timer: StepTimer | None = None) -> None:
        super().__init__(matcher, torch.empty((max_rows, 0), dtype=torch.int32), timer)

    def allows(self, token: int) -> bool:
        return True

    def row(self) -> torch.Tensor:
        raise TypeError("an AcceptCursor records no mask rows: a drafter reading the grammar's "
                        "mask cannot run on it")


@dataclass
class DraftState:
    """One request's proposal under construction for one step."""

    request_id: int
    context: list[int]  # prompt + output so far (the pending token last)
    cursor: GrammarCursor
    params: Any  # SamplingParams
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    num_forced: int = 0
    forced_at: list[int] = field(default_factory=list)  # proposal positions that are forced tokens
    drafter_state: Any = None  # per-request memory a model drafter keeps between steps
    prompt_len: int = 0  # context[prompt_len:] is the output so far
    slot: int = -1  # the request's slot in the target runner (drafters reading its features)

    def push(self, token: int, q: torch.Tensor | None = None) -> bool:
        if not self.cursor.push(token):
            return False
        self.tokens.append(token)
        self.q.append(q)
        return True

    def forced_flags(self) -> list[bool]:
        """Per draft, whether it is a forced token."""
        forced = set(self.forced_at)
        return [j in forced for j in range(len(self.tokens))]

    def cut(self, keep: int) -> int:
        """Keep only the first ``keep`` drafts (their mask rows stay as recorded); returns the
        drafts kept."""
        if keep < len(self.tokens):
            del self.tokens[keep:], self.q[keep:]
            self.forced_at = [j for j in self.forced_at if j < keep]
            self.num_forced = len(self.forced_at)
        return len(self.tokens)

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What a SAMPLING drafter draws its next draft from: its raw logits (float [V]) masked
        by the grammar at this position, then the repetition guard and temperature / top-k /
        top-p: the processing the verifier applies to the target's row there. q is
        ``sampling.probs_from_logits`` of the result (pass it to :meth:`push`); greedy requests
        take its argmax and push a point mass (q = None)."""
        from constrained_spec.generation.sampling import apply_repetition_guard, process_logits
        from constrained_spec.kernels import apply_bitmask

        out = logits.float().clone()[None]  # [1, V]
        row = self.cursor.row()
        if self.cursor.constrained:
            apply_bitmask(out, row[None].to(out.device))
        prm = self.params
        if prm.guarded:
            history = self.context[self.prompt_len:] + self.tokens
            exempt = [self.cursor.forced_rows.get(len(self.tokens), False)]
            out = apply_repetition_guard(out, [history], [len(history)], [prm], [exempt])
        out = process_logits(out, torch.tensor([float(prm.temperature)], device=out.device),
                             torch.tensor([prm.top_k], device=out.device),
                             torch.tensor([float(prm.top_p)], device=out.device))
        return out[0]

    def choose(self, logits: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
        """A model drafter's draft for the next position from its raw target-width ``logits``
        and its q (None = point mass): the argmax of `draft_logits` for greedy requests, a draw
        from it with the request's generator otherwise; (None, None) when nothing is allowed."""
        from constrained_spec.generation.sampling import probs_from_logits

        x = self.draft_logits(logits)  # [V]: masked, guarded, temperature / top-k / top-p
        if self.params.greedy:
            if not bool(torch.isfinite(x).any()):
                return None, None
            return int(x.argmax()), None
        q = probs_from_logits(x[None])[0].cpu()  # the row the draft is drawn from
        if not float(q.sum()) > 0:
            return None, None
        return int(torch.multinomial(q, 1, generator=self.generator)), q


@dataclass(eq=False)
class DrafterSeq:
    """What a model drafter keeps for one request between steps (``DraftState.drafter_state``):
    its cache slot, and the proposal it last extended with that proposal's length then (a
    later round in the same step drafts again only after forced tokens were pushed)."""

    slot: int
    last_state: DraftState | None = field(default=None, repr=False)
    last_len: int = 0


SeqT = TypeVar("SeqT", bound=DrafterSeq)


def seq_to_extend(st: DraftState, kind: type[SeqT], new_slot: Callable[[], int]) -> SeqT | None:
    """``st``'s drafter memory of type ``kind`` (a new one on a fresh slot when it has none or a
    freed one), or None when nothing was pushed to ``st`` since this drafter's last round in
    this step (so there is nothing to draft after)."""
    seq = st.drafter_state
    if not isinstance(seq, kind) or seq.slot < 0:
        seq = kind(new_slot())
        st.drafter_state = seq
    if seq.last_state is st and seq.last_len == len(st.tokens):
        return None
    return seq


@runtime_checkable
class Drafter(Protocol):
    """A plug-in that proposes up to ``k`` drafts per request, continuing after forced ones.

    Subclass it (``class MyDrafter(Drafter)``) to inherit the defaults of `resumable` and
    `release`, or define all four members yourself.
    """

    name: str
    # True when it can continue any proposal: the engine then alternates it with forced
    # tokens within a step (a copied value, the forced key after it, the next copied value)
    resumable: bool = False

    def propose(self, states: Sequence[DraftState], k: int) -> None:
        """Extend each state's proposal by up to ``k`` drafts (``DraftState.push``)."""
        ...

    def release(self, drafter_state: Any) -> None:
        """Free what the drafter kept for a request that finished: the value it left in
        ``DraftState.drafter_state`` (the engine keeps it on the request between steps and
        calls this when it reaps the request). Keeps nothing by default."""
        return None


# padded tokens per catch-up forward of a model drafter (activation memory)
CATCH_UP_TOKENS = 4096


def length_groups(lengths: Sequence[int], max_tokens: int = CATCH_UP_TOKENS) -> list[list[int]]:
    """Indices of ``lengths`` grouped for padded batched forwards: shortest first, a group
    taking items up to about twice (+8) its first length (padding a 2-token catch-up to a
    prompt wastes compute) and at most ``max_tokens`` padded tokens."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        L = lengths[i]
        if out and L <= 2 * lengths[out[-1][0]] + 8 and (len(out[-1]) + 1) * L <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def fit_width(logits: torch.Tensor, width: int) -> torch.Tensor:
    """A [V'] row of draft logits cut or padded (-inf) to the target's logits ``width`` (the
    two may differ by padding rows beyond the tokenizer)."""
    if logits.shape[-1] > width:
        return logits[:width]
    if logits.shape[-1] < width:
        return torch.cat([logits, logits.new_full((width - logits.shape[-1],), float("-inf"))])
    return logits
