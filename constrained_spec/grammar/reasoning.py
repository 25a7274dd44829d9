"""A matcher for reasoning models: free text until the end-of-reasoning marker, then the grammar.

`ReasoningMatcher` wraps the request's grammar matcher (or free text) and walks four phases:

``opening``
    The start marker (``<think>``) is forced token by token, unless the prompt already ends
    with it (templates that open the block themselves) or already closed the block.
``thinking``
    Free text: every ordinary token of the vocabulary is allowed (the marker tokens too); stop
    tokens and other special tokens are not, so a request cannot end before it answers.
``closing``
    The rest of the end marker is forced token by token: entered when ``max_reasoning_tokens``
    thinking tokens are spent.
``answer``
    Everything goes to the inner matcher (a fresh one, built when the answer starts); with no
    inner matcher the answer is free text that ends at a stop token.

When the reasoning ends. After a token is accepted in ``thinking``, the block is closed when
either (a) the last accepted ids are the canonical tokenization of the end marker (this also
catches a marker that is one special token decoding to no text), or (b) the decoded thinking
bytes end with the end marker's text, however the model spelled it across tokens. The answer
always starts at a token boundary: a token that would complete the marker text and go on past
it (``"k>{"`` after ``"</thin"``) is masked in ``thinking``, so no marker is ever missed
and no answer byte hides inside a reasoning token. A KMP automaton over the marker bytes tracks
the partial match; the masked tokens per automaton state are computed once per tokenizer and
marker.

Speculation needs nothing special: the engine forks the matcher per draft position, so in one
draft window the positions up to the marker get the free ``thinking`` row and the positions
after it the grammar's rows. Rollback crosses the boundary through a persistent history (an
immutable linked list, so `fork` is O(1)): rolling the marker back drops the inner matcher.

`forced_tokens` returns the forced marker tokens in ``opening`` and ``closing`` (the forced
drafter then drafts them, and the grammar's own forced tokens after them, in one step) and, in
``thinking``, the rest of the canonical end marker once its first tokens were emitted: a
point-mass draft like any other there (nothing is masked), which verification accepts or not.
Like every position with forced tokens, that one is left alone by the opt-in repetition guard.

No stop token while thinking (a decision, not a necessity): a request with a grammar must
reach its answer, and without one an output that stopped inside its reasoning would have no
answer to return; a model that wants to stop keeps thinking until the end marker (or the
budget) comes instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .matcher import Matcher, check_bitmask_row
from .tokenizer import TokenizerData

__all__ = ["ReasoningMatcher", "ReasoningTables"]

OPENING, THINKING, CLOSING, ANSWER = "opening", "thinking", "closing", "answer"


def _kmp_table(pattern: bytes) -> list[int]:
    """fail[j]: length of the longest proper border of pattern[:j] (j = 0..len)."""
    fail = [0] * (len(pattern) + 1)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i + 1] = k
    return fail


class ReasoningTables:
    """Per tokenizer and marker, shared by every matcher: the KMP automaton over the end
    marker's bytes and the ``thinking`` / free-answer mask rows (built on first use).

    Parameters
    ----------
    tok:
        The tokenizer facts the inner grammar was compiled for.
    start_ids, end_ids:
        The canonical tokenizations of the start and end markers (non-empty).
    end_text:
        The end marker's bytes, matched on the decoded thinking text (empty: ids only).
    start_text:
        The start marker's bytes (to strip it from the reasoning text; default: its tokens').
    match_text:
        Whether the marker's text closes the block however it is spelled (rule (b) of the
        module docstring, and tokens running past it are masked). False: only the canonical
        ids close it (rule (a)); the text is kept for display. An engine that compiles the
        whole output as a token-level grammar (vLLM's, `generation.vllm_engine`) needs this:
        a byte-level rule cannot be written there.
    """

    def __init__(self, tok: TokenizerData, start_ids: Sequence[int], end_ids: Sequence[int],
                 end_text: bytes, start_text: bytes | None = None, *,
                 match_text: bool = True) -> None:
        if not start_ids or not end_ids:
            raise ValueError("the reasoning markers must tokenize to at least one token each")
        for i in (*start_ids, *end_ids):
            if not 0 <= i < tok.vocab_size or i in tok.eos_token_ids:
                raise ValueError(f"marker token {i} is a stop token or not in the vocabulary")
        self.tok = tok
        self.vocab_size = tok.vocab_size
        self.words = (tok.vocab_size + 31) // 32
        self.stops = frozenset(tok.eos_token_ids)
        self.start_ids = tuple(int(i) for i in start_ids)
        self.end_ids = tuple(int(i) for i in end_ids)
        self.end_text = bytes(end_text)
        self.match_text = match_text
        self.start_text = (b"".join(tok.decoded[i] for i in self.start_ids)
                           if start_text is None else bytes(start_text))
        self._fail = _kmp_table(self.end_text)
        self._rows: dict[int, torch.Tensor] = {}
        self._answer_row: torch.Tensor | None = None
        self._scanned: tuple[list[int], dict[int, list[tuple[int, bytes]]]] | None = None

    # -- the KMP automaton ----------------------------------------------------------------
    def advance(self, state: int, data: bytes) -> tuple[int, bool]:
        """Feed ``data`` from partial-match ``state``: (new state, whether the last byte
        completed the marker)."""
        pat, fail, m = self.end_text, self._fail, len(self.end_text)
        if not m or not self.match_text:
            return 0, False
        done = False
        for byte in data:
            while state and (state == m or pat[state] != byte):
                state = fail[state]
            if pat[state] == byte:
                state += 1
            done = state == m
        return state, done

    # -- mask rows ------------------------------------------------------------------------
    def _base_bits(self) -> np.ndarray:
        """Every ordinary text token and the marker tokens (bool [words * 32])."""
        def build() -> np.ndarray:
            bits = np.zeros(self.words * 32, dtype=bool)
            for ids in self.tok.text_tokens().values():
                bits[ids] = True
            return bits
        bits = self.tok.derived("reasoning_text_bits", build).copy()
        bits[list(self.start_ids + self.end_ids)] = True
        return bits

    def thinking_row(self, state: int) -> torch.Tensor:
        """The ``thinking`` mask row at partial-match ``state`` (int32 [words], cached)."""
        row = self._rows.get(state)
        if row is None:
            bits = self._base_bits()
            bits[self._overrunning(state)] = False
            row = _pack(bits)
            self._rows[state] = row
        return row

    def _overrunning(self, state: int) -> list[int]:
        """Tokens that would complete the marker text and go on past it from ``state``: the
        marker lies inside the token and ends before its last byte, or the token starts with
        the tail of the marker that a partial match before it (``state`` or one of its KMP
        borders) needs, and is longer than that tail. Exact: KMP's border chain of ``state``
        is the set of every marker prefix the text before the token ends with."""
        marker = self.end_text
        if not marker or not self.match_text:
            return []
        inside, by_first = self._scan()
        out = set(inside)
        k = state
        while k:
            tail = marker[k:]
            if tail:  # k == len(marker): the match is complete, nothing left to run past
                out.update(t for t, b in by_first.get(tail[0], ())
                           if len(b) > len(tail) and b.startswith(tail))
            k = self._fail[k]
        return sorted(out)

    def _scan(self) -> tuple[list[int], dict[int, list[tuple[int, bytes]]]]:
        """One pass over the vocabulary (cached): the tokens holding the whole marker before
        their last byte, and the multi-byte tokens by first byte (those a tail can start)."""
        if self._scanned is None:
            marker, m = self.end_text, len(self.end_text)
            heads = set(marker)
            inside: list[int] = []
            by_first: dict[int, list[tuple[int, bytes]]] = {}
            for t, b in enumerate(self.tok.decoded):
                if len(b) < 2 or t in self.end_ids:
                    continue
                i = b.find(marker)
                if 0 <= i and i + m < len(b):
                    inside.append(t)
                if b[0] in heads:
                    by_first.setdefault(b[0], []).append((t, b))
            self._scanned = (inside, by_first)
        return self._scanned

    def answer_row(self) -> torch.Tensor:
        """The free-text answer row: ordinary tokens and stop tokens (int32 [words])."""
        if self._answer_row is None:
            bits = self._base_bits()
            bits[list(self.stops)] = True
            self._answer_row = _pack(bits)
        return self._answer_row


def _pack(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


class _State(NamedTuple):
    phase: str
    kmp: int  # partial match of the end marker's bytes (thinking)
    ids: int  # canonical marker ids matched at the end: start ids (opening), end ids otherwise
    thought: int  # thinking tokens accepted (the budget counts these)
    pos: int  # tokens accepted in all
    answer_start: int  # pos where the answer began (-1: not yet)
    terminated: bool  # a free-text answer accepted a stop token


class ReasoningMatcher(Matcher):
    """`Matcher` of a reasoning model's output: think freely, then the inner grammar.

    Parameters
    ----------
    tables:
        The shared :class:`ReasoningTables` of the tokenizer and markers.
    new_inner:
        Builds the inner matcher when the answer starts (``CompiledSpec.new_matcher``), or
        None for a free-text answer.
    max_reasoning_tokens:
        Thinking tokens before the end marker is forced (None: no budget).
    phase:
        Where the output starts: ``"opening"`` (the start marker is forced first),
        ``"thinking"`` (the prompt opened the block) or ``"answer"`` (the prompt closed it).
    source:
        What ``new_inner`` builds matchers from (the ``CompiledSpec``), for an engine that
        compiles the whole output as one grammar (`generation.vllm_engine`); None: free text
        or not known.
    """

    __slots__ = ("_t", "vocab_size", "_new_inner", "_budget", "_s", "_inner", "_history",
                 "_start_phase", "source")
    _s: _State
    _inner: Matcher | None
    # (state before the token, whether the inner matcher took it, rest), newest first
    _history: tuple | None

    def __init__(self, tables: ReasoningTables, new_inner: Callable[[], Matcher] | None, *,
                 max_reasoning_tokens: int | None = None, phase: str = OPENING,
                 source: Any = None, _copy: tuple[Any, Any, Any] | None = None) -> None:
        if phase not in (OPENING, THINKING, ANSWER):
            raise ValueError(f"a reasoning matcher starts in opening, thinking or answer, "
                             f"not {phase!r}")
        self._t = tables
        self.vocab_size = tables.vocab_size
        self._new_inner = new_inner
        self._budget = max_reasoning_tokens
        self._start_phase = phase
        self.source = source
        if _copy is not None:
            self._s, self._inner, self._history = _copy
            return
        self._s = _State(phase, 0, 0, 0, 0, 0 if phase == ANSWER else -1, False)
        self._inner = None
        self._history = None
        if phase == ANSWER:
            self._inner = new_inner() if new_inner is not None else None
        elif phase == THINKING:
            self._s = self._maybe_close(self._s)

    # -- what the engine and the API read --------------------------------------------------
    @property
    def phase(self) -> str:
        """``"opening"``, ``"thinking"``, ``"closing"`` or ``"answer"``."""
        return self._s.phase

    @property
    def answer_start(self) -> int | None:
        """The number of output tokens before the answer (the reasoning and its markers);
        None while the answer has not started."""
        return None if self._s.answer_start < 0 else self._s.answer_start

    @property
    def markers(self) -> tuple[str, str]:
        """The start and end markers' text."""
        return (self._t.start_text.decode("utf-8", errors="replace"),
                self._t.end_text.decode("utf-8", errors="replace"))

    @property
    def tables(self) -> ReasoningTables:
        """The shared tables (markers' ids, the tokenizer facts)."""
        return self._t

    @property
    def budget(self) -> int | None:
        """``max_reasoning_tokens`` (None: no budget)."""
        return self._budget

    @property
    def start_phase(self) -> str:
        """The phase the output started in (``"opening"``, ``"thinking"`` or ``"answer"``)."""
        return self._start_phase

    @property
    def started(self) -> bool:
        """Whether any token was accepted (and not rolled back)."""
        return self._s.pos > 0

    @property
    def reasoning_tokens(self) -> int:
        """Thinking tokens accepted so far (markers not counted)."""
        return self._s.thought

    # -- Matcher --------------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        s = self._s
        if s.phase == ANSWER:
            if self._inner is not None:
                self._inner.fill_bitmask(bitmask, row)
                return
            check_bitmask_row(bitmask, row, self._t.words)
            if s.terminated:
                bitmask[row].zero_()
            else:
                bitmask[row].copy_(self._t.answer_row())
            return
        check_bitmask_row(bitmask, row, self._t.words)
        if s.phase == THINKING:
            bitmask[row].copy_(self._t.thinking_row(s.kmp))
            return
        bitmask[row].zero_()
        tok = self._next_forced(s)
        bitmask[row, tok >> 5] = _bit(tok)

    def accept(self, token_id: int) -> bool:
        s = self._s
        if not 0 <= token_id < self.vocab_size:
            return False
        if s.phase == ANSWER:
            if self._inner is not None:
                if not self._inner.accept(token_id):
                    return False
                self._push(s, True)
                self._s = s._replace(pos=s.pos + 1)
                return True
            if s.terminated or not self._allowed(self._t.answer_row(), token_id):
                return False
            self._push(s, False)
            self._s = s._replace(pos=s.pos + 1, terminated=token_id in self._t.stops)
            return True
        if s.phase != THINKING:
            if token_id != self._next_forced(s):
                return False
            self._push(s, False)
            self._s = self._after_forced(s)
            return True
        if not self._allowed(self._t.thinking_row(s.kmp), token_id):
            return False
        self._push(s, False)
        kmp, text_done = self._t.advance(s.kmp, self._t.tok.decoded[token_id])
        ids = self._match_ids(s.ids, token_id, self._t.end_ids)
        nxt = s._replace(kmp=kmp, ids=ids, thought=s.thought + 1, pos=s.pos + 1)
        if text_done or ids == len(self._t.end_ids):
            nxt = self._answer(nxt)
        else:
            nxt = self._maybe_close(nxt)
        self._s = nxt
        return True

    def rollback(self, n: int) -> None:
        inner_steps = 0
        for _ in range(int(n)):
            if self._history is None:
                raise ValueError("cannot roll back past the start of the output")
            before, by_inner, self._history = self._history
            inner_steps += by_inner
            if before.phase != ANSWER and self._s.phase == ANSWER:
                inner_steps = 0  # the whole answer is undone: the inner matcher goes with it
                self._inner = None
            self._s = before
        if inner_steps and self._inner is not None:
            self._inner.rollback(inner_steps)

    def fork(self) -> "ReasoningMatcher":
        inner = self._inner.fork() if self._inner is not None else None
        twin = ReasoningMatcher(self._t, self._new_inner, max_reasoning_tokens=self._budget,
                                source=self.source, _copy=(self._s, inner, self._history))
        twin._start_phase = self._start_phase
        return twin

    def forced_tokens(self) -> list[int]:
        s = self._s
        if s.phase == ANSWER:
            return self._inner.forced_tokens() if self._inner is not None else []
        if s.phase == OPENING:
            return list(self._t.start_ids[s.ids:]) + list(self._t.end_ids) * (self._budget == 0)
        # closing: the rest of the marker is forced; thinking: once the marker's first tokens
        # are out, the rest of it is the likely continuation (a draft; nothing is masked)
        return list(self._t.end_ids[s.ids:]) if s.ids or s.phase == CLOSING else []

    def is_terminated(self) -> bool:
        s = self._s
        if s.phase != ANSWER:
            return False
        return self._inner.is_terminated() if self._inner is not None else s.terminated

    def is_completed(self) -> bool:
        s = self._s
        if s.phase != ANSWER:
            return False
        return self._inner.is_completed() if self._inner is not None else True

    def must_stop(self) -> bool:
        s = self._s
        if s.phase != ANSWER:
            return False
        return self._inner.must_stop() if self._inner is not None else s.terminated

    def accepts_text(self, text: str) -> bool:
        """In the answer: the inner matcher's rule. Before it: the text must hold the end
        marker (the reasoning ends at its first occurrence) and the rest must be a complete
        answer (a forced start marker is not checked)."""
        if self._s.phase == ANSWER:
            if self._inner is None:
                return not self._s.terminated or text == ""
            return self._inner.accepts_text(text)
        marker = self._t.end_text.decode("utf-8", errors="replace")
        if not marker or marker not in text:
            return False
        rest = text.split(marker, 1)[1]
        if self._new_inner is None:
            return True
        return self._new_inner().accepts_text(rest)

    # -- internals ------------------------------------------------------------------------
    def _push(self, before: _State, by_inner: bool) -> None:
        self._history = (before, by_inner, self._history)

    @staticmethod
    def _allowed(row: torch.Tensor, token_id: int) -> bool:
        return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)

    @staticmethod
    def _match_ids(matched: int, token_id: int, marker: tuple[int, ...]) -> int:
        """Canonical marker ids matched at the end after ``token_id`` (markers are short and
        rarely self-overlapping: a restart at their first id is enough)."""
        if matched < len(marker) and marker[matched] == token_id:
            return matched + 1
        return 1 if marker[0] == token_id else 0

    def _next_forced(self, s: _State) -> int:
        return self._t.start_ids[s.ids] if s.phase == OPENING else self._t.end_ids[s.ids]

    def _after_forced(self, s: _State) -> _State:
        """The state after accepting the forced token of ``opening`` / ``closing``."""
        if s.phase == OPENING:
            if s.ids + 1 < len(self._t.start_ids):
                return s._replace(ids=s.ids + 1, pos=s.pos + 1)
            return self._maybe_close(s._replace(phase=THINKING, ids=0, kmp=0, pos=s.pos + 1))
        if s.ids + 1 < len(self._t.end_ids):
            return s._replace(ids=s.ids + 1, pos=s.pos + 1)
        return self._answer(s._replace(pos=s.pos + 1))

    def _maybe_close(self, s: _State) -> _State:
        """``thinking`` turns into ``closing`` once the budget is spent (the marker ids
        already emitted count: a budget met mid-marker finishes that marker)."""
        if self._budget is not None and s.phase == THINKING and s.thought >= self._budget:
            return s._replace(phase=CLOSING, ids=s.ids if s.ids < len(self._t.end_ids) else 0)
        return s

    def _answer(self, s: _State) -> _State:
        self._inner = self._new_inner() if self._new_inner is not None else None
        return s._replace(phase=ANSWER, ids=0, kmp=0, answer_start=s.pos)


def _bit(tok: int) -> int:
    """The int32 word value with bit ``tok % 32`` set (bit 31 is the sign bit)."""
    b = tok & 31
    return -(1 << 31) if b == 31 else 1 << b
