"""Prompt prefill that is the same however a prompt is split, and the prompt prefixes it keeps.

Requests of one schema share a long prompt prefix (the system message that describes the
schema); computing its keys and values once and copying them into each new request's slot
saves most of a prefill. That copy must not change an output: the cached positions have to
hold exactly the values a fresh prefill of that prompt would write.

An exact `runner.LeanRunner` gives that through its decode / verify path, which computes every
row as that row alone would be computed (the runner's module docstring): a prompt fed through
it in one forward, in chunks of any size, or after a copied prefix writes the same bits at
every position. So an exact runner prefills a prompt of up to `INVARIANT_MAX` tokens on that
path (`Prefiller.prefill`), chunk by chunk (at most `CHUNK_ROWS` rows a forward), after the
longest prefix this cache holds; a longer prompt takes the plan's prefill kernels (faster for
long prompts on some CPUs, not row-invariant) and is neither read from nor written to the
cache. Which path a prompt takes depends on its length only, never on what is cached, so an
output is the same whether its prefix was found or not (tested).

The cache (`PrefixCache`) keeps whole blocks of `BLOCK` prompt tokens, each keyed by its
tokens and the block before it (a chain, as vLLM's automatic prefix caching keys its blocks),
holding the block's keys and values of every layer (and the drafters' kept hidden states where
the runner keeps them). It is bounded in bytes: the least recently used block goes first, a
block before the blocks after it (a chain is read from its start, so a block whose parent is
gone is never found again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: prompt tokens per cached block
BLOCK = 16
#: the longest prompt prefilled on the row-invariant path (and cached)
INVARIANT_MAX = 4096
#: rows in one prefill forward on that path (bounds the forward's buffers)
CHUNK_ROWS = 256


def prefix_cache_bytes() -> int:
    """The cache's bound: ``CONSTRAINED_SPEC_PREFIX_CACHE_MB`` (`settings.Settings`)."""
    from constrained_spec.settings import settings

    return settings().prefix_cache_mb << 20


@dataclass
class _Block:
    id: int
    tensors: list[torch.Tensor]  # one per cache tensor of the runner (`Prefiller._caches`): [BLOCK, ...]
    nbytes: int


class PrefixCache:
    """Blocks of prompt keys and values, keyed by their token chain, at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._next_id = 1  # 0: the chain's start

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0

    def match(self, tokens: Sequence[int]) -> list[_Block]:
        """The cached blocks that start ``tokens``, in order (the longest chain kept)."""
        found: list[tuple[tuple[int, tuple[int, ...]], _Block]] = []
        parent = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            key = (parent, tuple(tokens[start:start + BLOCK]))
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
            parent = block.id
        # most recent last, a chain's start after its later blocks: those go first
        for key, _ in reversed(found):
            self._blocks.move_to_end(key)
        return [b for _, b in found]

    def add(self, tokens: Sequence[int], blocks: int, read: Any) -> None:
        """Keep the first ``blocks`` whole blocks of ``tokens``; ``read(i)`` gives block ``i``'s
        tensors (copies it may keep). Blocks already kept are only touched."""
        parent = 0
        chain = []
        for i in range(blocks):
            key = (parent, tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
            block = self._blocks.get(key)
            if block is None:
                tensors = read(i)
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                if nbytes > self.max_bytes:
                    break
                block = _Block(self._next_id, tensors, nbytes)
                self._next_id += 1
                self._blocks[key] = block
                self.bytes += nbytes
            chain.append(key)
            parent = block.id
        for key in reversed(chain):
            self._blocks.move_to_end(key)
        while self.bytes > self.max_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.bytes -= old.nbytes


class Prefiller:
    """A `runner.LeanRunner`'s prompt prefill with its prefix cache (the module docstring)."""

    def __init__(self, runner: Any, max_bytes: int) -> None:
        self.runner = runner
        self.cache = PrefixCache(max_bytes)

    def invariant(self, n: int) -> bool:
        """Whether a prompt of ``n`` prefilled tokens takes the row-invariant (cached) path: an
        exact runner whose decode kernel is row-invariant (not float32's GEMM), with a cache."""
        return self.runner.row_invariant and n <= INVARIANT_MAX and self.cache.max_bytes > 0

    def _caches(self) -> list[torch.Tensor]:
        r = self.runner
        out = [*r.k_cache, *r.v_cache]
        if r.feature_layers and r.f_cache is not None:
            out.append(r.f_cache)
        return out

    @torch.inference_mode()
    def prefill(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[int]:
        """Append ``tokens[i]`` to empty slot ``slots[i]`` (no logits); returns, per slot, the
        tokens computed (the rest came from the cache)."""
        r = self.runner
        computed = [len(t) for t in tokens]
        plain = [i for i, t in enumerate(tokens) if t and not self.invariant(len(t))]
        if plain:  # the plan's prefill kernels, in one call (an exact runner splits it by prompt)
            r.forward([slots[i] for i in plain], [tokens[i] for i in plain], [0] * len(plain),
                      phase="prefill")
        rest: list[tuple[int, list[int]]] = []  # (slot, tokens still to compute)
        for i, t in enumerate(tokens):
            if not t or not self.invariant(len(t)):
                continue
            n = self.start(slots[i], t)
            computed[i] = len(t) - n
            if n < len(t):
                rest.append((slots[i], list(t[n:])))
        self._forward_chunks(rest)
        for i, t in enumerate(tokens):
            self.finish(slots[i], t)
        return computed

    @torch.inference_mode()
    def start(self, slot: int, tokens: Sequence[int]) -> int:
        """Restore the longest cached prefix of prompt ``tokens`` into empty ``slot``; returns
        its length (0 for a prompt off the row-invariant path: the caller computes the rest
        on that path, rows as any decode row)."""
        if not tokens or not self.invariant(len(tokens)):
            return 0
        found = self.cache.match(tokens)
        if found:
            self._restore(slot, found)
        return len(found) * BLOCK

    @torch.inference_mode()
    def finish(self, slot: int, tokens: Sequence[int]) -> None:
        """``slot`` holds all of prompt ``tokens``: keep its whole blocks."""
        if tokens and self.invariant(len(tokens)):
            self.cache.add(tokens, len(tokens) // BLOCK, lambda b: self._read(slot, b))

    def _forward_chunks(self, rest: list[tuple[int, list[int]]]) -> None:
        """The rows of ``rest`` through the decode / verify path, at most `CHUNK_ROWS` a forward."""
        r = self.runner
        while rest:
            budget, batch, later = CHUNK_ROWS, [], []
            for slot, t in rest:
                take = min(len(t), budget) if budget > 0 else 0
                if take:
                    batch.append((slot, t[:take]))
                    budget -= take
                if take < len(t):
                    later.append((slot, t[take:]))
            r.forward([s for s, _ in batch], [t for _, t in batch], [0] * len(batch), phase="decode")
            rest = later

    def _restore(self, slot: int, blocks: list[_Block]) -> None:
        """Copy ``blocks`` (a chain from position 0) into ``slot`` and set its length."""
        r = self.runner
        n = len(blocks) * BLOCK
        r._ensure_capacity(slot + 1, n)
        for j, cache in enumerate(self._caches()):
            for b, block in enumerate(blocks):
                src = block.tensors[j]
                cache[slot, b * BLOCK:(b + 1) * BLOCK] = src
        r._lengths[slot] = n

    def _read(self, slot: int, b: int) -> list[torch.Tensor]:
        """Copies of block ``b`` of ``slot``'s cached positions, one per cache tensor."""
        return [c[slot, b * BLOCK:(b + 1) * BLOCK].clone() for c in self._caches()]
