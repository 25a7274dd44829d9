"""Rendering a chat template within a time bound and a size bound.

A chat template is code (Jinja) from the model's author, run on what a client sends: the
messages, the tools and ``chat_template_kwargs``. A template that loops over one of them (a
``range`` as long as a template variable, loops inside loops over the messages' text) can run
for hours or build gigabytes from a request of a few hundred bytes, so every render here is
bounded:

- **Time**: :data:`RENDER_TIMEOUT_S` per render. Jinja renders in Python bytecode, so a render
  past its deadline is interrupted where it is: one watchdog thread (shared by every render,
  started on first use) raises an exception in the rendering thread with CPython's
  ``PyThreadState_SetAsyncExc``. That works from any thread, the server's prep pool, a caller's
  own threads, several at once, each with its own deadline. The render is a `ConfigError`
  naming ``chat_template_kwargs`` when the request has some (the likely cause), else the
  messages.
- **Size**: :data:`RENDER_CHARS_PER_TOKEN` characters per token of the model's context (only
  a prompt of the vocabulary's longest tokens could be longer and fit), :data:`RENDER_MAX_CHARS`
  where the context is not known. Every piece of text the template writes (to its output, into
  a macro's or a ``{% set %}`` block's text) is counted as it is written
  (`_count_while_rendering`), so a template that would build gigabytes stops at the limit,
  before the text exists. A tokenizer that renders without transformers' Jinja is measured
  after rendering (the time bound holds what it can build). Past the limit:
  `PromptTooLongError` (the prompt cannot fit the context), or a `ConfigError` naming the same
  option as a timeout where there is no context.

Neither bound stops one operation in C that builds a huge string at once (``'x' * n`` with
``n`` a template variable): it is interrupted when it returns, and needs a template that does
it. Without ``ctypes.pythonapi`` (an interpreter other than CPython) renders are not timed.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from constrained_spec.errors import ConfigError, PromptTooLongError

#: Seconds one render of a chat template may take. A model's own template renders a long
#: conversation in milliseconds; only a loop driven by what the request sends takes seconds.
RENDER_TIMEOUT_S = 5.0
#: Characters a rendered prompt may have per token of the model's context. A token of the
#: vocabularies in use is a few characters (of the embedded model's 49,152, 154 are over 16,
#: the longest 81): a longer prompt fits only if made of the longest tokens, and is refused
#: before it is tokenized.
RENDER_CHARS_PER_TOKEN = 64
#: The limit where the model's context is not known: 64 characters a token of a 128k context.
RENDER_MAX_CHARS = 8 * 2**20

_FIX = "send fewer or shorter messages or tools, or other chat_template_kwargs"


def render_char_limit(context: int | None) -> int:
    """The characters a render may produce for a model with ``context`` tokens (None: unknown)."""
    return RENDER_MAX_CHARS if context is None else RENDER_CHARS_PER_TOKEN * context


def render_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None, *,
                         context: int | None = None, option: str = "prompt",
                         add_generation_prompt: bool = True) -> str:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=..., tokenize=False)``
    (with ``tools`` when given) within the time and size bounds of the module docstring.

    ``context``: the model's context in tokens (the size bound; None: :data:`RENDER_MAX_CHARS`).
    ``option``: the option a timeout names (``"prompt"``, ``"chat_template_kwargs"``), and a
    text too long where there is no context (with one, it is the prompt that does not fit).
    """
    limit = render_char_limit(context)
    _count_while_rendering(tokenizer, tools)
    extra = {"tools": tools} if tools else {}

    def render() -> Any:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **extra)

    token = _BUDGET.set(_Budget(limit))
    try:
        text = _within(RENDER_TIMEOUT_S, render)
    except _TimedOut:
        raise ConfigError(f"the chat template took longer than {RENDER_TIMEOUT_S:g} s to render "
                          "(a loop in it over the messages, the tools or a template variable); "
                          + _FIX, option=option) from None
    except _TooLong:
        raise _too_long(limit, context, option) from None
    except (ConfigError, MemoryError, RecursionError):
        raise
    except Exception as e:  # noqa: BLE001 - what the template itself raised, on this request
        # a template refuses what it cannot write (raise_exception: roles that do not
        # alternate, a system message where none may be) and the sandbox what it will not run
        # (a range past 100,000): the request's doing, never the server's
        raise ConfigError(f"the chat template could not render this request: "
                          f"{type(e).__name__}: {str(e)[:300]}", option=option) from None
    finally:
        _BUDGET.reset(token)
    if isinstance(text, str) and len(text) > limit:  # a renderer that joins its text otherwise
        raise _too_long(limit, context, option)
    return text


