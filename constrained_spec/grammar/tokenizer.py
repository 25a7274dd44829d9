"""What the grammar backends need to know about a tokenizer, built once per model.

`TokenizerData` wraps xgrammar's ``TokenizerInfo`` (which does the hard part: decoding
byte-level BPE / sentencepiece / tiktoken token strings to bytes and finding special tokens)
and derives from it the byte strings outlines-core's ``Vocabulary`` needs, so both backends see
exactly the same token -> bytes map. ``vocab_size`` is the model's logits width, which may
exceed the tokenizer (padded vocabularies): ids past the tokenizer are never allowed.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["TokenizerData"]


@dataclass(frozen=True, eq=False)
class TokenizerData:
    """Tokenizer facts for grammar compilation; equality and hashing go through `key`."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    key: str
    # token id -> the bytes it decodes to (len == vocab_size; padded / special ids map to b"")
    decoded: tuple[bytes, ...] = field(repr=False)
    special_token_ids: frozenset[int] = field(repr=False, default=frozenset())
    xgr_info: Any = field(repr=False, default=None)
    # per-backend derived objects (outlines Vocabulary, xgrammar compiler, token tries)
    _derived: dict = field(repr=False, default_factory=dict, compare=False)
    _lock: Any = field(repr=False, default_factory=threading.RLock, compare=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenizerData) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int | None = None,
                eos_token_ids: int | Sequence[int] | None = None) -> "TokenizerData":
        """From a ``transformers`` tokenizer (byte-level BPE, sentencepiece, tiktoken).

        Parameters
        ----------
        vocab_size
            The model's logits width (``config.vocab_size``); default: the tokenizer's size.
        eos_token_ids
            Stop tokens; default: the tokenizer's ``eos_token_id``.
        """
        import xgrammar

        stops = _as_ids(eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stops)
        return cls._from_info(info)

    @classmethod
    def from_tokens(cls, tokens: list[str], eos_token_id: int,
                    vocab_size: int | None = None) -> "TokenizerData":
        """A raw-string vocabulary for tests: token i is the text ``tokens[i]``.

        The eos token's string is ignored; empty strings are tokens that are never allowed.
        """
        import xgrammar

        size = len(tokens) if vocab_size is None else int(vocab_size)
        if size < len(tokens):
            raise ValueError(f"vocab_size {size} is smaller than the {len(tokens)} tokens")
        if not 0 <= eos_token_id < len(tokens):
            raise ValueError(f"eos_token_id {eos_token_id} is not a token id")
        info = xgrammar.TokenizerInfo(list(tokens), xgrammar.VocabType.RAW, vocab_size=size,
                                      stop_token_ids=[eos_token_id])
        return cls._from_info(info)

    @classmethod
    def _from_info(cls, info: Any) -> "TokenizerData":
        size = int(info.vocab_size)
        decoded = list(info.decoded_vocab)
        decoded = [bytes(b) for b in decoded[:size]] + [b""] * max(0, size - len(decoded))
        stops = tuple(int(i) for i in info.stop_token_ids)
        if not stops:
            raise ValueError("the tokenizer has no eos token; pass eos_token_ids")
        special = frozenset(int(i) for i in info.special_token_ids) | {
            i for i, b in enumerate(decoded) if not b}
        h = hashlib.sha256()
        h.update(f"{size}|{stops}|{info.vocab_type}|{info.add_prefix_space}|".encode())
        for i, b in enumerate(decoded):
            h.update(len(b).to_bytes(4, "little"))
            h.update(b"\x00" if i in special else b)
        return cls(vocab_size=size, eos_token_ids=stops, key=h.hexdigest()[:32],
                   decoded=tuple(decoded), special_token_ids=frozenset(special) - set(stops),
                   xgr_info=info)

    # ---- derived, cached ------------------------------------------------------------------
    def derived(self, name: str, build: Any) -> Any:
        """A per-tokenizer object built once (thread-safe)."""
        with self._lock:
            if name not in self._derived:
                self._derived[name] = build()
            return self._derived[name]

    def text_tokens(self) -> dict[bytes, list[int]]:
        """bytes -> ids of every ordinary token (no stop, special, padded or empty tokens)."""
        def build() -> dict[bytes, list[int]]:
            out: dict[bytes, list[int]] = {}
            stops = set(self.eos_token_ids)
            for i, b in enumerate(self.decoded):
                if b and i not in stops and i not in self.special_token_ids:
                    out.setdefault(b, []).append(i)
            return out
        return self.derived("text_tokens", build)

    def outlines_vocabulary(self) -> Any:
        """The outlines-core ``Vocabulary`` (first stop token as its eos)."""
        def build() -> Any:
            import outlines_core

            return outlines_core.Vocabulary(self.eos_token_ids[0], self.text_tokens())
        return self.derived("outlines_vocabulary", build)


def _as_ids(ids: int | Sequence[int] | None) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, int):
        return [ids]
    out = [int(i) for i in ids]
    if not out:
        raise ValueError("eos_token_ids cannot be empty")
    return out
