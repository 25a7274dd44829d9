"""Reasoning models: which markers a model thinks between, and the request matcher built on them.

A reasoning model writes a block of free text (``<think> ... </think>``) before its answer. The
grammar must constrain the answer only: :class:`~constrained_spec.grammar.reasoning.
ReasoningMatcher` lets the block run free and hands the tokens after the end marker to the
schema's matcher; this module decides when a request gets one and splits the output after.

The ``reasoning`` option (:func:`resolve_reasoning`; :class:`ReasoningOptions` holds it with
``max_reasoning_tokens`` for a Generator or a call):

* ``"auto"`` (the default): on when the tokenizer's chat template names a known pair of markers
  (:data:`KNOWN_MARKERS`: ``<think>``/``</think>`` as in Qwen3 and DeepSeek-R1, ``[THINK]``/
  ``[/THINK]``, ``<seed:think>``/``</seed:think>``), off otherwise;
* ``True``: on, with the template's markers or ``<think>``/``</think>``;
* ``"template"``: on, with the template's markers; a :class:`ConfigError` when it names none
  (the server's ``reasoning: true``: a model that does not think would have its whole answer
  taken for reasoning, and a request cannot give markers);
* ``False``: off; a :class:`ReasoningMarkers`: on, with these markers.

Where the output starts (:func:`start_phase`): a prompt that already closed the block (Qwen3's
template with thinking off ends in ``<think>\\n\\n</think>\\n\\n``) starts in the answer; one
that opened it (DeepSeek-R1's ends in ``<think>\\n``) starts thinking; otherwise the start
marker is forced first, so a request with reasoning on always reasons.

``max_reasoning_tokens`` bounds the thinking tokens (markers not counted); once spent, the end
marker is forced. ``max_tokens`` counts every output token, the reasoning's included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union, cast

from constrained_spec.errors import ConfigError
from constrained_spec.grammar import CompiledSpec, Matcher
from constrained_spec.grammar.reasoning import (
    ANSWER,
    OPENING,
    THINKING,
    ReasoningMatcher,
    ReasoningTables,
)

if TYPE_CHECKING:
    from constrained_spec.model.loading import LoadedModel

__all__ = ["KNOWN_MARKERS", "ReasoningMarkers", "ReasoningOption", "ReasoningOptions",
           "check_reasoning_budget", "check_reasoning_option", "detect_reasoning",
           "reasoning_matcher", "resolve_reasoning", "split_reasoning", "start_phase"]


@dataclass(frozen=True)
class ReasoningMarkers:
    """The text that opens and closes a reasoning block."""

    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"ReasoningMarkers.{name} must be a non-empty string, got "
                                  f"{value!r:.40}", option="reasoning")


ReasoningOption = Union[Literal["auto", "template"], bool, ReasoningMarkers, None]

#: Marker pairs recognised in chat templates, the most common first.
KNOWN_MARKERS = (ReasoningMarkers("<think>", "</think>"),
                 ReasoningMarkers("[THINK]", "[/THINK]"),
                 ReasoningMarkers("<seed:think>", "</seed:think>"))


def detect_reasoning(tokenizer: Any) -> ReasoningMarkers | None:
    """The markers a tokenizer's chat template uses, or None (no template, or it names neither
    marker of any known pair)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (tool use, RAG, ...)
        template = "\n".join(str(t) for t in template.values())
    if not isinstance(template, str):
        return None
    # the longest end marker first: "</seed:think>" must not be taken for "</think>"'s pair
    for markers in sorted(KNOWN_MARKERS, key=lambda m: -len(m.end)):
        if markers.end in template or markers.start in template:
            return markers
    return None


def check_reasoning_option(option: object) -> ReasoningOption:
    """The ``reasoning`` option, when it is one: ``"auto"``, ``"template"``, True, False (or
    None) or a :class:`ReasoningMarkers` as given; ``"on"`` / ``"off"`` (the command line's
    and a server request's words) as True / False."""
    if isinstance(option, str) and option in _SWITCH:
        return _SWITCH[option]
    if option is None or isinstance(option, (bool, ReasoningMarkers)) or (
            isinstance(option, str) and option in ("auto", "template")):
        return cast(ReasoningOption, option)
    raise ConfigError(f"must be 'auto', 'on', 'off', True, False, 'template' or a "
                      f"ReasoningMarkers, got {option!r:.40}", option="reasoning")


_SWITCH = {"on": True, "off": False}


def resolve_reasoning(option: object, tokenizer: Any) -> ReasoningMarkers | None:
    """The markers of the ``reasoning`` option for ``tokenizer`` (None: off; see the module
    docstring)."""
    option = check_reasoning_option(option)
    if option is None or option is False:
        return None
    if isinstance(option, ReasoningMarkers):
        return option
    if option == "auto":
        return detect_reasoning(tokenizer)
    markers = detect_reasoning(tokenizer)
    if markers is None and option == "template":
        known = ", ".join(f"{m.start}/{m.end}" for m in KNOWN_MARKERS)
        raise ConfigError(f"reasoning is on, but this model's chat template names no reasoning "
                          f"markers ({known}): the model does not think before it answers, and "
                          "its whole answer would be taken for its reasoning; leave reasoning "
                          "off (false, or out) for this model", option="reasoning")
    return markers or KNOWN_MARKERS[0]  # True


