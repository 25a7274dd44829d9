"""Whether two patternProperties keys can match the same property name.

JSON Schema applies EVERY patternProperties schema whose key matches a property name; xgrammar
(and any grammar that writes one key-value alternative per pattern) writes a name matching two
keys with the value of either one, so the other schema is not enforced for it. The pre-flight
reports two keys with different schemas unless their patterns are disjoint, which this module
decides exactly for the regex language outlines-core compiles: both patterns become DFAs over
bytes (``outlines_core.Index`` on a 256-byte vocabulary) and their product is searched for a
string both accept. A pattern outlines-core cannot read (a look-around), an overlong one or a
search past `MAX_PAIRS` states counts as overlapping (reported, never silently wrong).
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from .patterns import python_regex, search_pattern

__all__ = ["MAX_PAIRS", "MAX_PATTERN", "key_patterns_overlap"]

MAX_PAIRS = 20_000  # product states searched before giving up (then: "may overlap")
MAX_PATTERN = 1_000  # characters; longer key patterns are not compiled here
_EOS = 256
_LOCK = threading.Lock()


def _whole(pattern: str) -> str:
    """A key pattern as the whole-name regex it means (JSON Schema searches patterns)."""
    return search_pattern(pattern, any_text=".*") or python_regex(pattern)


@lru_cache(maxsize=256)
def _dfa(pattern: str) -> Any:
    """(initial state, transitions, final states) of `pattern`'s byte DFA, or None."""
    import outlines_core

    if len(pattern) > MAX_PATTERN:
        return None
    try:
        vocabulary = outlines_core.Vocabulary(_EOS, {bytes([i]): [i] for i in range(256)})
        index = outlines_core.Index(_whole(pattern), vocabulary)
    except Exception:  # outlines-core's regex dialect has no look-around, for one
        return None
    return index.get_initial_state(), index.get_transitions(), frozenset(index.get_final_states())


def key_patterns_overlap(a: str, b: str) -> bool:
    """Whether some property name matches both patternProperties keys `a` and `b` (True when
    that cannot be decided here; see the module docstring)."""
    with _LOCK:  # lru_cache is thread-safe, but one build per pattern is enough
        dfa_a, dfa_b = _dfa(a), _dfa(b)
    if dfa_a is None or dfa_b is None:
        return True
    (start_a, moves_a, final_a), (start_b, moves_b, final_b) = dfa_a, dfa_b
    todo = [(start_a, start_b)]
    seen = set(todo)
    while todo:
        state_a, state_b = todo.pop()
        if state_a in final_a and state_b in final_b:
            return True
        out_a, out_b = moves_a.get(state_a, {}), moves_b.get(state_b, {})
        for byte in out_a.keys() & out_b.keys():
            pair = (out_a[byte], out_b[byte])
            if byte == _EOS or pair in seen:
                continue
            if len(seen) >= MAX_PAIRS:
                return True
            seen.add(pair)
            todo.append(pair)
    return False
