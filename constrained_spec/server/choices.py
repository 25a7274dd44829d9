"""One choice of a chat completion while it runs, and what it came to.

`Choice` follows one request of the engine (its text as it streams, reasoning split off,
tool calls read back); `Outcome` is what the response reports for it (text, finish reason,
error, usage, warnings). The server's state (`state.Server`) makes them; routes and streaming
read them.

Tool calls never reach a client as text. A call identical to an earlier one ends the calls
(`ToolCallText` stops the choice there; `frontend.tools.ToolParser`): the calls before it are
the answer, ``finish_reason`` "tool_calls". An output cut short (``max_tokens``, a repetition
loop) keeps its complete calls as ``tool_calls`` and drops the call that had begun, with
``finish_reason`` "length" as OpenAI sets it for a cut output; the content is the text before
the calls, never their markup. What was dropped, and why, is a ``warnings`` item of the
response (`response_warnings`), beside the schema keywords the grammar does not enforce
(`schema_warnings`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from constrained_spec.api import SchemaMode
from constrained_spec.errors import (
    ConstrainedSpecError,
    IncompleteOutputError,
    RepetitionLoopError,
)
from constrained_spec.frontend.tools import StreamingToolParser, ToolParser, ToolReading
from constrained_spec.generation.logprobs import TokenLogprob
from constrained_spec.generation.serving import Ticket
from constrained_spec.grammar.reasoning import ReasoningMatcher
from constrained_spec.schemas import preflight
from constrained_spec.server.logprobs import token_text, within
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


class ToolCallText(ChoiceText):
    """The text of a choice that may make several tool calls: stopped (``stopped``, which ends
    the request as a stop string does) once a call repeats an earlier one, which ends the
    calls (`ToolParser.repeats`) -- without it a small model repeats its first call until
    ``max_tokens``."""

    def __init__(self, decode: Any, parser: ToolParser) -> None:
        super().__init__(decode)
        self.parser = parser

    def feed(self, ids: Sequence[int]) -> str:
        before = len(self.text)
        new = super().feed(ids)
        # a call ends with its arguments' closing brace: only then can a repeat have appeared
        # (a scan reads the whole text, so not at every token)
        if not self.stopped and "}" in self.text[max(before - 1, 0):] \
                and self.parser.repeats(self.text):
            self.stopped = True
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
           stop: Sequence[str] = (), decoded: Sequence[bytes] = ()) -> Choice:
        """``decoded``: token id -> bytes, for the logprobs of a request that asks."""
        matcher = ticket.request.matcher
        thought = ThoughtText(decode, matcher.markers) if isinstance(matcher, ReasoningMatcher) else None
        target = spec.target if spec is not None else None
        if isinstance(target, ToolParser) and target.tools.parallel:
            text: ChoiceText = ToolCallText(decode, target)
        else:
            text = ChoiceText(decode, stop)
        return cls(index, ticket, spec, mode, text, thought, decoded=decoded)

    @property
    def tools(self) -> ToolParser | None:
        """The reader of this choice's tool calls (None: it cannot make any)."""
        target = self.spec.target if self.spec is not None else None
        return target if isinstance(target, ToolParser) else None

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
        target = self.tools
        if target is None:
            return None
        if self._parser is None:
            self._parser = StreamingToolParser(target.tools, target.fmt)
        return self._parser

    _parser: StreamingToolParser | None = None
    decoded: Sequence[bytes] = ()  # token id -> bytes (for logprobs)
    _lp_text: str = ""  # the answer text whose tokens' logprobs were streamed
    _lp_sent: int = 0  # logprob entries streamed
    _lp_chars: int = 0  # their tokens' text length (completions' text_offset)

    def answer_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs of the answer's tokens so far (a reasoning model's thinking left out);
        None when the request did not ask for them."""
        req = self.request
        if req.params.logprobs is None:
            return None
        matcher = req.matcher
        start = matcher.answer_start if isinstance(matcher, ReasoningMatcher) else 0
        return list(req.logprobs[start or 0:]) if start is not None else []

    def stream_logprobs(self, text: str) -> tuple[list[TokenLogprob] | None, int]:
        """(the entries of the tokens behind ``text``, the answer text just streamed, not yet
        sent; where in the answer their tokens' text starts, as completions' ``text_offset``
        counts it). None when the request did not ask."""
        entries = self.answer_logprobs()
        if entries is None:
            return None, 0
        offset = self._lp_chars
        self._lp_text += text
        kept = within(self.decoded, entries, self._lp_text)
        new, self._lp_sent = kept[self._lp_sent:], len(kept)
        self._lp_chars += sum(len(token_text(self.decoded, e.token_id)) for e in new)
        return new, offset

    def final_logprobs(self, text: str, calls: bool) -> list[TokenLogprob] | None:
        """The answer's logprobs for the response: the tokens behind its content ``text`` (a
        content cut at a stop string keeps its own). When the choice made ``calls``, ``text``
        is what it wrote before them: their markup is no content, so its tokens are never
        listed (an empty list when the content is null, as the streamed call deltas list
        none)."""
        entries = self.answer_logprobs()
        return None if entries is None else within(self.decoded, entries, text)

    def stopped_outcome(self, tokens: int) -> Outcome:
        """The outcome of a choice whose text stopped early: at a stop string ("stop"), or at
        a tool call that repeats an earlier one (the calls before it, "tool_calls")."""
        if self.tools is None:
            return Outcome(self.text.text, "stop", completion_tokens=tokens)
        # the tokens after the repeated call's end (the same step's) may begin another call
        out = self._calls_outcome(self.tools.read(self.text.text, complete=False), tokens,
                                  None, "max_tokens")
        return out if out is not None else Outcome(self.text.text, "stop", completion_tokens=tokens)

    def tool_outcome(self, result: Any, tokens: int) -> Outcome | None:
        """The outcome of a finished choice that could make tool calls, from what
        ``Generator.finalize`` returned: its calls (without repeats), or, for an output cut
        short, its complete calls and no call markup in the content. None: not a case of tool
        calls (text under ``"auto"``, an error), for the caller to answer as any other."""
        parser = self.tools
        if parser is None:
            return None
        if isinstance(result, IncompleteOutputError):
            why = "a repetition loop" if isinstance(result, RepetitionLoopError) else (
                "max_tokens" if self.request.finish_reason == "length"
                else f"the engine ({self.request.finish_reason})")
            try:  # the answer's text (a reasoning model's thinking is not in it)
                reading = parser.read(self.text.text, complete=False)
            except ConstrainedSpecError as e:  # a complete call that does not validate
                return Outcome("", "length", completion_tokens=tokens, result=result,
                               warnings=[{"type": "tool_call_dropped", "choice": self.index,
                                          "message": f"the calls were dropped: {e}"}])
            return self._calls_outcome(reading, tokens, result, why)
        if isinstance(result, BaseException) or not hasattr(result, "text"):
            return None
        # finalize returns the complete calls of an output cut by max_tokens (finish "length")
        complete = getattr(result, "finish_reason", "stop") != "length"
        return self._calls_outcome(parser.read(result.text, complete=complete), tokens, result,
                                   "max_tokens")

    def _calls_outcome(self, reading: ToolReading, tokens: int, result: Any,
                       why: str) -> Outcome | None:
        """The outcome of ``reading``: its calls ("tool_calls" when they ended, "length"
        when the output was cut during or after them), or its text alone when the output was
        cut with no complete call (None for a finished output without calls)."""
        notes = [{**note, "choice": self.index} for note in reading.notes(why)]
        cut = reading.cut is not None and reading.repeated is None
        if reading.calls:
            # complete calls are an answer: a cut after them is not run again (result None)
            return Outcome(reading.content, "length" if cut else "tool_calls",
                           completion_tokens=tokens, tool_calls=reading.calls, warnings=notes)
        if result is None or isinstance(result, IncompleteOutputError):
            return Outcome(reading.content, "length", completion_tokens=tokens, result=result,
                           warnings=notes)
        return None


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
    #: what the response says about this choice (``{"type", "message", "choice"}`` items:
    #: tool calls dropped and why)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    #: the answer's tokens' logprobs when the request asked (`Choice.final_logprobs`)
    logprobs: list[TokenLogprob] | None = None

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


# schema ids (SchemaSpec.key, backend) -> their warnings, most recent last: a server sees the
# same schemas request after request, and a pre-flight walks the whole schema
_WARNINGS: OrderedDict[tuple[str, str], list[dict[str, Any]]] = OrderedDict()
_WARNINGS_LOCK = threading.Lock()
_WARNINGS_SIZE = 256


def schema_warnings(spec: Any, backend: Literal["xgrammar", "outlines"]
                    ) -> list[dict[str, Any]]:
    """The keywords of a request's JSON schema (or of its tools' arguments) that the grammar
    does not enforce, one ``{"type": "keyword_not_enforced", ...}`` item each: what the
    pre-flight report found and did not refuse (under ``strict`` false, or an ignored keyword
    without ``strict``). The output is still validated against them, so a violation is a
    failed attempt, not a wrong answer."""
    if spec is None:
        return []
    if isinstance(spec.target, ToolParser):
        return [{**item, "tool": tool.name} for tool in spec.target.tools.offered
                for item in schema_warnings(tool.spec, backend)]
    if spec.kind != "json_schema" or not spec.key:
        return []
    key = (spec.key, backend)
    with _WARNINGS_LOCK:
        hit = _WARNINGS.get(key)
        if hit is not None:
            _WARNINGS.move_to_end(key)
            return hit
    out = [{"type": "keyword_not_enforced", "keyword": issue.keyword,
            "pointer": issue.pointer, "level": issue.level,
            "message": f"{issue.keyword or 'the schema'} at {issue.pointer or '/'} is not "
                       f"enforced while generating ({issue.level}: {issue.message}); the "
                       "output is validated against it afterwards"}
           for issue in preflight(spec, backend).issues if issue.level != "narrowed"]
    with _WARNINGS_LOCK:
        _WARNINGS[key] = out
        while len(_WARNINGS) > _WARNINGS_SIZE:
            _WARNINGS.popitem(last=False)
    return out


def response_warnings(choices: Sequence[Choice], outcomes: Sequence[Outcome] = (),
                      backend: Literal["xgrammar", "outlines"] = "xgrammar") -> dict[str, Any]:
    """The response's ``warnings`` field (``{}`` when there is nothing to say, so a response
    stays exactly OpenAI's): the schema keywords not enforced (once: every choice has the same
    schema) and what each outcome dropped."""
    items = schema_warnings(choices[0].spec, backend) if choices else []
    items = [*items, *(w for o in outcomes for w in o.warnings)]
    return {"warnings": items} if items else {}