def _too_long(limit: int, context: int | None, option: str) -> ConfigError:
    if context is None:
        return ConfigError(f"the chat template rendered more than {limit:,} characters (the "
                           f"limit where the model's context is not known); {_FIX}", option=option)
    return PromptTooLongError(
        f"the chat template rendered more than {limit:,} characters, longer than a prompt that "
        f"fits the model's context of {context:,} tokens can be at {RENDER_CHARS_PER_TOKEN} "
        f"characters a token; {_FIX}", option="prompt")


# -- size: every piece of text the template writes is counted -------------------------------

class _TooLong(Exception):
    """The render wrote more than its character limit."""


class _Budget:
    """The characters the render running in this thread may still write."""

    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def spend(self, piece: object) -> None:
        # an empty piece costs one: a loop that writes '' must not fill memory with them either
        self.left -= (len(piece) if isinstance(piece, str) else 0) or 1
        if self.left < 0:
            raise _TooLong


# the budget of the render running in this thread (None: no render of ours)
_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


class _CountedBuffer(list[Any]):
    """The list a template compiled by `_counting_generator` writes a macro's, a ``{% set %}``
    block's or a call block's text into: each piece is counted as it is written."""

    def append(self, piece: object) -> None:
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend(piece)
        super().append(piece)

    def extend(self, pieces: Iterable[object]) -> None:
        pieces = tuple(pieces)  # Jinja writes a few pieces at once as a tuple
        budget = _BUDGET.get()
        if budget is not None:
            for piece in pieces:
                budget.spend(piece)
        super().extend(pieces)


def _bounded_concat(pieces: Iterable[str]) -> str:
    """``"".join(pieces)``, stopped as soon as the render running in this thread passes its
    limit; a plain join outside one, so others rendering the template see no change."""
    budget = _BUDGET.get()
    if budget is None or isinstance(pieces, _CountedBuffer):  # counted as they were written
        return "".join(pieces)
    kept: list[str] = []
    for piece in pieces:  # the output (a generator: counted while the template runs), or the
        budget.spend(piece)  # buffer of a template compiled without _CountedBuffer
        kept.append(piece)
    return "".join(kept)


@functools.cache
def _counting_generator() -> type:
    """Jinja's code generator, with every buffer a `_CountedBuffer`."""
    from jinja2.compiler import CodeGenerator, Frame

    class CountingCodeGenerator(CodeGenerator):
        def buffer(self, frame: Frame) -> None:
            super().buffer(frame)
            self.writeline(f"{frame.buffer} = environment.counted_buffer()")

    return CountingCodeGenerator


# templates (compiled by transformers) that count what they write, and the lock to change one
_COUNTED: weakref.WeakSet[Any] = weakref.WeakSet()
_COUNTED_LOCK = threading.Lock()


