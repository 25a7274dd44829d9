"""Cache slots: the one allocator behind every per-request cache.

The target runner, a draft model's runner and a draft head each keep their cache as tensors
indexed ``[slot, position, ...]``. A request holds one slot in each while it runs; the slot
goes back to the free list when it finishes, and the next request reuses it. The cache
tensors grow by doubling (slots and positions), so a long-running server reallocates a few
times, not at every new request or token.
"""

from __future__ import annotations

# the smallest cache worth allocating: the slots asked for (a lone request's cache holds one
# slot, not four: at ~1k positions each extra slot of the embedded model's cache is ~24 MB of
# resident memory) of a few hundred positions
_MIN_SLOTS = 1
_MIN_POSITIONS = 256


class SlotAllocator:
    """Slot ids, the positions each slot holds, and the capacity of the cache behind them.

    A subclass owns the cache tensors: before writing positions it calls `grown_capacity`
    and, when that says so, reallocates its tensors to the new capacity (copying the old
    contents over) and records it in ``_cap_slots`` / ``_cap_len``.
    """

    def __init__(self) -> None:
        self._lengths: dict[int, int] = {}  # slot in use -> positions it holds
        self._free: list[int] = []  # slots handed back, reused first
        self._next = 0  # slots ever created
        self._cap_slots = 0  # slots the cache tensors hold now
        self._cap_len = 0  # positions per slot the cache tensors hold now

    def new_slot(self) -> int:
        """A free slot, empty (length 0)."""
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next = self._next, self._next + 1
        self._lengths[slot] = 0
        return slot

    def free_slot(self, slot: int) -> None:
        """Hand ``slot`` back (a slot not in use is ignored: freeing twice frees once)."""
        if self._lengths.pop(slot, None) is not None:
            self._free.append(slot)

    def length(self, slot: int) -> int:
        """Positions ``slot`` holds."""
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first ``length`` positions of ``slot``; later writes overwrite the rest."""
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._lengths[slot]} to {length}")
        self._lengths[slot] = length

    @property
    def slots_in_use(self) -> int:
        """Slots handed out by `new_slot` and not freed yet."""
        return len(self._lengths)

    def grown_capacity(self, slots: int, length: int,
                       max_len: int | None = None) -> tuple[int, int] | None:
        """The ``(slots, positions)`` the cache must grow to so that ``slots`` slots of
        ``length`` positions fit, or None when they fit already.

        Both double (from at least 256 positions); positions stop at ``max_len``
        (the model's context) unless one call needs more.
        """
        if slots <= self._cap_slots and length <= self._cap_len:
            return None
        new_slots = self._cap_slots if slots <= self._cap_slots else \
            max(slots, 2 * self._cap_slots, _MIN_SLOTS)
        new_len = self._cap_len
        while new_len < length:
            new_len = max(_MIN_POSITIONS, 2 * new_len)
        if max_len is not None:  # never below what is held (an earlier call past max_len)
            new_len = min(new_len, max(max_len, length, self._cap_len))
        return new_slots, new_len
