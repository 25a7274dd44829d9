"""Per-request grammar state: fill bitmask, accept, rollback, fork, forced (jump-forward) tokens.

One `Matcher` per request (and throw-away forks of it for speculative drafts). The engine knows
nothing about the backend behind it:

* `XGrammarMatcher` wraps ``xgrammar.GrammarMatcher`` (a pushdown automaton with an adaptive
  token-mask cache; fork, rollback and jump-forward are native).
* `OutlinesMatcher` walks an outlines-core ``Index`` (a token-level DFA) itself: the state is one
  integer and the history an immutable linked list, so fork is O(1). outlines' ``Guide`` is not
  used: it can neither be forked nor positioned at a state. Masks are built once per DFA state
  and cached on the compiled spec (`_OutlinesTables`); filling a row is a memcpy.

Bitmask layout (shared with xgrammar, outlines-core and kernels/): int32 ``[rows,
ceil(vocab_size / 32)]`` on the CPU, bit j of word w allows token ``32 * w + j``. Stop tokens are
allowed exactly when the grammar can end here; padded ids (past the tokenizer) never are.
"""

from __future__ import annotations

import abc
import threading
from typing import Any

import numpy as np
import torch

__all__ = ["Matcher", "XGrammarMatcher", "OutlinesMatcher"]

# forced_tokens never returns more than this (a guard, not a real limit: grammars end).
MAX_FORCED_TOKENS = 4096