def _count_while_rendering(tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
    """Make the template transformers renders for ``tokenizer`` count what it writes.

    transformers compiles a template once (``_compile_jinja_template``, cached by its text) in
    an environment of its own, so this finds the template its ``apply_chat_template`` renders.
    Its environment joins texts through `_bounded_concat` (Jinja's ``Environment.concat``, read
    on every join: the output is counted as it is generated), and the template is compiled again
    in that environment with `_CountedBuffer` buffers, which count the texts a macro or a
    ``{% set %}`` block holds before they are joined (a list of a billion references to one
    string is gigabytes too). Where the second step fails (another Jinja), buffers are counted
    when they are joined; for another tokenizer, the text is measured after rendering.
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        source = tokenizer.get_chat_template(None, tools or None)
        template = _compile_jinja_template(source)
        environment = template.environment
    except Exception:  # noqa: BLE001 - another tokenizer or transformers: measured after rendering
        return
    with _COUNTED_LOCK:
        if template in _COUNTED:
            return
        environment.concat = _bounded_concat
        try:
            environment.counted_buffer = _CountedBuffer
            environment.code_generator_class = _counting_generator()
            # the same template, compiled in the same environment: only its buffers differ
            vars(template).update(vars(environment.from_string(source)))
        except Exception:  # noqa: BLE001 - buffers are then counted when joined
            pass
        _COUNTED.add(template)


# -- time: one watchdog thread interrupts each render at its deadline ------------------------

class _Interrupt(BaseException):
    """Raised in a rendering thread at its deadline. Not an `Exception`: the ``except
    Exception`` on the way (Jinja's, transformers') must not take it for the template's error."""


class _TimedOut(Exception):
    """The render was interrupted at its deadline."""


class _Watch:
    """One render: the thread that runs it, its deadline, whether it has been interrupted."""

    __slots__ = ("deadline", "thread", "sent")

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.thread = threading.get_ident()
        self.sent = False


def _set_async_exc(thread: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in ``thread`` at its next bytecode boundary (None: cancel a pending one)."""
    api = getattr(ctypes, "pythonapi", None)
    if api is not None:
        api.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                      None if exc is None else ctypes.py_object(exc))


class _Watchdog:
    """One daemon thread that interrupts each watched render once, at its deadline.

    Starting and stopping a watch takes a lock once (a thread per render costs more than most
    renders); the thread sleeps until the earliest deadline and is woken only for a watch due
    before that. An interrupt is sent under the lock and its watch leaves the set then, and
    `stop` takes a watch out under the same lock, so none is sent after `stop` has taken the
    lock, and one sent just before is cancelled there: it cannot surface after the render, in
    the caller's code. A rendering thread takes the lock with ``with`` on a plain `Lock`
    (acquired in C, released by the ``with`` whatever is raised after), never through
    `Condition`'s Python ``__enter__``, where an interrupt between the acquire and the ``with``
    would leave the lock held. One interrupt per render: repeating it could surface after the
    render, and only foreign code that swallows a `BaseException` would need it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._watches: set[_Watch] = set()
        self._wakes_at = math.inf  # when the thread next looks at the deadlines
        self._thread: threading.Thread | None = None

    def start(self, watch: _Watch) -> None:
        # nothing is sent to this thread before the watch is in the set, nor while the lock is
        # held: no interrupt can land in here
        with self._lock:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="chat-template-watchdog")
                self._thread.start()
            elif watch.deadline < self._wakes_at:
                self._wake.notify()

    def stop(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.discard(watch)
        if watch.sent:  # it may still be pending (sent as the render ended): cancelled here
            _set_async_exc(watch.thread, None)

    def _run(self) -> None:
        with self._wake:
            while True:
                now = time.monotonic()
                for watch in [w for w in self._watches if w.deadline <= now]:
                    self._watches.discard(watch)
                    watch.sent = True
                    _set_async_exc(watch.thread, _Interrupt)
                self._wakes_at = min((w.deadline for w in self._watches), default=math.inf)
                self._wake.wait(None if self._wakes_at == math.inf else self._wakes_at - now)


_WATCHDOG = _Watchdog()


def _new_watchdog() -> None:
    global _WATCHDOG
    _WATCHDOG = _Watchdog()  # a forked child has none of its parent's threads, nor its locks


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_watchdog)


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``, or `_TimedOut` where it runs past ``seconds``.

    The interrupt can land anywhere from `_Watchdog.start` to the cancel in `_Watchdog.stop`,
    in ``call`` or around it: all of that is inside the ``try`` that catches it, and nothing is
    pending once ``stop`` has returned (or was itself interrupted: the one interrupt has landed).
    """
    watchdog, watch = _WATCHDOG, _Watch(seconds)
    try:
        try:
            watchdog.start(watch)
            return call()
        finally:
            watchdog.stop(watch)
    except _Interrupt:
        raise _TimedOut from None
