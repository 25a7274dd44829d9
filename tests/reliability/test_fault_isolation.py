"""Faults inside a batch stay with their request (engine and serving loop, tiny Llama, fp32).

A request whose grammar matcher, drafter or ``on_tokens`` callback raises ends alone with
``finish_reason == "error"`` and a :class:`GenerationError` naming the stage; its neighbours,
each with its own schema, produce exactly what they produce alone. A failure of the shared
target forward or verification ends that step's requests only, and the engine serves the next
ones. Cancelled and failed requests give their KV-cache slot back.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch
from cs_testlib import CHARS

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.errors import GenerationError
from constrained_spec.generation import engine as engine_module
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.serving import EngineLoop
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import Regex, normalize_schema

ID = {c: i for i, c in enumerate(CHARS)}
SCHEMAS = [
    Regex(r"(ab|c)+d{2,4}"),
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
     "required": ["a", "b"], "additionalProperties": False},
    ["abc", "abd", "e"],
    None,  # free text
]
PROMPTS = [[ID[c] for c in "abab"], [ID[c] for c in "abcab"], [ID[c] for c in "dddd"],
           [ID[c] for c in "ab0ab1"]]
PARAMS = SamplingParams(max_tokens=24)
BAD = 1  # the index of the request that fails in each batch


class Boom(Exception):
    """The injected fault."""


class FaultyMatcher:
    """A matcher that raises in ``method`` from its ``after``-th call on (forks included, when
    ``in_forks``: drafting goes through forks; committing through the real matcher only)."""

    def __init__(self, inner, method: str, after: int = 3, in_forks: bool = True, calls=None):
        self.inner, self.method, self.after, self.in_forks = inner, method, after, in_forks
        self.calls = calls if calls is not None else [0]

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def faulty(*args, **kwargs):
            self.calls[0] += 1
            if self.calls[0] > self.after:
                raise Boom(f"{name} failed")
            return attr(*args, **kwargs)
        return faulty

    def fork(self):
        if self.method == "fork":
            return self.__getattr__("fork")()
        fork = self.inner.fork()
        return FaultyMatcher(fork, self.method, self.after, True, self.calls) if self.in_forks else fork


@pytest.fixture(scope="module")
def compiled(tiny_tok):
    return [compile_spec(normalize_schema(s), tiny_tok) if s is not None else None for s in SCHEMAS]


@pytest.fixture
def make_engine(tiny_model):
    def make(drafter=None):
        runner = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
        return Engine(runner, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
                      drafter=drafter or NgramDrafter(4, 1), max_batch_size=64)
    return make


def requests(compiled, **kw):
    """One request per schema (mixed: regex, JSON object, choices, free text), fresh matchers."""
    return [Request(p, c.new_matcher() if c is not None else None, PARAMS, (0,), **kw)
            for p, c in zip(PROMPTS, compiled)]


@pytest.fixture(scope="module")
def solo(tiny_model, compiled):
    """Each request run alone: what its neighbours must reproduce inside a faulty batch."""
    out = []
    for r in requests(compiled):
        runner = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
        Engine(runner, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
               drafter=NgramDrafter(4, 1)).run([r])
        out.append((r.output_ids, r.finish_reason))
    assert any(len(ids) > 4 for ids, _ in out)  # long enough for a fault to land mid-generation
    return out


def assert_only_bad_failed(reqs, solo, stage, cause=Boom):
    bad = reqs[BAD]
    assert bad.finish_reason == "error"
    assert isinstance(bad.error, GenerationError) and bad.error.stage == stage
    assert isinstance(bad.error.__cause__, cause)
    for i, r in enumerate(reqs):
        if i != BAD:
            assert (r.output_ids, r.finish_reason) == solo[i], f"neighbour {i} was disturbed"


def assert_no_slot_held(engine):
    assert engine.running == [] and engine.runner.slots_in_use == 0


@pytest.mark.parametrize("method,in_forks,stage", [
    ("fill_bitmask", True, "draft"),  # the bitmask of a draft position (through a fork)
    ("forced_tokens", True, "draft"),  # jump-forward (through a fork)
    ("fork", True, "draft"),  # the step's fork of the matcher
    ("accept", False, "commit"),  # the real matcher taking the verified tokens
])
def test_a_failing_matcher_fails_only_its_request(make_engine, compiled, solo, method, in_forks, stage):
    reqs = requests(compiled)
    reqs[BAD].matcher = FaultyMatcher(reqs[BAD].matcher, method, after=3, in_forks=in_forks)
    engine = make_engine()
    engine.run(reqs)
    assert_only_bad_failed(reqs, solo, stage)
    assert reqs[BAD].error.token_ids == reqs[BAD].output_ids  # what it emitted before failing
    assert engine.failed_steps == 0
    assert_no_slot_held(engine)


def test_a_drafter_that_fails_for_one_request_fails_only_that_request(make_engine, compiled, solo):
    class FaultyDrafter(NgramDrafter):
        calls = 0

        def propose(self, states, k):
            if any(s.request_id == bad_id for s in states):
                FaultyDrafter.calls += 1
                if FaultyDrafter.calls > 2:
                    raise Boom("drafter failed")
            super().propose(states, k)

    reqs = requests(compiled)
    engine = make_engine(FaultyDrafter(4, 1))
    bad_id = engine._next_id + BAD  # ids are given in order at admission
    engine.run(reqs)
    assert reqs[BAD].id == bad_id
    assert_only_bad_failed(reqs, solo, "draft")
    assert_no_slot_held(engine)


def test_a_failing_token_callback_fails_only_its_request(make_engine, compiled, solo):
    got: dict[int, list[int]] = {}

    def callback(i):
        def on_tokens(ids):
            if i == BAD and len(got.get(i, [])) >= 2:
                raise Boom("consumer failed")
            got.setdefault(i, []).extend(ids)
        return on_tokens

    reqs = requests(compiled)
    for i, r in enumerate(reqs):
        r.on_tokens = callback(i)
    engine = make_engine()
    engine.run(reqs)
    assert_only_bad_failed(reqs, solo, "callback")
    for i, r in enumerate(reqs):
        if i != BAD:
            assert got.get(i, []) == r.output_ids  # every neighbour's tokens streamed, in order
    assert_no_slot_held(engine)


@pytest.mark.parametrize("stage", ["forward", "verify"])
def test_a_failing_batched_forward_ends_its_step_and_the_engine_serves_on(
        make_engine, compiled, solo, monkeypatch, stage):
    engine = make_engine()
    calls = [0]

    def fail_call(fn, n, counts=lambda *args, **kwargs: True):
        def wrapped(*args, **kwargs):
            calls[0] += counts(*args, **kwargs)
            if calls[0] == n and counts(*args, **kwargs):
                raise Boom(f"{stage} failed")
            return fn(*args, **kwargs)
        return wrapped

    def decoding(slots, tokens, num_logits, **kwargs):  # not a prompt's forward (an exact
        return any(num_logits)  # runner prefills a batch of prompts one forward per prompt)

    if stage == "forward":  # the second decoding step
        monkeypatch.setattr(engine.runner, "forward", fail_call(engine.runner.forward, 2, decoding))
    else:  # call 1 verifies the first decoding step, 3 the third
        monkeypatch.setattr(engine_module, "rejection_sample",
                            fail_call(engine_module.rejection_sample, 3))
    first = requests(compiled)
    engine.run(first)
    failed = [r for r in first if r.finish_reason == "error"]
    assert len(failed) >= 2  # every request still running in that step, each with the cause
    for r in failed:
        assert r.error.stage == stage and isinstance(r.error.__cause__, Boom)
    for i, r in enumerate(first):  # those that had finished before it are untouched
        if r.finish_reason != "error":
            assert (r.output_ids, r.finish_reason) == solo[i]
    assert engine.failed_steps == 1
    assert_no_slot_held(engine)
    second = requests(compiled)  # the same engine and runner: as good as new
    engine.run(second)
    assert [(r.output_ids, r.finish_reason) for r in second] == solo
    assert_no_slot_held(engine)


def test_a_failed_batched_prefill_is_retried_alone_and_fails_only_the_request_that_fails_alone(
        make_engine, compiled, solo, monkeypatch):
    engine = make_engine()
    engine.max_batch_size = 2  # the first two are admitted together, then the next two
    forward = engine.runner.forward
    poison = PROMPTS[BAD][:-1]  # what BAD's prefill feeds (the last prompt token is pending)

    def failing_prefill(slots, tokens, num_logits, **kwargs):
        if not any(num_logits) and poison in [list(t) for t in tokens]:
            raise Boom("prefill failed")
        return forward(slots, tokens, num_logits, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing_prefill)
    reqs = requests(compiled)
    done = engine.run(reqs)
    assert set(map(id, done)) == set(map(id, reqs))  # every request comes back, none is lost
    assert_only_bad_failed(reqs, solo, "admit")  # its batch-mate was admitted alone
    assert reqs[BAD].slot == -1
    assert_no_slot_held(engine)


def test_a_prefill_that_fails_once_admits_every_request_alone(make_engine, compiled, solo,
                                                              monkeypatch):
    engine = make_engine()
    forward, calls = engine.runner.forward, [0]

    def failing_first_prefill(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise Boom("prefill failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing_first_prefill)
    reqs = requests(compiled)
    engine.run(reqs)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == solo
    assert_no_slot_held(engine)


def test_a_step_that_raises_outside_the_guards_fails_its_requests_and_run_goes_on(
        make_engine, compiled, solo, monkeypatch):
    engine = make_engine()
    engine.max_batch_size = 2  # two run, two wait
    step = engine.step
    calls = [0]

    def buggy_step():
        calls[0] += 1
        if calls[0] == 2:
            raise Boom("a bug")
        step()

    monkeypatch.setattr(engine, "step", buggy_step)
    reqs = requests(compiled)
    engine.run(reqs)
    assert [r.error.stage for r in reqs[:2]] == ["step", "step"]
    assert [(r.output_ids, r.finish_reason) for r in reqs[2:]] == solo[2:]
    assert_no_slot_held(engine)


def test_the_api_returns_the_typed_error_for_that_prompt_only(tiny_loaded):
    from constrained_spec import Generator

    gen = Generator(tiny_loaded, max_tokens=16)
    prompts = ["Pick a colour.", "POISON: extract the number 7.", "Say hi.", "Name a city."]
    schemas = [["red", "green"], {"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]}, None, {"type": "string", "maxLength": 6}]
    alone = [gen.batch([p], schemas=[s])[0] for p, s in zip(prompts, schemas)]
    make_request = gen.make_request

    def poisoned(prompt, **kw):  # the matcher of the POISON prompt fails mid-generation
        req, spec = make_request(prompt, **kw)
        if prompt.startswith("POISON"):
            req.matcher = FaultyMatcher(req.matcher, "fill_bitmask", after=4)
        return req, spec

    gen.make_request = poisoned
    out = gen.batch(prompts, schemas=schemas)
    err = out[1]
    assert isinstance(err, GenerationError) and err.stage == "draft"
    assert err.partial_text == tiny_loaded.tokenizer.decode(err.token_ids)
    assert "fill_bitmask failed" in str(err)
    for i in (0, 2, 3):
        assert repr(out[i]) == repr(alone[i])  # a value, or the same typed error as alone
    with pytest.raises(GenerationError):
        gen.batch(prompts[1:2], schemas=schemas[1:2], return_exceptions=False)
    assert gen.batch(prompts[:1], schemas=schemas[:1]) == alone[:1]  # the Generator serves on
    assert tiny_loaded.runner.slots_in_use == 0


# ---- the serving loop: faults and cancellation give every slot back -------------------------


def serve(engine, body, **kw):
    loop = EngineLoop(engine, **kw)
    loop.start()

    async def main():
        try:
            return await asyncio.wait_for(body(loop), 60)
        finally:
            loop.stop()

    return asyncio.run(main()), loop


def test_the_serving_loop_fails_the_faulty_request_alone_and_counts_no_failed_step(
        make_engine, compiled, solo):
    async def body(loop):
        reqs = requests(compiled)
        reqs[BAD].matcher = FaultyMatcher(reqs[BAD].matcher, "fill_bitmask", after=3)
        tickets = loop.submit(reqs)
        streamed = await asyncio.gather(*(collect(t) for t in tickets))
        return reqs, streamed, [await t.wait() for t in tickets]

    async def collect(ticket):
        return [tok async for ids in ticket for tok in ids]

    engine = make_engine()
    (reqs, streamed, done), loop = serve(engine, body, max_batch_size=8)
    assert_only_bad_failed(done, solo, "draft")
    assert all(s == r.output_ids for s, r in zip(streamed, reqs))
    snap = loop.metrics.snapshot()
    assert snap["failed_steps"] == 0 and snap["finished"]["error"] == 1
    assert loop.slots_in_use == 0
    assert_no_slot_held(engine)


def test_cancelling_running_requests_frees_their_slots_and_grammar_state(make_engine, compiled):
    long = SamplingParams(max_tokens=400)
    engine = make_engine()
    engine.runner.forward([engine.runner.new_slot()], [[1, 2, 3]], [1])  # a slot held outside
    baseline = dict(engine.runner._lengths)
    refs = []

    async def body(loop):
        reqs = [Request(PROMPTS[0], None, long, (-1,)),  # free text that never stops by itself
                Request(PROMPTS[0], None, long, (-1,)),
                Request(PROMPTS[1], compiled[0].new_matcher(), long, (0,))]
        refs.extend(weakref.ref(r) for r in reqs)
        tickets = loop.submit(reqs)
        while len(reqs[0].output_ids) < 8 or len(reqs[1].output_ids) < 8:
            await asyncio.sleep(0.005)
        assert loop.slots_in_use >= len(baseline) + 2
        for t in tickets:
            t.cancel()  # a no-op for one that has finished
        reasons = [(await t.wait()).finish_reason for t in tickets]
        del reqs, tickets
        return reasons

    reasons, _ = serve(engine, body, max_batch_size=4)
    assert reasons[:2] == ["cancelled", "cancelled"]
    assert engine.runner._lengths == baseline  # only the slot taken outside the loop is left
    assert engine.running == []
    gc.collect()
    assert all(ref() is None for ref in refs)  # requests, their matchers and drafts are gone


@pytest.mark.parametrize("size", [0, -1, True, 1.5, None])
def test_a_batch_size_below_one_is_a_config_error_naming_it(tiny_model, size):
    """0 used to admit nothing and spin at 100% CPU in run() forever."""
    from constrained_spec import ConfigError, Generator

    runner = LeanRunner(tiny_model, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="max_batch_size"):
        Engine(runner, speculative=None, max_batch_size=size)
    with pytest.raises(ConfigError, match="max_batch_size"):
        EngineLoop(Engine(runner, speculative=None), max_batch_size=size)
    with pytest.raises(ConfigError, match="max_batch_size") as info:
        Generator(object(), max_batch_size=size)  # refused before the model is even looked at
    assert info.value.option == "max_batch_size"


def test_run_refuses_a_batch_size_changed_to_zero_instead_of_spinning(make_engine, compiled):
    import threading

    engine = make_engine()
    engine.max_batch_size = 0
    outcome = []

    def run():
        try:
            engine.run(requests(compiled))
        except Exception as e:  # noqa: BLE001 -- what run raised is the result
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "engine.run spins with max_batch_size=0"
    assert "max_batch_size" in str(outcome[0])
    assert_no_slot_held(engine)


class Interrupting:
    """A matcher whose ``fill_bitmask`` (drafting, through forks) raises ``exc`` on its 3rd call."""

    def __init__(self, inner, exc, calls=None):
        self.inner, self.exc, self.calls = inner, exc, calls if calls is not None else [0]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fill_bitmask(self, bitmask, row=0):
        self.calls[0] += 1
        if self.calls[0] == 3:
            raise self.exc()
        return self.inner.fill_bitmask(bitmask, row)

    def fork(self):
        return Interrupting(self.inner.fork(), self.exc, self.calls)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["prefill", "forward", "matcher", "callback"])
def test_keyboard_interrupt_and_system_exit_are_never_swallowed(make_engine, compiled, monkeypatch,
                                                                exc, where):
    engine = make_engine()
    forward, calls = engine.runner.forward, [0]

    def interrupted_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == (1 if where == "prefill" else 3):
            raise exc()
        return forward(*args, **kwargs)

    def callback(ids):
        if where == "callback":
            raise exc()

    if where in ("prefill", "forward"):
        monkeypatch.setattr(engine.runner, "forward", interrupted_forward)
    reqs = requests(compiled, on_tokens=callback)
    if where == "matcher":
        reqs[BAD].matcher = Interrupting(reqs[BAD].matcher, exc)
    with pytest.raises(exc):
        engine.run(reqs)
    if where == "prefill":  # the failed admission gave its slots back before propagating
        assert engine.runner.slots_in_use == 0
