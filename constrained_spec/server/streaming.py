"""How a chat completion's choices run: their tokens as they arrive, the text they make
(detokenized whole, cut at ``stop`` strings), their outcome once finished, and the SSE stream.

Each choice is one engine request (a :class:`~constrained_spec.generation.serving.Ticket` of the shared
engine loop). ``run_choices`` consumes all of a completion's choices together; ``stream``
turns them into OpenAI's ``chat.completion.chunk`` events (a ``_ChunkProducer`` runs the choices
and queues the events, ``stream`` sends them). A client that goes away cancels
its choices, which frees their slots at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from constrained_spec.api import SchemaMode
from constrained_spec.frontend.tools import StreamingToolParser, ToolParser
from constrained_spec.generation.serving import Ticket
from constrained_spec.grammar.reasoning import ReasoningMatcher
from constrained_spec.server.protocol import APIError, api_error, envelope

if TYPE_CHECKING:
    from constrained_spec.server.app import Server

logger = logging.getLogger(__name__)

_GONE = object()  # the stream's queue item for "the client went away"


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


async def disconnected(request: Request) -> None:
    """Return once the client has gone away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, list[int] | None]]:
    """Token ids of all choices as they arrive, and ``(choice, None)`` when one finishes."""
    queue: asyncio.Queue[tuple[Choice, list[int] | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        async for ids in choice.ticket:
            queue.put_nowait((choice, ids))
        queue.put_nowait((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(choices)
        while running:
            choice, ids = await queue.get()
            running -= ids is None
            yield choice, ids
    finally:
        for t in tasks:
            t.cancel()


async def run_choices(choices: Sequence[Choice],
                      on_text: Callable[[Choice, str], Awaitable[None]] | None = None,
                      on_done: Callable[[Choice], Awaitable[None]] | None = None,
                      on_thought: Callable[[Choice, str], Awaitable[None]] | None = None) -> None:
    """Consume every choice's tokens; cancel a choice at its stop string (which applies to
    the answer: a reasoning model's thinking goes to ``on_thought``)."""
    async for choice, ids in _events(choices):
        if ids is None:
            if on_done is not None:
                await on_done(choice)
            continue
        thought, ids = choice.split(ids)
        if thought and choice.thought is not None:
            told = choice.thought.feed(thought)
            if told and on_thought is not None:
                await on_thought(choice, told)
        if not ids:
            continue
        delta = choice.text.feed(ids)
        if choice.text.stopped:
            choice.ticket.cancel()
        if delta and on_text is not None:
            await on_text(choice, delta)


def usage(choices: Sequence[Choice], outcomes: Sequence[Outcome]) -> dict[str, int]:
    """OpenAI's ``usage``: the prompt once, the completion tokens of every choice's outcome."""
    prompt = len(choices[0].request.prompt_ids)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _delta(choice: Choice, content: dict[str, Any],
           finish_reason: str | None = None) -> dict[str, Any]:
    """One choice's item of a ``chat.completion.chunk``: its ``delta`` and ``finish_reason``."""
    return {"index": choice.index, "delta": content, "logprobs": None, "finish_reason": finish_reason}


class _ChunkProducer:
    """The producing side of a streamed completion: it runs the choices and puts everything
    the response waits on into one queue, ``out``: SSE chunks, the end (None), the client
    going away (``_GONE``) and a failure of the producer (the exception)."""

    def __init__(self, server: Server, choices: Sequence[Choice], completion_id: str, model: str,
                 include_usage: bool) -> None:
        self.server = server
        self.choices = choices
        self.completion_id = completion_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.outcomes: dict[int, Outcome] = {}  # choice index -> how it ended

    def chunk(self, items: list[dict[str, Any]], totals: dict[str, int] | None = None) -> str:
        """The SSE event of one ``chat.completion.chunk`` with ``items`` (``_delta``s) and,
        when the client asked for usage, ``totals`` (None on all but the usage chunk)."""
        data: dict[str, Any] = {"id": self.completion_id, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.model,
                                "system_fingerprint": None, "choices": items}
        if self.include_usage:
            data["usage"] = totals
        return sse(data)

    def send(self, choice: Choice, content: dict[str, Any],
             finish_reason: str | None = None) -> None:
        """Queue a chunk with one delta of ``choice``."""
        self.out.put_nowait(self.chunk([_delta(choice, content, finish_reason)]))

    def tool_deltas(self, choice: Choice, parser: StreamingToolParser, final: bool) -> None:
        """Queue OpenAI's tool-call deltas of ``choice``'s text so far: the text before the
        calls as content, then per call its id, type and name with empty arguments, then the
        arguments as they are written."""
        content, calls = parser.feed(choice.text.text, final=final)
        if content:
            self.send(choice, {"content": content})
        for call in calls:
            self.send(choice, {"tool_calls": [call]})

    async def on_text(self, choice: Choice, text: str) -> None:
        """New answer text of ``choice``: a content delta, or tool-call deltas."""
        parser = choice.tool_stream()
        if parser is not None:
            self.tool_deltas(choice, parser, final=False)
            return
        self.send(choice, {"content": text})

    async def on_thought(self, choice: Choice, text: str) -> None:
        """New reasoning text of ``choice``: a ``reasoning_content`` delta."""
        self.send(choice, {"reasoning_content": text})

    async def on_done(self, choice: Choice) -> None:
        """``choice`` finished: its outcome (an error is raised, to end the stream), the rest
        of its reasoning and of its text or calls, and its finish reason."""
        o = self.outcomes[choice.index] = await self.server.outcome_async(choice)
        if o.error is not None:
            raise o.error
        if choice.thought is not None:
            rest = choice.thought.finish()
            if rest:
                self.send(choice, {"reasoning_content": rest})
        parser = choice.tool_stream()
        if parser is not None:
            choice.text.text = choice.text.decode(choice.text.ids)
            self.tool_deltas(choice, parser, final=True)
            self.send(choice, {}, o.finish_reason)
            return
        rest = choice.text.finish(o.text)
        self.send(choice, {"content": rest} if rest else {}, o.finish_reason)

    async def produce(self) -> None:
        """Run the choices to their end, then queue the usage chunk (if asked) and the end; a
        failure is queued instead, for the response to send as an error event."""
        try:
            await run_choices(self.choices, self.on_text, self.on_done, self.on_thought)
            if self.include_usage:
                outcomes = [self.outcomes[c.index] for c in self.choices]
                self.out.put_nowait(self.chunk([], usage(self.choices, outcomes)))
            self.out.put_nowait(None)
        except Exception as e:  # noqa: BLE001 -- sent as an error event, then [DONE] (as vLLM)
            self.out.put_nowait(e)

    async def watch(self, request: Request) -> None:
        """Queue ``_GONE`` once the client has gone away."""
        await disconnected(request)
        self.out.put_nowait(_GONE)


def _error_event(error: BaseException, completion_id: str) -> str:
    """The SSE error event of a failure while streaming (logged unless it is an `APIError`)."""
    if not isinstance(error, APIError):
        logger.error("%s failed", completion_id, exc_info=error)
    e = api_error(error)
    return sse(envelope(e.message, e.type, e.param, e.code))


async def stream(server: Server, request: Request, choices: Sequence[Choice], completion_id: str,
                 model: str, include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed completion: a role chunk, text deltas as they are safe to
    send, each choice's last delta with its finish reason, the usage chunk if asked, then
    ``[DONE]``; a late error is one error event before ``[DONE]``."""
    producer = _ChunkProducer(server, choices, completion_id, model, include_usage)
    tasks = [asyncio.create_task(producer.produce()), asyncio.create_task(producer.watch(request))]
    ended = False
    try:
        yield producer.chunk([_delta(c, {"role": "assistant", "content": ""}) for c in choices])
        while (item := await producer.out.get()) is not None:
            if item is _GONE:
                return
            if isinstance(item, BaseException):
                yield _error_event(item, completion_id)
                break
            yield item
        ended = True
        yield "data: [DONE]\n\n"
    finally:
        # runs on completion, on a client disconnect (Starlette cancels the stream), on errors
        if not ended and not all(c.ticket.done for c in choices):
            logger.info("%s: client disconnected; cancelling", completion_id)
        for t in tasks:
            t.cancel()
        for c in choices:
            c.ticket.cancel()


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
