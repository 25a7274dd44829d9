"""Grammar compiles in child processes, where a deadline is enforced (the server's mode).

xgrammar compiles in C++ without yielding, so a thread running a compile cannot be stopped:
past `compile_spec`'s timeout its caller gets a `SchemaError`, but the compile keeps a core
and its memory until it ends. A child process can be stopped. `CompileWorkers` keeps up to
``processes`` children per tokenizer; each is told the tokenizer once (xgrammar's
``TokenizerInfo``, serialized) and then compiles one spec at a time, sending the result back
serialized (xgrammar's ``CompiledGrammar.serialize_json``, outlines-core's ``Index`` pickled:
a few ms beside a compile's tens). A compile past its deadline kills its child, with its CPU
time and memory, and a fresh child is started in the background for the next compile.

The children are started as the kernel-plan child is (`constrained_spec.child`):
``python -P -m constrained_spec.grammar.compile_child`` with ``PYTHONSAFEPATH`` and only
absolute ``PYTHONPATH`` entries, in a private empty folder, so nothing in the caller's folder
is imported. Requests come on the child's stdin, replies go out on its stdout (length-
prefixed pickles between this package and itself); the child ends at EOF on stdin, so it ends
with its parent however the parent dies.
"""

from __future__ import annotations

import logging
import pickle
import select
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import replace
from typing import IO, Any

from constrained_spec.child import python_child
from constrained_spec.errors import SchemaError

__all__ = ["CompileWorkers"]

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("<Q")
#: seconds a new child may take to import the package and read the tokenizer
START_TIMEOUT_S = 120.0