class Matcher(abc.ABC):
    """Grammar state of one request (see the module docstring for the bitmask layout)."""

    vocab_size: int

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU)."""

    @abc.abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed. Accepting a
        stop token terminates the matcher."""

    @abc.abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a stop token counts as one)."""

    @abc.abstractmethod
    def fork(self) -> "Matcher":
        """An independent copy of the current state (for drafting ahead)."""

    @abc.abstractmethod
    def forced_tokens(self) -> list[int]:
        """Token ids of the continuation the grammar forces from here; [] if none. Never stop
        tokens; the state is not changed."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """A stop token was accepted."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """The grammar could end here (a stop token is allowed)."""

    @abc.abstractmethod
    def must_stop(self) -> bool:
        """Completed and nothing but a stop token is allowed (or already terminated)."""

    @abc.abstractmethod
    def accepts_text(self, text: str) -> bool:
        """Whether the whole `text`, from the current state, is accepted and completes the
        grammar (coverage sweeps; does not change the state)."""


def check_bitmask_row(bitmask: torch.Tensor, row: int, words: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")
    if bitmask.shape[1] != words or not 0 <= row < bitmask.shape[0]:
        raise ValueError(f"bitmask of shape {tuple(bitmask.shape)} has no row {row} of "
                         f"{words} words (vocab_size / 32 rounded up)")


# --------------------------------------------------------------------------------------------
# xgrammar
# --------------------------------------------------------------------------------------------

# tokens `XGrammarMatcher._forced_by_masks` looks ahead at most (the forced drafter caps what
# it drafts itself: SpeculativeConfig.max_forced_tokens <= 64)
_FORCED_SCAN = 64


def _single_token(row: torch.Tensor) -> int | None:
    """The one token a bitmask row allows, or None when it allows none or several."""
    nonzero = torch.nonzero(row).flatten()
    if nonzero.numel() != 1:
        return None
    word = int(nonzero[0])
    bits = int(row[word]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    return word * 32 + bits.bit_length() - 1


class XGrammarMatcher(Matcher):
    """`Matcher` over ``xgrammar.GrammarMatcher``."""

    __slots__ = ("_m", "_compiled", "vocab_size", "_words", "_stops", "_version", "_stop_cache",
                 "_tail")

    def __init__(self, compiled: Any, *, _matcher: Any = None) -> None:
        import xgrammar

        self._compiled = compiled  # CompiledSpec
        tok = compiled.tok
        self.vocab_size = tok.vocab_size
        self._words = (tok.vocab_size + 31) // 32
        self._stops = tok.eos_token_ids
        self._m = _matcher if _matcher is not None else xgrammar.GrammarMatcher(
            compiled.backend_object, override_stop_tokens=list(tok.eos_token_ids))
        self._version = 0
        self._stop_cache: tuple[int, bool] | None = None
        # xgrammar may set the bits past vocab_size in the last word (they name no token);
        # cleared so that both backends write identical rows. Free when vocab_size % 32 == 0.
        rem = tok.vocab_size % 32
        self._tail = None if rem == 0 else torch.tensor((1 << rem) - 1, dtype=torch.int32)

    @property
    def compiled(self) -> Any:
        """The `CompiledSpec` this matcher runs."""
        return self._compiled

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self._m.is_terminated():
            check_bitmask_row(bitmask, row, self._words)
            bitmask[row].zero_()
            return
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._tail is not None:
            bitmask[row, -1] &= self._tail

    def accept(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return False
        ok = self._m.accept_token(int(token_id))
        if ok:
            self._version += 1
        return bool(ok)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(int(n))
            self._version += 1

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self._compiled, _matcher=self._m.fork())

    def forced_tokens(self) -> list[int]:
        if self._m.is_terminated():
            return []
        find = getattr(self._m, "find_jump_forward_tokens", None)
        if find is not None:
            return list(find())
        return self._forced_by_masks()

    def _forced_by_masks(self, limit: int = _FORCED_SCAN) -> list[int]:
        """The tokens the grammar allows alone, one mask at a time on a fork: what
        ``find_jump_forward_tokens`` returns, for xgrammar releases without it (vLLM's CPU
        build pins one). A stop token allowed alone ends the run (the engine stops there)."""
        fork = self._m.fork()
        mask = torch.zeros(1, self._words, dtype=torch.int32)
        out: list[int] = []
        while len(out) < limit and not fork.is_terminated():
            fork.fill_next_token_bitmask(mask, 0)
            if self._tail is not None:
                mask[0, -1] &= self._tail
            only = _single_token(mask[0])
            if only is None or only in self._stops or not fork.accept_token(only):
                break
            out.append(only)
        return out

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def is_completed(self) -> bool:
        return bool(self._m.is_terminated() or self._m.is_completed())

    def must_stop(self) -> bool:
        if self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False  # the common case: one cheap call
        if self._stop_cache is not None and self._stop_cache[0] == self._version:
            return self._stop_cache[1]
        scratch = torch.empty((1, self._words), dtype=torch.int32)
        self._m.fill_next_token_bitmask(scratch, 0)
        for s in self._stops:
            scratch[0, s >> 5] &= ~(1 << (s & 31)) if (s & 31) != 31 else 0x7FFFFFFF
        result = not bool(scratch.any())
        self._stop_cache = (self._version, result)
        return result

    def accepts_text(self, text: str) -> bool:
        probe = self._m.fork()
        return bool(probe.accept_string(text)) and bool(probe.is_completed())


# --------------------------------------------------------------------------------------------
# outlines-core
# --------------------------------------------------------------------------------------------

class _OutlinesTables:
    """Per-compile, shared by all matchers: the Index plus per-state facts built on first use."""

    def __init__(self, index: Any, tok: Any, max_cache_bytes: int = 64 << 20) -> None:
        self.index = index
        self.tok = tok
        self.vocab_size = tok.vocab_size
        self.words = (tok.vocab_size + 31) // 32
        self.stops = tuple(tok.eos_token_ids)
        self.stop_set = frozenset(self.stops)
        self.index_eos = tok.eos_token_ids[0]
        self.initial = index.get_initial_state()
        self._max_states = max(64, max_cache_bytes // (self.words * 4))
        # state -> (mask row [words] int32, number of allowed non-stop tokens,
        #           the allowed non-stop tokens when there are at most FEW of them, is_final)
        self._states: dict[int, tuple[torch.Tensor, int, tuple[int, ...] | None, bool]] = {}
        self._forced: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    FEW = 16

    def info(self, state: int) -> tuple[torch.Tensor, int, tuple[int, ...] | None, bool]:
        got = self._states.get(state)
        if got is not None:
            return got
        allowed = self.index.get_allowed_tokens(state) or []
        final = bool(self.index.is_final_state(state))
        ids = np.fromiter((t for t in allowed if t != self.index_eos), dtype=np.int64)
        bits = np.zeros(self.words * 32, dtype=bool)
        bits[ids] = True
        if final:
            bits[list(self.stops)] = True
        row = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
        few = tuple(int(i) for i in ids) if len(ids) <= self.FEW else None
        got = (row, int(len(ids)), few, final)
        with self._lock:
            if len(self._states) >= self._max_states:
                self._states.pop(next(iter(self._states)))
                self._forced.clear()
            self._states[state] = got
        return got

    def forced(self, state: int) -> tuple[int, ...]:
        """Forced tokens from `state` (cached per state).

        A token is forced when every way the grammar can continue from here agrees with its
        bytes: the longest allowed token t is taken if each allowed token is a prefix of t whose
        own continuations stay on t's bytes (so "{" and '{"' both allowed still force '{"' when
        '"' must follow "{"). This is the token-level analogue of xgrammar's jump-forward.
        """
        got = self._forced.get(state)
        if got is not None:
            return got
        out: list[int] = []
        s = state
        while len(out) < MAX_FORCED_TOKENS:
            _, count, few, final = self.info(s)
            if final or count == 0 or few is None:
                break
            decoded = self.tok.decoded
            best = max(few, key=lambda t: len(decoded[t]))
            if count > 1 and not self._agrees(s, decoded[best], 0):
                break
            out.append(best)
            s = self.index.get_next_state(s, best)
        got = tuple(out)
        with self._lock:
            self._forced[state] = got
        return got

    def _agrees(self, state: int, data: bytes, depth: int) -> bool:
        """Does every continuation from `state` start with `data` (or is a prefix of it that
        can only go on with the rest of `data`)?"""
        if not data:
            return True
        _, count, few, final = self.info(state)
        if final or few is None or depth > 8:
            return False
        decoded = self.tok.decoded
        for t in few:
            b = decoded[t]
            if len(b) >= len(data):
                if not b.startswith(data):
                    return False
            elif not data.startswith(b) or not self._agrees(
                    self.index.get_next_state(state, t), data[len(b):], depth + 1):
                return False
        return True


class OutlinesMatcher(Matcher):
    """`Matcher` over an outlines-core ``Index`` (state + persistent history, O(1) fork)."""

    __slots__ = ("_t", "vocab_size", "_state", "_history", "_terminated")

    def __init__(self, tables: _OutlinesTables, state: int | None = None,
                 history: tuple | None = None, terminated: bool = False) -> None:
        self._t = tables
        self.vocab_size = tables.vocab_size
        self._state = tables.initial if state is None else state
        # history: (previous state, was-a-stop-token, rest) cons cells, newest first
        self._history = history
        self._terminated = terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        check_bitmask_row(bitmask, row, self._t.words)
        if self._terminated:
            bitmask[row].zero_()
        else:
            bitmask[row].copy_(self._t.info(self._state)[0])

    def accept(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self.vocab_size:
            return False
        t = self._t
        if token_id in t.stop_set:
            if not t.info(self._state)[3]:
                return False
            self._history = (self._state, True, self._history)
            self._terminated = True
            return True
        nxt = t.index.get_next_state(self._state, int(token_id))
        if nxt is None:
            return False
        self._history = (self._state, False, self._history)
        self._state = nxt
        return True

    def rollback(self, n: int) -> None:
        for _ in range(int(n)):
            if self._history is None:
                raise ValueError("cannot roll back past the start of the output")
            self._state, was_stop, self._history = self._history
            if was_stop:
                self._terminated = False

    def fork(self) -> "OutlinesMatcher":
        return OutlinesMatcher(self._t, self._state, self._history, self._terminated)

    def forced_tokens(self) -> list[int]:
        if self._terminated:
            return []
        return list(self._t.forced(self._state))

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._terminated or self._t.info(self._state)[3]

    def must_stop(self) -> bool:
        if self._terminated:
            return True
        _, count, _, final = self._t.info(self._state)
        return final and count == 0

    def accepts_text(self, text: str) -> bool:
        """Some tokenization of `text` is accepted and ends in a final state (memoised DFS over
        token boundaries; the Index has no byte-level entry point)."""
        if self._terminated:
            return text == ""
        data = text.encode("utf-8")
        vocab = self._t.tok.text_tokens()
        max_len = self._t.tok.derived("max_token_len", lambda: max((len(b) for b in vocab), default=1))
        index = self._t.index
        seen: set[tuple[int, int]] = set()
        stack = [(0, self._state)]
        while stack:
            pos, state = stack.pop()
            if pos == len(data):
                if index.is_final_state(state):
                    return True
                continue
            if (pos, state) in seen:
                continue
            seen.add((pos, state))
            for end in range(min(len(data), pos + max_len), pos, -1):
                ids = vocab.get(data[pos:end])
                if ids is None:
                    continue
                nxt = index.get_next_state(state, ids[0])
                if nxt is not None:
                    stack.append((end, nxt))
        return False
