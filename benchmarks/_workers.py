"""Worker processes for the JSONSchemaBench sweeps (coverage.py, grammar.py): one schema at a
time per process, hung or dead workers replaced. Also the environment of a benchmark module
started as its own process (:func:`module_env`).

A worker is ``target(conn, *args)``. It sends ``("ready", None, None, None)`` once started, then
for every task ``(index, row)`` it receives: one ``("part", index, system, result)`` per system
and ``("done", index, None, retire)``. With ``retire`` true it exits after that message and is
replaced (an abandoned compile thread would keep a core busy and skew what runs next). ``None``
asks it to stop. A worker that sends nothing for ``hard_limit`` seconds on one task, or dies, is
killed and replaced; the systems it had not reported get ``{"status": "hang" | "crash"}``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def module_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the repository root first on ``PYTHONPATH``: a child started as
    ``python -m benchmarks.<name>`` then imports the package from any working directory."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    return env


class Pool:
    """Worker processes fed one schema at a time; hung or dead workers are replaced."""

    def __init__(self, n: int, target: Callable[..., None], args: tuple, systems: tuple[str, ...],
                 hard_limit: float, preload: Iterable[str] = ()) -> None:
        self.target = target
        self.args = args
        self.systems = systems
        self.hard_limit = hard_limit
        # forkserver: workers start from a process that imported the heavy modules once, so a
        # replaced worker is ready in about a second (per-worker state is still built per worker)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(preload))
        self.workers: list[dict] = [self._start() for _ in range(n)]

    def _start(self) -> dict:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
        proc.start()
        child.close()
        return {"proc": proc, "conn": parent, "task": None, "since": 0.0, "parts": {},
                "ready": False}

    def run(self, rows: list[tuple[int, dict]], on_done: Any) -> None:
        """Hand every ``(index, row)`` to a worker; ``on_done((index, row), {system: result})``."""
        todo = list(reversed(rows))
        busy = 0
        while todo or busy:
            for w in self.workers:
                if w["ready"] and w["task"] is None and todo:
                    w["task"] = todo.pop()
                    w["since"] = time.monotonic()
                    w["parts"] = {}
                    w["conn"].send(w["task"])
                    busy += 1
            conns = [w["conn"] for w in self.workers]
            ready = wait(conns, timeout=1.0)
            for w in list(self.workers):
                replace = False
                if w["conn"] in ready:
                    try:
                        kind, _index, system, payload = w["conn"].recv()
                    except (EOFError, OSError):
                        kind = "dead"
                    if kind == "ready":
                        w["ready"] = True
                    elif kind == "part":
                        w["parts"][system] = payload
                    elif kind == "done":
                        on_done(w["task"], w["parts"])
                        w["task"] = None
                        busy -= 1
                        replace = bool(payload)
                    else:  # the worker died (segfault, out of memory)
                        replace = True
                        if w["task"] is not None:
                            self._fail(w, "crash", on_done)
                            busy -= 1
                elif w["task"] is not None and time.monotonic() - w["since"] > self.hard_limit:
                    self._fail(w, "hang", on_done)
                    busy -= 1
                    replace = True
                elif not w["proc"].is_alive() and w["conn"] not in ready:
                    replace = True
                    if w["task"] is not None:
                        self._fail(w, "crash", on_done)
                        busy -= 1
                if replace:
                    self._replace(w)

    def _fail(self, w: dict, status: str, on_done: Any) -> None:
        parts = dict(w["parts"])
        for system in self.systems:
            parts.setdefault(system, {"status": status,
                                      "error": f"worker {status} after {self.hard_limit:.0f} s"
                                      if status == "hang" else "worker process died"})
        on_done(w["task"], parts)
        w["task"] = None

    def _replace(self, w: dict) -> None:
        if w["proc"].is_alive():
            w["proc"].kill()
        w["proc"].join(timeout=5)
        w["conn"].close()
        self.workers[self.workers.index(w)] = self._start()

    def close(self) -> None:
        for w in self.workers:
            try:
                w["conn"].send(None)
            except OSError:
                pass
        for w in self.workers:
            w["proc"].join(timeout=5)
            if w["proc"].is_alive():
                w["proc"].kill()
