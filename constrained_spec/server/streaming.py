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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from constrained_spec.frontend.tools import StreamingToolParser
from constrained_spec.server.choices import Choice, Outcome, response_warnings
from constrained_spec.server.logprobs import chat_logprobs, completion_logprobs
from constrained_spec.server.protocol import APIError, api_error, envelope

if TYPE_CHECKING:
    from constrained_spec.server.state import Server


logger = logging.getLogger(__name__)


_GONE = object()  # the stream's queue item for "the client went away"


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


def usage(choices: Sequence[Choice], outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """OpenAI's ``usage``: the prompt once, the completion tokens of every choice's outcome,
    and in ``prompt_tokens_details.cached_tokens`` the prompt tokens the runner read from its
    prefix cache instead of computing (model/prefix_cache.py)."""
    prompt = len(choices[0].request.prompt_ids)
    completion = sum(o.completion_tokens for o in outcomes)
    cached = choices[0].request.stats.cached_prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _delta(choice: Choice, content: dict[str, Any], finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice's item of a ``chat.completion.chunk``: its ``delta``, ``logprobs`` (of the
    tokens behind the delta's text, when asked) and ``finish_reason``."""
    return {"index": choice.index, "delta": content, "logprobs": logprobs,
            "finish_reason": finish_reason}


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

    object = "chat.completion.chunk"

    def first(self) -> list[str]:
        """The events before any text: a chunk with every choice's role (and the schema's
        ``warnings``, if any)."""
        warned = response_warnings(self.choices, (), self.server.config.backend)
        return [self.chunk([_delta(c, {"role": "assistant", "content": ""}) for c in self.choices],
                           warnings=warned.get("warnings"))]

    def totals(self, outcomes: Sequence[Outcome]) -> dict[str, Any]:
        return usage(self.choices, outcomes)

    def chunk(self, items: list[dict[str, Any]], totals: dict[str, Any] | None = None,
              warnings: list[dict[str, Any]] | None = None) -> str:
        """The SSE event of one chunk (``object``) with ``items`` (``_delta``s) and,
        when the client asked for usage, ``totals`` (None on all but the usage chunk);
        ``warnings`` when there are any (`choices.response_warnings`)."""
        data: dict[str, Any] = {"id": self.completion_id, "object": self.object,
                                "created": self.created, "model": self.model,
                                "system_fingerprint": None, "choices": items}
        if self.include_usage:
            data["usage"] = totals
        if warnings:
            data["warnings"] = warnings
        return sse(data)

    def send(self, choice: Choice, content: dict[str, Any],
             finish_reason: str | None = None, warnings: list[dict[str, Any]] | None = None
             ) -> None:
        """Queue a chunk with one delta of ``choice`` (and the logprobs of the tokens behind its
        content, when the request asked)."""
        entries, _ = choice.stream_logprobs(content.get("content") or "")
        logprobs = None if entries is None else chat_logprobs(choice.decoded, entries)
        self.out.put_nowait(self.chunk([_delta(choice, content, finish_reason, logprobs)],
                                       warnings=warnings))

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
            self.send(choice, {}, o.finish_reason, o.warnings)
            return
        rest = choice.text.finish(o.text)
        self.send(choice, {"content": rest} if rest else {}, o.finish_reason, o.warnings)

    async def produce(self) -> None:
        """Run the choices to their end, then queue the usage chunk (if asked) and the end; a
        failure is queued instead, for the response to send as an error event."""
        try:
            await run_choices(self.choices, self.on_text, self.on_done, self.on_thought)
            if self.include_usage:
                outcomes = [self.outcomes[c.index] for c in self.choices]
                self.out.put_nowait(self.chunk([], self.totals(outcomes)))
            self.out.put_nowait(None)
        except Exception as e:  # noqa: BLE001 -- sent as an error event, then [DONE] (as vLLM)
            self.out.put_nowait(e)

    async def watch(self, request: Request) -> None:
        """Queue ``_GONE`` once the client has gone away."""
        await disconnected(request)
        self.out.put_nowait(_GONE)


class TextChunkProducer(_ChunkProducer):
    """The producer of a streamed ``/v1/completions`` response: ``text_completion`` chunks with
    each choice's ``text`` (after ``echo``'s prompt text, when asked), no role chunk."""

    object = "text_completion"

    def __init__(self, server: Server, choices: Sequence[Choice], completion_id: str, model: str,
                 include_usage: bool, echo: Mapping[int, str]) -> None:
        super().__init__(server, choices, completion_id, model, include_usage)
        self.echo = echo

    def first(self) -> list[str]:
        """The echoed prompts, the schema's ``warnings`` (if any) on the first chunk."""
        warned = response_warnings(self.choices, (), self.server.config.backend).get("warnings")
        items = [self._item(c, text) for c in self.choices if (text := self.echo.get(c.index))]
        if not items and not warned:
            return []
        return [self.chunk(items[:1], warnings=warned)] + [self.chunk([i]) for i in items[1:]]

    def totals(self, outcomes: Sequence[Outcome]) -> dict[str, Any]:
        from constrained_spec.server.completions import completion_usage

        return completion_usage(self.choices, outcomes)

    def _item(self, choice: Choice, text: str, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def send(self, choice: Choice, content: dict[str, Any],
             finish_reason: str | None = None, warnings: list[dict[str, Any]] | None = None
             ) -> None:
        text = content.get("content", "")
        entries, at = choice.stream_logprobs(text)
        logprobs = None if entries is None else completion_logprobs(
            choice.decoded, entries, len(self.echo.get(choice.index, "")) + at)
        self.out.put_nowait(self.chunk([self._item(choice, text, finish_reason, logprobs)],
                                       warnings=warnings))


def _error_event(error: BaseException, completion_id: str) -> str:
    """The SSE error event of a failure while streaming (logged unless it is an `APIError`)."""
    if not isinstance(error, APIError):
        logger.error("%s failed", completion_id, exc_info=error)
    e = api_error(error)
    return sse(envelope(e.message, e.type, e.param, e.code))


async def stream(server: Server, request: Request, choices: Sequence[Choice], completion_id: str,
                 model: str, include_usage: bool, *,
                 echo: Mapping[int, str] | None = None) -> AsyncIterator[str]:
    """The SSE events of a streamed completion: a role chunk, text deltas as they are safe to
    send, each choice's last delta with its finish reason, the usage chunk if asked, then
    ``[DONE]``; a late error is one error event before ``[DONE]``. With ``echo`` (a dict, empty
    or not): ``/v1/completions``' ``text_completion`` chunks, the echoed prompt text first."""
    producer = (_ChunkProducer(server, choices, completion_id, model, include_usage)
                if echo is None else
                TextChunkProducer(server, choices, completion_id, model, include_usage, echo))
    tasks = [asyncio.create_task(producer.produce()), asyncio.create_task(producer.watch(request))]
    ended = False
    try:
        for event in producer.first():
            yield event
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
