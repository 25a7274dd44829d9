"""The serving loop (constrained_spec.generation.serving) in-process: a scripted fake engine for the queue,
cancellation and isolation properties (milliseconds each), and the real engine on the tiny
Llama for continuous batching with a schema per request."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Sequence

import pytest
import torch
from cs_testlib import CHARS

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.errors import GenerationError
from constrained_spec.generation.engine import Engine, Request, finish
from constrained_spec.generation.serving import EngineLoop, QueueFullError
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.model.slots import SlotAllocator
from constrained_spec.schemas import Regex, normalize_schema

POISON = [666]  # a prompt the fake engine refuses to prefill


class FakeRunner(SlotAllocator):
    """Slots only: the fake engine runs no model."""

    vocab_size = 8
    max_context = 1 << 20

    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> torch.Tensor:
        raise AssertionError("the fake engine scripts its steps; nothing runs a forward")


class FakeEngine(Engine):
    """The real Engine's admission, isolation and reaping over a scripted model: each step
    emits token ``len(output)`` to every request; prompt POISON cannot be prefilled."""

    def __init__(self, step_s: float = 0.002, fail_steps: int = 0) -> None:
        super().__init__(FakeRunner(), speculative=None)
        self.batches: list[list[int]] = []  # prompt[0] of every request stepped, per step
        self.step_s = step_s
        self.fail_steps = fail_steps

    def _prefill(self, reqs):
        if any(r.prompt_ids == POISON for r in reqs):
            raise ValueError("cannot prefill this prompt")

    def step(self):
        time.sleep(self.step_s)
        live = self._live()
        self.batches.append([r.prompt_ids[0] for r in live])
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("boom")
        for r in live:
            tok = len(r.output_ids)
            r.output_ids.append(tok)
            r.stats.emitted_tokens += 1
            r.stats.target_forwards += 1
            if r.on_tokens:
                r.on_tokens([tok])
            if len(r.output_ids) >= r.params.max_tokens:
                finish(r, "length")


def req(tag: int, max_tokens: int = 3) -> Request:
    return Request([tag], None, SamplingParams(max_tokens=max_tokens), (0,))


def serve(coro_fn, engine=None, **kw):
    """Run ``coro_fn(loop, engine)`` against a started EngineLoop; stop it afterwards."""
    engine = engine or FakeEngine()
    loop = EngineLoop(engine, **kw)
    loop.start()

    async def main():
        try:
            return await asyncio.wait_for(coro_fn(loop, engine), 30)
        finally:
            loop.stop()

    return asyncio.run(main()), loop, engine


async def until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.001)


def test_streamed_tokens_are_the_output_in_order():
    async def body(loop, engine):
        [t] = loop.submit([req(1, max_tokens=5)])
        got = [tok async for ids in t for tok in ids]
        r = await t.wait()
        return got, r

    (got, r), _, engine = serve(body)
    assert got == r.output_ids == [0, 1, 2, 3, 4]
    assert r.finish_reason == "length"
    assert engine.runner.slots_in_use == 0


def test_requests_join_and_leave_between_steps():
    engine = FakeEngine(step_s=0.005)

    async def body(loop, engine):
        [a] = loop.submit([req(1, max_tokens=30)])
        await until(lambda: len(a.request.output_ids) >= 3)
        [b] = loop.submit([req(2, max_tokens=3)])
        await b.wait()
        await a.wait()

    serve(body, engine=engine)
    batches = engine.batches
    assert batches[0] == [1]  # a ran alone first,
    together = [i for i, b in enumerate(batches) if b == [1, 2]]
    assert len(together) == 3  # b joined for exactly its 3 tokens,
    assert batches[together[-1] + 1] == [1]  # and a went on alone after b left


def test_max_batch_size_bounds_the_running_batch():
    engine = FakeEngine()

    async def body(loop, engine):
        tickets = loop.submit([req(i, max_tokens=4) for i in range(1, 8)])
        return [await t.wait() for t in tickets]

    reqs, _, _ = serve(body, engine=engine, max_batch_size=3, max_queue=10)
    assert max(len(b) for b in engine.batches) == 3
    assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in reqs)
    assert engine.runner.slots_in_use == 0


def test_full_queue_refuses_whole_submits():
    async def body(loop, engine):
        [running] = loop.submit([req(1, max_tokens=10_000)])
        await until(lambda: loop.running == 1)
        [queued] = loop.submit([req(2)])
        with pytest.raises(QueueFullError):
            loop.submit([req(3)])
        assert (loop.running, loop.waiting) == (1, 1)
        running.cancel()
        await queued.wait()
        # all-or-nothing: two requests do not fit in the one free place
        [first] = loop.submit([req(4)])
        with pytest.raises(QueueFullError):
            loop.submit([req(5), req(6)])
        await first.wait()
        return loop.metrics.snapshot()

    snap, _, engine = serve(body, max_batch_size=1, max_queue=1)
    assert snap["rejected"] == 3 and snap["submitted"] == 3
    assert engine.runner.slots_in_use == 0


def test_cancelling_a_running_request_frees_its_slot():
    async def body(loop, engine):
        [a] = loop.submit([req(1, max_tokens=10_000)])
        [b] = loop.submit([req(2, max_tokens=3)])
        await until(lambda: len(a.request.output_ids) >= 2)
        assert loop.waiting == 1  # b waits for a's slot
        a.cancel()
        ra, rb = await a.wait(), await b.wait()
        return ra, rb

    (ra, rb), loop, engine = serve(body, max_batch_size=1, max_queue=4)
    assert ra.finish_reason == "cancelled"
    assert rb.finish_reason == "length" and rb.output_ids == [0, 1, 2]
    assert engine.runner.slots_in_use == 0
    assert loop.metrics.snapshot()["finished"] == {"cancelled": 1, "length": 1}


def test_cancelling_a_waiting_request_leaves_the_queue_at_once():
    async def body(loop, engine):
        [a] = loop.submit([req(1, max_tokens=10_000)])
        [b] = loop.submit([req(2)])
        await until(lambda: loop.running == 1)
        b.cancel()
        assert loop.waiting == 0
        rb = await b.wait()
        a.cancel()
        await a.wait()
        return rb

    rb, _, engine = serve(body, max_batch_size=1, max_queue=1)
    assert rb.finish_reason == "cancelled" and rb.output_ids == []
    assert 2 not in itertools.chain.from_iterable(engine.batches)  # never reached the engine


def test_a_request_that_cannot_be_admitted_fails_alone():
    async def body(loop, engine):
        tickets = loop.submit([req(1), Request(POISON, None, SamplingParams(max_tokens=3), (0,)), req(2)])
        return [await t.wait() for t in tickets]

    (r1, bad, r2), _, engine = serve(body)
    assert bad.finish_reason == "error" and isinstance(bad.error, GenerationError)
    assert bad.error.stage == "admit" and isinstance(bad.error.__cause__, ValueError)
    assert r1.finish_reason == r2.finish_reason == "length"
    assert engine.runner.slots_in_use == 0


def test_a_failing_step_keeps_the_loop_serving():
    async def body(loop, engine):
        [a] = loop.submit([req(1)])
        ra = await a.wait()
        [b] = loop.submit([req(2)])
        return ra, await b.wait()

    (ra, rb), loop, _ = serve(body, engine=FakeEngine(fail_steps=1))
    assert ra.finish_reason == "error" and "boom" in str(ra.error)
    assert rb.finish_reason == "length"
    assert loop.metrics.snapshot()["failed_steps"] == 1


def test_a_failing_token_callback_fails_only_its_request():
    async def body(loop, engine):
        bad = req(1, max_tokens=50)
        bad.on_tokens = lambda ids: 1 / 0
        tickets = loop.submit([bad, req(2, max_tokens=5)])
        return [await t.wait() for t in tickets]

    (bad, good), _, _ = serve(body)
    assert bad.finish_reason == "error" and bad.error.stage == "callback"
    assert isinstance(bad.error.__cause__, ZeroDivisionError)
    assert good.finish_reason == "length" and good.output_ids == [0, 1, 2, 3, 4]


def test_stopping_the_loop_finishes_every_request():
    engine = FakeEngine()
    loop = EngineLoop(engine, max_batch_size=1, max_queue=4)
    loop.start()

    async def main():
        tickets = loop.submit([req(1, max_tokens=10_000), req(2)])
        await until(lambda: loop.running == 1)
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)
        return [await asyncio.wait_for(t.wait(), 5) for t in tickets]

    reqs = asyncio.run(main())
    assert [r.finish_reason for r in reqs] == ["cancelled", "cancelled"]
    assert engine.runner.slots_in_use == 0


def test_metrics_count_requests_tokens_and_queue():
    async def body(loop, engine):
        tickets = loop.submit([req(i, max_tokens=4) for i in range(1, 4)])
        for t in tickets:
            await t.wait()
        return loop.metrics.snapshot()

    snap, loop, _ = serve(body, max_batch_size=2)
    assert snap["finished"] == {"length": 3}
    assert snap["generated_tokens"] == 12 and snap["emitted_tokens"] == 12
    assert snap["acceptance_length"] == 1.0
    assert snap["prompt_tokens"] == 3
    assert snap["tokens_per_s"] > 0
    assert snap["latency_count"] == 3 and snap["latency_buckets"][-1][1] == 3
    assert loop.waiting == loop.running == 0


# ---- the real engine on the tiny Llama ---------------------------------------------------------

ID = {c: i for i, c in enumerate(CHARS)}
SCHEMAS = [
    Regex(r"(ab|c)+d{2,4}"),
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
     "required": ["a", "b"], "additionalProperties": False},
    ["abc", "abd", "e"],
]
PROMPTS = [[ID[c] for c in "abab"], [ID[c] for c in "abcab"], [ID[c] for c in "dddd"]]


def test_continuous_batching_keeps_each_schema_and_matches_solo_runs(tiny_model, tiny_tok):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=30)
    compiled = [compile_spec(normalize_schema(s), tiny_tok) for s in SCHEMAS]
    cases = list(itertools.product(PROMPTS, range(len(SCHEMAS))))

    def engine():
        runner = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
        return Engine(runner, speculative=spec, drafter=NgramDrafter(4, 1), max_batch_size=64)

    solo = []
    for p, s in cases:
        r = Request(p, compiled[s].new_matcher(), params, (0,))
        engine().run([r])
        solo.append(r)

    async def body(loop, _):
        tickets = []
        for p, s in cases:  # staggered: each request joins a batch already running
            tickets += loop.submit([Request(p, compiled[s].new_matcher(), params, (0,))])
            await asyncio.sleep(0.01)
        return [await t.wait() for t in tickets]

    eng = engine()
    joined_running = []  # how many requests were running when others were admitted
    add = eng.add
    eng.add = lambda reqs: (joined_running.append(len([r for r in eng.running if not r.finished])),
                            add(reqs))
    served, _, _ = serve(body, engine=eng, max_batch_size=4, max_queue=16)
    assert max(joined_running) > 0
    for (_, s), a, b in zip(cases, served, solo):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        text = "".join(CHARS[t] for t in a.output_ids)
        if s == 0 and a.finish_reason == "stop":
            assert re.fullmatch(r"(ab|c)+d{2,4}", text)
        if s == 2 and a.finish_reason == "stop":
            assert text in SCHEMAS[2]
    assert eng.running == []
