"""Hear what a grammar backend logs while it converts or compiles a schema.

xgrammar (C++) does not raise for a keyword it cannot represent exactly: it writes a line to
the process's file descriptor 2 (``std::cerr``, its ``XGRAMMAR_LOG(WARNING)``; the wheel has no
logging hook) and carries on, e.g. "oneOf with overlapping or non-provably-disjoint branches
... falling back to anyOf semantics" or "Lookahead assertion is not supported and is ignored in
regex: ...". Those lines are facts about what the grammar enforces, so they belong in the
pre-flight report, not on the user's terminal. outlines-core logs nothing (it drops keywords
silently; the pre-flight walker knows which), but is heard the same way in case it ever does.

How: while a conversion or a compile runs, fd 2 points at an unnamed temporary file (a file,
not a pipe: however much is written, no writer ever blocks, so nothing can deadlock; it is read
back with ``pread``, which leaves the writers' shared offset alone). The redirection is shared:
the first session redirects, the last one restores, and each session reads back what was
written during its own window. Lines in the backend's log format become `BackendMessage` s;
every other line (another thread's traceback, a server's log) is written on to the real stderr
when a session ends, in order, so nothing else is lost.

Attribution: while fd 2 is redirected, every thread's output lands in the same file, so a
session can see a line that another session's backend call wrote. Conversions are cheap and run
one at a time (`hear_conversion`); compiles can take seconds, so they share the redirection
(`hear_compile`) rather than queue behind each other. A line that names its subject (the regex
of a look-ahead warning, the escape of an escape warning) is kept only by the session whose
backend input contains that subject; a JSON Schema converter line only by a conversion.

Limits: a session's lines reach the real stderr when it ends (a long compile delays other
threads' stderr until then, and output written just before a hard crash inside the window is
lost with the file); a process without an fd 2 is not redirected (nothing is heard, nothing
leaks).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["BackendMessage", "hear_compile", "hear_conversion", "parse_log_line"]


@dataclass(frozen=True)
class BackendMessage:
    """One line a backend logged: which backend, its level ("warning", "error", "info",
    "debug"), where in the backend's source (``"json_schema_converter.cc:870"``) and the text."""

    backend: str
    level: str
    source: str
    text: str

    def format(self) -> str:
        return f"{self.backend} {self.level} ({self.source}): {self.text}"


# xgrammar's default logger: "[hh:mm:ss] /path/to/file.cc:LINE: Warning: text" (the level is
# left out for INFO)
_XGRAMMAR_LINE = re.compile(
    r"^\[\d{1,2}:\d{2}:\d{2}\] (?P<file>\S+?):(?P<line>\d+): "
    r"(?:(?P<level>Debug|Warning|Error): )?(?P<text>.*?)\s*$")


def parse_log_line(line: str, backend: str = "xgrammar") -> BackendMessage | None:
    """The `BackendMessage` of one line in the backend's log format, else None."""
    m = _XGRAMMAR_LINE.match(line)
    if m is None:
        return None
    return BackendMessage(backend, (m.group("level") or "info").lower(),
                          f"{os.path.basename(m.group('file'))}:{m.group('line')}", m.group("text"))


def _flush_python_stderr() -> None:
    # text Python buffered for fd 2 must land where fd 2 pointed when it was written
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


