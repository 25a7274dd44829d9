"""Serving: ONE engine stepped by a background thread, fed by asyncio request handlers.

    loop = EngineLoop(generator.new_engine(), max_batch_size=8, max_queue=64)
    loop.start()
    req, spec = generator.make_request(messages, schema=Person)
    [ticket] = loop.submit([req])        # QueueFullError when the queue is full
    async for ids in ticket: ...         # accepted token ids, as the engine commits them
    req = await ticket.wait()            # finished: req.finish_reason, req.output_ids
    ticket.cancel()                      # client gone: finished "cancelled" at the next step
    loop.stop()

Design. The engine thread owns the :class:`~constrained_spec.generation.engine.Engine`; nothing else
touches it. Between two steps it admits waiting requests into the free slots (continuous
batching: requests join and leave between steps, each with its own schema matcher) and
hands finished ones back. Handlers only append to the waiting queue and set
``Request.cancelled``, under one lock. Tokens travel back to the handler's event loop with
``loop.call_soon_threadsafe``, so an asyncio handler never blocks on the engine.

Bounds: at most ``max_batch_size`` requests run; at most ``max_batch_size + max_queue``
are in the loop at once (running + waiting), so ``max_queue`` requests wait when every slot
is taken. ``submit`` refuses past that (all of a multi-request submit or none of it).

Isolation is the engine's (`Engine.admit`, `Engine.safe_step`, both built on
:func:`~constrained_spec.generation.engine.contain`): a request that fails to be admitted fails alone
(the batch is admitted again one by one); inside a step the engine fails only the request
whose grammar, drafter or ``on_tokens`` callback raised (a
:class:`~constrained_spec.errors.GenerationError` on ``Request.error``), and a failure of the
shared target forward ends the requests of that step only; a streaming consumer that went
away cancels only its request. A step that still raises (a bug) ends the requests of that
step with ``finish_reason == "error"``; in every case the loop keeps serving, and finished
requests' slots go back to the runner.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from constrained_spec.errors import ConfigError, ConstrainedSpecError
from constrained_spec.generation.engine import Request, contain
from constrained_spec.generation.protocols import BatchEngine
from constrained_spec.generation.stats import SpecStats

logger = logging.getLogger(__name__)

#: Upper bounds (seconds) of the request-latency histogram buckets (Prometheus' defaults, longer).
LATENCY_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class QueueFullError(ConstrainedSpecError):
    """The loop already holds ``max_batch_size`` running + ``max_queue`` waiting requests."""


@dataclass
class ServingMetrics:
    """Counters of one :class:`EngineLoop` (read with :meth:`snapshot`; thread-safe)."""

    tokens_per_s_window: float = 10.0
    submitted: int = 0
    rejected: int = 0
    finished: Counter = field(default_factory=Counter)  # finish_reason -> requests
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_s: float = 0.0
    failed_steps: int = 0
    spec: SpecStats = field(default_factory=SpecStats)  # summed over finished requests
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    _recent: deque = field(default_factory=deque)  # (time, tokens) per streaming callback
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _add_tokens(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - self.tokens_per_s_window:
                self._recent.popleft()

    def _add_submitted(self, n: int, *, rejected: bool) -> None:
        with self._lock:
            if rejected:
                self.rejected += n
            else:
                self.submitted += n

    def _add_step(self, seconds: float, *, failed: bool) -> None:
        with self._lock:
            self.steps += 1
            self.step_s += seconds
            self.failed_steps += int(failed)

    def _add_finished(self, req: Request, latency: float) -> None:
        with self._lock:
            self.finished[req.finish_reason or "unknown"] += 1
            self.prompt_tokens += len(req.prompt_ids)
            self.spec = self.spec.merge(req.stats)
            self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1
            self.latency_sum += latency

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last ``tokens_per_s_window`` seconds."""
        now = time.monotonic()
        with self._lock:
            n = sum(k for t, k in self._recent if t >= now - self.tokens_per_s_window)
        return n / self.tokens_per_s_window

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every counter, plus the derived acceptance figures."""
        rate = self.tokens_per_s()
        with self._lock:
            spec = self.spec
            return {
                "submitted": self.submitted, "rejected": self.rejected,
                "finished": dict(self.finished), "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "tokens_per_s": rate,
                "steps": self.steps, "step_s": self.step_s, "failed_steps": self.failed_steps,
                "target_forwards": spec.target_forwards, "emitted_tokens": spec.emitted_tokens,
                "drafted_tokens": spec.drafted_tokens, "accepted_tokens": spec.accepted_tokens,
                "acceptance_length": spec.acceptance_length, "acceptance_rate": spec.acceptance_rate,
                "acceptance_rate_by_position": spec.acceptance_rate_by_position,
                "latency_buckets": list(zip(LATENCY_BUCKETS + (float("inf"),),
                                            _cumulative(self.latency_buckets))),
                "latency_sum": self.latency_sum,
                "latency_count": sum(self.latency_buckets),
            }


def _cumulative(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


_DONE = object()


class Ticket:
    """A submitted request, seen from its asyncio handler: stream, wait, cancel.

    Iterate (``async for ids in ticket``) for the token ids as the engine commits them; the
    iteration ends when the request finishes. One consumer per ticket.
    """

    def __init__(self, owner: EngineLoop, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._done: asyncio.Future[Request] = loop.create_future()
        self._user_callback = request.on_tokens
        request.on_tokens = self._on_tokens  # runs on the engine thread

    # -- engine thread side ---------------------------------------------------------------
    def _on_tokens(self, ids: list[int]) -> None:
        # never raises, whatever engine runs it: a user callback that fails ends its own
        # request ("error", as the Engine itself does), never the step of its neighbours
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._owner.metrics._add_tokens(len(ids))
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, list(ids))
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            self.request.cancelled = True
        if self._user_callback is not None:
            with contain("callback", [self.request]):
                self._user_callback(ids)

    def _notify_finished(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._set_finished)
        except RuntimeError:
            pass  # the event loop is closed

    def _set_finished(self) -> None:
        self._queue.put_nowait(_DONE)
        if not self._done.done():
            self._done.set_result(self.request)

    # -- asyncio side ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.done()

    def cancel(self) -> None:
        """Stop generating: a waiting request leaves the queue now, a running one at the next
        step (its slot is freed then). Does nothing once the request has finished."""
        self._owner._cancel(self)

    async def wait(self) -> Request:
        """The finished request (``finish_reason``, ``output_ids``, ``stats``)."""
        return await asyncio.shield(self._done)

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[int]]:
        while True:
            item = await self._queue.get()
            if item is _DONE:
                return
            yield item


class EngineLoop:
    """Runs one engine in a background thread; requests join and leave between steps.

    Parameters
    ----------
    engine:
        A `BatchEngine` (``Generator.new_engine()``, ours by default: the loop calls its
        ``admit``, ``safe_step`` and ``reap`` and reads ``running``).
    max_batch_size:
        Requests running at once (stepped together).
    max_queue:
        Requests waiting for a slot; :meth:`submit` raises :class:`QueueFullError` past it.
    """

    def __init__(self, engine: BatchEngine, *, max_batch_size: int = 8, max_queue: int = 64) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be an integer >= 1, got {max_batch_size!r}",
                              option="max_batch_size")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ConfigError(f"must be an integer >= 0, got {max_queue!r}", option="max_queue")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = ServingMetrics()
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._active: list[Ticket] = []  # admitted to the engine, not yet handed back
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="constrained-spec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish every request ("cancelled") and stop the thread (after its current step)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %s s", timeout)
            self._thread = None

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests admitted to the engine and not yet handed back."""
        return len(self._active)

    @property
    def slots_in_use(self) -> int | None:
        """KV-cache slots the engine's runner holds (running requests; more means a leak);
        None if the runner does not say."""
        return getattr(getattr(self.engine, "runner", None), "slots_in_use", None)

    # -- handlers' side -------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> list[Ticket]:
        """Queue ``requests`` (from a coroutine); all are queued, or none and QueueFullError."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._stopping:
                raise ConstrainedSpecError("the engine loop is stopping")
            capacity = self.max_batch_size + self.max_queue
            if len(self._waiting) + len(self._active) + len(requests) > capacity:
                self.metrics._add_submitted(len(requests), rejected=True)
                raise QueueFullError(
                    f"the server is at capacity ({self.max_batch_size} running + {self.max_queue} "
                    f"waiting requests); retry later")
            tickets = [Ticket(self, r, loop) for r in requests]
            self._waiting.extend(tickets)
            self.metrics._add_submitted(len(tickets), rejected=False)
            self._cond.notify_all()
        return tickets

    def _cancel(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.request.finished:
                return
            ticket.request.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                ticket.request.finish_reason = "cancelled"
                queued = True
            else:
                queued = False
            self._cond.notify_all()
        if queued:  # never reached the engine: hand it back now
            self._hand_back([ticket])

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._active):
                        self._cond.wait()
                    if self._stopping:
                        break
                    free = self.max_batch_size - len(self._active)
                    admit = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                    self._active.extend(admit)
                if admit:
                    self._admit([t.request for t in admit])
                if any(not r.finished for r in self.engine.running):
                    self._step()
                self._reap()
        except BaseException:  # a bug in this loop: fail everything rather than hang clients
            logger.exception("the engine loop crashed")
            raise
        finally:
            self._shutdown()

    def _admit(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r.cancelled and not r.finished:  # cancelled between the queue and here
                r.finish_reason = "cancelled"
        reqs = [r for r in reqs if not r.finished]
        if reqs:
            self.engine.admit(reqs)  # one batched prefill, else one by one

    def _step(self) -> None:
        t0 = time.perf_counter()
        failed = self.engine.safe_step()  # fails a request alone where it can tell which one failed
        self.metrics._add_step(time.perf_counter() - t0, failed=failed)

    def _reap(self) -> None:
        with self._cond:
            done = [t for t in self._active if t.request.finished]
            if not done:
                return
            self._active = [t for t in self._active if not t.request.finished]
        self.engine.reap()  # frees the finished requests' slots
        self._hand_back(done)

    def _hand_back(self, tickets: list[Ticket]) -> None:
        now = time.monotonic()
        for t in tickets:
            self.metrics._add_finished(t.request, now - t.submitted_at)
            t._notify_finished()

    def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            tickets = list(self._waiting) + self._active
            self._waiting.clear()
            self._active = []
        for t in tickets:
            if not t.request.finished:
                t.request.finish_reason = "cancelled"
        try:
            for r in self.engine.running:
                r.finish_reason = r.finish_reason or "cancelled"
            self.engine.reap()
        except Exception:
            logger.exception("could not free the engine's slots on shutdown")
        self._hand_back(tickets)
