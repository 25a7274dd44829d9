"""One choice of a chat completion while it runs, and what it came to.

`Choice` follows one request of the engine (its text as it streams, reasoning split off,
tool calls read back); `Outcome` is what the response reports for it (text, finish reason,
error, usage). The server's state (`state.Server`) makes them; routes and streaming read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from constrained_spec.api import SchemaMode
from constrained_spec.frontend.tools import StreamingToolParser, ToolParser
from constrained_spec.generation.serving import Ticket
from constrained_spec.grammar.reasoning import ReasoningMatcher
from constrained_spec.server.protocol import APIError


class ChoiceText:
    """The text of one choice as its tokens arrive: what may be sent, and where it stops.

    The ids so far are decoded as a whole (decoding piece by piece would split multi-byte
    characters). Text that could be the start of a stop string is held back until it is not;
    when a stop string appears the text is cut before it and ``stopped`` is set.
    """

    def __init__(self, decode: Any, stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = list(stop)
        self.ids: list[int] = []
        self.text = ""  # the text so far (cut at a stop string once found)
        self.sent = ""  # the part of it already handed out
        self.stopped = False

    def feed(self, ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to send."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        # an incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives
        self.text = self.decode(self.ids).rstrip("\ufffd")
        safe = len(self.text)
        if self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                safe = len(self.text)
            else:
                safe -= self._held_back(self.text)
        return self._release(self.text[:safe])

    def finish(self, final_text: str | None = None) -> str:
        """The rest to send once generation ended (``final_text``: the whole output)."""
        if final_text is not None and not self.stopped:
            self.text = final_text
        return self._release(self.text)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: str) -> str:
        if not upto.startswith(self.sent):
            return ""  # decoding rewrote an earlier character; wait for more (or the end)
        new = upto[len(self.sent):]
        self.sent = upto
        return new


class ThoughtText(ChoiceText):
    """The reasoning of a choice as its tokens arrive (a reasoning model's think block): the
    start marker dropped, text that could begin the end marker held back, cut at it."""

    def __init__(self, decode: Any, markers: tuple[str, str]) -> None:
        self.start_marker = markers[0]
        super().__init__(self._decode_thought, [markers[1]])
        self._decode_all = decode

    def _decode_thought(self, ids: Sequence[int]) -> str:
        text = self._decode_all(ids).lstrip()
        if self.start_marker.startswith(text):
            return ""  # the start marker, or the first pieces of it
        return text.removeprefix(self.start_marker).lstrip()


@dataclass
class Choice:
    """One of the ``n`` outputs of a chat completion while it runs. With a reasoning model
    (its request's matcher a `grammar.reasoning.ReasoningMatcher`), ``thought`` takes the
    tokens before the answer and ``text`` the answer's."""

    index: int
    ticket: Ticket
    spec: Any
    mode: SchemaMode
    text: ChoiceText
    thought: ThoughtText | None = None
    _seen: int = 0  # output tokens received so far

    @classmethod
    def of(cls, index: int, ticket: Ticket, spec: Any, mode: SchemaMode, decode: Any,
           stop: Sequence[str] = ()) -> Choice:
        matcher = ticket.request.matcher
        thought = ThoughtText(decode, matcher.markers) if isinstance(matcher, ReasoningMatcher) else None
        return cls(index, ticket, spec, mode, ChoiceText(decode, stop), thought)

    @property
    def request(self) -> Any:
        return self.ticket.request

    def split(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(reasoning ids, answer ids) of newly arrived ``ids``. The engine commits tokens to
        the request's matcher before it hands them out, so its ``answer_start`` is known for
        every token that has arrived (a later one only moves past them)."""
        if self.thought is None:
            return [], ids
        first = self._seen
        self._seen += len(ids)
        cut = self.request.matcher.answer_start
        cut = self._seen if cut is None else min(max(cut - first, 0), len(ids)) + first
        return ids[: cut - first], ids[cut - first:]

    def tool_stream(self) -> StreamingToolParser | None:
        """The parser of this choice's streamed tool calls (None: no tool calls possible)."""
        target = self.spec.target if self.spec is not None else None
        if not isinstance(target, ToolParser):
            return None
        if self._parser is None:
            self._parser = StreamingToolParser(target.tools, target.fmt)
        return self._parser

    _parser: StreamingToolParser | None = None


@dataclass
class Outcome:
    """How a finished choice ended: its text and finish reason, or the error to answer."""

    text: str
    finish_reason: str
    error: APIError | None = None
    completion_tokens: int = 0
    # what Generator.finalize returned (None when a stop string ended the text): RetryPolicy
    # decides from it whether ``max_retries`` runs the choice again
    result: Any = None
    #: the calls of a choice that made tool calls (finish_reason "tool_calls"); ``text`` is
    #: then the text written before them
    tool_calls: list[Any] | None = None
    #: a reasoning model's thinking (``reasoning_content``); None for other models
    reasoning: str | None = None

    def message(self) -> dict[str, Any]:
        """The choice's OpenAI ``message`` (with ``reasoning_content`` as vLLM / DeepSeek
        name a reasoning model's thinking)."""
        if self.tool_calls:
            msg = {"role": "assistant", "content": self.text or None, "refusal": None,
                   "tool_calls": [c.openai() for c in self.tool_calls]}
        else:
            msg = {"role": "assistant", "content": self.text, "refusal": None}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        return msg