class _Tap:
    """The shared redirection of fd 2 (see the module docstring). All state under `lock`,
    which is never held while waiting for anything but a write to the temporary file or to the
    real stderr."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved = -1  # a duplicate of the real fd 2 while redirected
        self.sink: Any = None  # the temporary file (opened for appending)
        self.forwarded = 0  # bytes of the sink already sorted into messages / forwarded

    def open(self) -> int | None:
        """Start a session: the sink's size now (where its window starts), or None when fd 2
        cannot be redirected."""
        with self.lock:
            if self.users == 0:
                _flush_python_stderr()
                if not hasattr(os, "pread"):
                    return None  # reading back would move the writers' shared file offset
                try:
                    saved = os.dup(2)
                except OSError:
                    return None
                sink = tempfile.TemporaryFile()
                os.dup2(sink.fileno(), 2)
                self.saved, self.sink, self.forwarded = saved, sink, 0
            self.users += 1
            return os.fstat(self.sink.fileno()).st_size

    def close(self, start: int) -> bytes:
        """End a session: what was appended to fd 2 during its window; other lines are sent on
        to the real stderr, and the last session puts fd 2 back."""
        with self.lock:
            _flush_python_stderr()
            fd = self.sink.fileno()
            end = os.fstat(fd).st_size
            window = self._read(fd, start, end)
            last = self.users == 1
            self._forward(fd, end, last)
            self.users -= 1
            if last:
                os.dup2(self.saved, 2)
                os.close(self.saved)
                self.sink.close()
                self.saved, self.sink = -1, None
            return window

    @staticmethod
    def _read(fd: int, start: int, end: int) -> bytes:
        # pread: the file offset, which fd 2 shares and every write advances, is never moved
        chunks, at = [], start
        while at < end:
            chunk = os.pread(fd, min(end - at, 1 << 20), at)
            if not chunk:
                break
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks)

    def _forward(self, fd: int, end: int, everything: bool) -> None:
        """The complete lines (all of it when `everything`) since the last forward that are not
        backend log lines, written to the real stderr."""
        data = self._read(fd, self.forwarded, end)
        cut = len(data) if everything else data.rfind(b"\n") + 1
        others = b"".join(line for line in data[:cut].splitlines(keepends=True)
                          if parse_log_line(line.decode("utf-8", "replace")) is None)
        self.forwarded += cut
        view = memoryview(others)
        while view:
            try:
                view = view[os.write(self.saved, view):]
            except OSError:  # the real stderr is gone: nothing more can be shown
                break


_TAP = _Tap()
_CONVERSION_LOCK = threading.RLock()  # re-entrant: a conversion inside one is still its own


def _subject(message: BackendMessage) -> str | None:
    """The part of the input a message names, when it names one: the regex after "regex: " /
    "is ignored: ", the escape of an unknown-escape warning."""
    m = re.search(r"(?:in regex|is ignored): (.+)$", message.text)
    if m:
        return m.group(1)
    m = re.match(r"Escape sequence (\\\S+) ", message.text)
    return m.group(1) if m else None


def _belongs(message: BackendMessage, own_input: str, conversion: bool) -> bool:
    if not conversion and message.source.startswith("json_schema_converter"):
        return False  # a compile never runs the JSON Schema converter: another thread's line
    subject = _subject(message)
    if subject is None:
        return True
    return subject in own_input or json.dumps(subject, ensure_ascii=False)[1:-1] in own_input


@contextmanager
def _hear(backend: str, own_input: str, conversion: bool) -> Iterator[list[BackendMessage]]:
    heard: list[BackendMessage] = []
    start = _TAP.open()
    try:
        yield heard
    finally:
        if start is not None:
            window = _TAP.close(start).decode("utf-8", "replace")
            seen: set[BackendMessage] = set()
            for line in window.splitlines():
                message = parse_log_line(line, backend)
                if message is not None and message not in seen and _belongs(
                        message, own_input, conversion):
                    seen.add(message)
                    heard.append(message)


@contextmanager
def hear_conversion(backend: str, own_input: str) -> Iterator[list[BackendMessage]]:
    """Run the block (a backend building a grammar from `own_input`: a JSON Schema's text, a
    regex, an EBNF grammar) with fd 2 redirected; the list it yields holds, once the block is
    done, what the backend logged (each message once). One conversion at a time."""
    with _CONVERSION_LOCK, _hear(backend, own_input, conversion=True) as heard:
        yield heard


@contextmanager
def hear_compile(backend: str, own_input: str) -> Iterator[list[BackendMessage]]:
    """As `hear_conversion`, for a compile of a grammar built from `own_input` (for the
    tokenizer); compiles run side by side."""
    with _hear(backend, own_input, conversion=False) as heard:
        yield heard