def write_message(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at EOF."""
    header = _read_exact(stream, _HEADER.size)
    if header is None:
        return None
    data = _read_exact(stream, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


class _Child:
    """One compile process, holding one tokenizer."""

    def __init__(self, tok: Any) -> None:
        self.folder = tempfile.mkdtemp(prefix="constrained-spec-compile-")
        cmd, env = python_child("-m", "constrained_spec.grammar.compile_child")
        self.proc = subprocess.Popen(cmd, cwd=self.folder, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        # replies are read unbuffered: `select` sees the pipe, not what a buffer read ahead
        self.stdin = self.proc.stdin
        self.stdout = open(self.proc.stdout.fileno(), "rb", buffering=0, closefd=False)
        try:
            write_message(self.stdin, tok.xgr_info.serialize_json())
            reply = self._reply(time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if reply != ("ready", tok.key):
            self.kill()
            raise RuntimeError(f"the compile process did not start: {reply!r:.200}")

    def _reply(self, deadline: float) -> Any:
        """The child's next message, or TimeoutError at ``deadline``."""
        left = deadline - time.monotonic()
        ready, _, _ = select.select([self.stdout], [], [], max(left, 0.0))
        if not ready:
            raise TimeoutError
        reply = read_message(self.stdout)
        if reply is None:
            raise RuntimeError(f"the compile process ended (exit code {self.proc.wait()})")
        return reply

    def compile(self, spec: Any, backend: str, deadline: float) -> Any:
        write_message(self.stdin, (replace(spec, target=None), backend))
        return self._reply(deadline)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait()
        except OSError:
            pass
        self._close()

    def close(self) -> None:
        """End the child the way it ends with its parent: EOF on its stdin."""
        try:
            self.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        for stream in (self.stdin, self.stdout, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


class CompileWorkers:
    """Up to ``processes`` compile processes per tokenizer (see the module docstring)."""

    def __init__(self, processes: int = 2) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = processes
        self._idle: dict[str, list[_Child]] = {}
        self._count: dict[str, int] = {}
        self._changed = threading.Condition()
        self._closed = False
        #: compiles stopped at their deadline (their child killed)
        self.killed = 0

    def start(self, tok: Any, *, wait: bool = True) -> None:
        """Start one child for ``tok`` unless one runs (a server does this before serving,
        with ``wait=False``: in the background, a few seconds of importing xgrammar)."""
        with self._changed:
            if self._count.get(tok.key, 0):
                return
            self._count[tok.key] = 1
        if wait:
            self._add(tok)
        else:
            self._add_soon(tok)

    def _add(self, tok: Any) -> None:
        """A new idle child for ``tok`` (its place already counted)."""
        try:
            child = _Child(tok)
        except BaseException:
            with self._changed:
                self._count[tok.key] -= 1
                self._changed.notify_all()
            raise
        self._release(tok, child)

    def _release(self, tok: Any, child: _Child) -> None:
        with self._changed:
            if self._closed:
                child.close()
                return
            self._idle.setdefault(tok.key, []).append(child)
            self._changed.notify_all()

    def _acquire(self, tok: Any, deadline: float) -> _Child:
        """An idle child for ``tok``: one waiting, a new one while fewer than ``processes``
        run, else the first to come free (TimeoutError at ``deadline``)."""
        while True:
            with self._changed:
                if self._closed:
                    raise RuntimeError("the compile processes were closed")
                idle = self._idle.get(tok.key)
                if idle:
                    return idle.pop()
                start = self._count.get(tok.key, 0) < self.processes
                if start:
                    self._count[tok.key] = self._count.get(tok.key, 0) + 1
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self._changed.wait(left)
            if start:
                self._add(tok)  # outside the lock (a start takes seconds); then taken above

    def compile(self, spec: Any, tok: Any, backend: str, timeout_s: float | None) -> tuple[Any, Any]:
        """(the backend object, what the backend logged) for ``spec``, compiled in a child.

        Raises
        ------
        SchemaError
            The backend cannot compile the spec, or it took longer than ``timeout_s`` (its
            child is then killed).
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 10 ** 9)
        child: _Child | None = None
        try:
            child = self._acquire(tok, deadline)
            reply = child.compile(spec, backend, deadline)
        except TimeoutError:
            if child is not None:
                self._lose(tok, child, replace_it=True)
            raise stopped_error(spec, timeout_s, backend) from None
        except BaseException:
            if child is not None:  # it died or its pipe broke: the next compile starts one
                self._lose(tok, child, replace_it=False)
            raise
        self._release(tok, child)
        if reply[0] == "err":
            _, text, keyword, pointer, where = reply
            error = SchemaError(text)  # its text already names where
            error.keyword, error.pointer, error.backend = keyword, pointer, where
            raise error
        return _load(reply[1], tok, backend), reply[2]

    def _lose(self, tok: Any, child: _Child, *, replace_it: bool) -> None:
        """Kill ``child``; with ``replace_it``, start its successor in the background."""
        child.kill()
        self.killed += replace_it
        with self._changed:
            if not replace_it or self._closed:
                self._count[tok.key] -= 1
                self._changed.notify_all()
                return
        self._add_soon(tok)

    def _add_soon(self, tok: Any) -> None:
        """`_add` in the background; a failure is logged (the next compile starts one)."""
        def add() -> None:
            try:
                self._add(tok)
            except BaseException as e:  # noqa: BLE001 - logged; the next compile starts one
                logger.warning("could not start a compile process: %s", e)
        threading.Thread(target=add, daemon=True, name="compile-worker-start").start()

    def close(self) -> None:
        """End every child (idle ones now; busy ones when their compile returns)."""
        with self._changed:
            self._closed = True
            children = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            self._changed.notify_all()
        for child in children:
            child.close()


def stopped_error(spec: Any, timeout_s: float | None, backend: str) -> SchemaError:
    """The error of a compile stopped at its deadline (its child killed)."""
    return SchemaError(f"compiling the {spec.kind} spec took longer than {timeout_s} s and was "
                       "stopped; simplify the schema", backend=backend)


def _load(payload: Any, tok: Any, backend: str) -> Any:
    """The backend object from a child's serialized compile."""
    if backend == "xgrammar":
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(payload, tok.xgr_info)
    from .matcher import _OutlinesTables

    return _OutlinesTables(pickle.loads(payload), tok)