def check_reasoning_budget(value: object) -> int | None:
    """``max_reasoning_tokens``: an integer >= 0 (0: the end marker right after the start), or
    None for no budget."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"must be an integer >= 0 or None, got {value!r:.40}",
                          option="max_reasoning_tokens")
    return value


@dataclass(frozen=True)
class ReasoningOptions:
    """The reasoning options of a Generator or of one call (docs/options.md, "Reasoning").

    Checked on construction (a :class:`ConfigError` naming ``reasoning`` or
    ``max_reasoning_tokens``); :meth:`markers` resolves ``reasoning`` for a model's tokenizer.

    Parameters
    ----------
    reasoning:
        ``"auto"`` (on when the chat template names known markers), ``"template"``, True,
        False or a :class:`ReasoningMarkers` (see the module docstring).
    max_reasoning_tokens:
        Thinking tokens before the end marker is forced (None: no budget); ``max_tokens``
        counts the reasoning too.
    """

    reasoning: ReasoningOption = "auto"
    max_reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        check_reasoning_option(self.reasoning)
        check_reasoning_budget(self.max_reasoning_tokens)

    def markers(self, tokenizer: Any) -> ReasoningMarkers | None:
        """The markers in use with ``tokenizer`` (None: reasoning is off)."""
        return resolve_reasoning(self.reasoning, tokenizer)


def _marker_ids(tokenizer: Any, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ConfigError(f"the reasoning marker {text!r} encodes to no token with this "
                          "tokenizer; pass ReasoningMarkers with the model's markers",
                          option="reasoning")
    return ids


def _tables(loaded: LoadedModel, markers: ReasoningMarkers) -> ReasoningTables:
    """The shared automaton and mask rows for the model's tokenizer and ``markers``.

    On vLLM's engine the whole output is one token-level grammar there (`ReasoningTables`,
    ``match_text``): only the canonical end marker closes the block, and it must be one token
    (a longer one could not be told apart from the same tokens written while thinking)."""
    tok = loaded.tokenizer_data
    by_ids = loaded.engine == "vllm"

    def build() -> ReasoningTables:
        start = _marker_ids(loaded.tokenizer, markers.start)
        end = _marker_ids(loaded.tokenizer, markers.end)
        if by_ids and len(end) != 1:
            raise ConfigError(f"on vLLM's engine the reasoning end marker must be one token of "
                              f"the vocabulary; {markers.end!r} is {len(end)} tokens here. Use "
                              "engine='native' for this model's reasoning, or markers whose end "
                              "is one token", option="reasoning")
        try:
            return ReasoningTables(tok, start, end, markers.end.encode("utf-8"),
                                   markers.start.encode("utf-8"), match_text=not by_ids)
        except ValueError as e:
            raise ConfigError(f"{e}; pass ReasoningMarkers with the model's markers",
                              option="reasoning") from None
    key = f"reasoning:{markers.start}\x00{markers.end}" + ("\x00ids" if by_ids else "")
    return tok.derived(key, build)


def start_phase(tokenizer: Any, prompt_ids: Sequence[int], markers: ReasoningMarkers) -> str:
    """Where the output starts: ``"answer"`` when the prompt ends with the end marker,
    ``"thinking"`` when it ends with the start marker (whitespace after either ignored),
    ``"opening"`` (the start marker is forced first) otherwise."""
    tail = tokenizer.decode(list(prompt_ids[-64:])).rstrip()
    if tail.endswith(markers.end):
        return ANSWER
    if tail.endswith(markers.start):
        return THINKING
    return OPENING


def reasoning_matcher(loaded: LoadedModel, compiled: CompiledSpec | None,
                      markers: ReasoningMarkers, prompt_ids: Sequence[int],
                      max_reasoning_tokens: int | None = None) -> ReasoningMatcher:
    """The matcher of one request of a reasoning model: free text, then ``compiled``'s grammar
    (None: a free-text answer) after the end marker.

    Parameters
    ----------
    loaded:
        The :class:`~constrained_spec.model.loading.LoadedModel` (its tokenizer and tokenizer data).
    compiled:
        The request's ``CompiledSpec``, or None for free text.
    prompt_ids:
        The encoded prompt (a template may already open or close the block).
    max_reasoning_tokens:
        Thinking tokens before the end marker is forced (None: no budget).
    """
    return ReasoningMatcher(_tables(loaded, markers),
                            compiled.new_matcher if compiled is not None else None,
                            max_reasoning_tokens=check_reasoning_budget(max_reasoning_tokens),
                            phase=start_phase(loaded.tokenizer, prompt_ids, markers),
                            source=compiled)


def split_reasoning(tokenizer: Any, output_ids: Sequence[int], matcher: Matcher | None,
                    text: str) -> tuple[str | None, str]:
    """(reasoning, answer) texts of a finished request's output (``text``: all of it decoded).

    Without a reasoning matcher: (None, ``text``). With one: the reasoning is the text
    before the answer without its markers and surrounding whitespace ("" when the prompt
    closed the block); the answer is the text after the end marker ("" when the answer never
    started).
    """
    if not isinstance(matcher, ReasoningMatcher):
        return None, text
    start, end = matcher.markers
    cut = matcher.answer_start
    cut = len(output_ids) if cut is None else cut
    thought = tokenizer.decode(list(output_ids[:cut])).strip()
    if thought.startswith(start):
        thought = thought[len(start):]
    if thought.endswith(end):
        thought = thought[:-len(end)]
    return thought.strip(), tokenizer.decode(list(output_ids[cut:]))
