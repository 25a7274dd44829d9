"""The OpenAI server under load and faults, in this process on the tiny Llama (fp32, greedy).

Concurrent clients with mixed schemas (JSON Schema, json_object, choices, free text; streamed
and not) get exactly what each gets alone. A request whose grammar fails mid-batch gets a 500
``generation_failed`` (or an error event in its stream) while its neighbours finish as alone; a
failing batched forward fails that step's requests and the next requests succeed; a client
that disconnects mid-stream frees its slot. After each test no KV-cache slot is held.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai_server_process import serve_tiny

MODEL = "tiny"
MAX_TOKENS = 16


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


# (user message, response_format, stream): every kind of output the server makes, mixed
CASES = [
    ("Pick a colour.", rf({"enum": ["red", "green", "blue"]}), False),
    ("Extract the number 7.", rf({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"], "additionalProperties": False}), True),
    ("Say hi.", None, False),
    ("Describe a city.", {"type": "json_object"}, True),
    ("A short word, please.", rf({"type": "string", "pattern": "^[a-z]{1,5}$"}), False),
    ("Rate it.", rf({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                      "stars": {"enum": [1, 2, 3]}},
                     "required": ["ok", "stars"], "additionalProperties": False}), True),
]


class Boom(Exception):
    """The injected fault."""


class FailingMatcher:
    """Delegates to a matcher; ``fill_bitmask`` (through the step's forks) raises from the
    ``after``-th call on, and records how many requests were running at that moment."""

    def __init__(self, inner, engine, after, calls=None, seen=None):
        self.inner, self.engine, self.after = inner, engine, after
        self.calls = calls if calls is not None else [0]
        self.seen = seen if seen is not None else []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fill_bitmask(self, bitmask, row=0):
        self.calls[0] += 1
        if self.calls[0] > self.after:
            self.seen.append(sum(not r.finished for r in self.engine.running))
            raise Boom("the grammar engine failed")
        return self.inner.fill_bitmask(bitmask, row)

    def fork(self):
        return FailingMatcher(self.inner.fork(), self.engine, self.after, self.calls, self.seen)


@pytest.fixture(scope="module")
def served(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL, max_queue=32, max_tokens=MAX_TOKENS) as served:
        yield served


@pytest.fixture
def server(served):
    server, _ = served
    yield server
    server.__dict__.pop("build_requests", None)  # undo a test's fault injection
    wait_until(lambda: server.loop.running == 0 and server.loop.waiting == 0)
    assert server.loop.slots_in_use == 0  # nothing leaked, whatever the test did


@pytest.fixture
def url(served, server):
    return served[1]


def wait_until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


async def call(client: httpx.AsyncClient, message: str, response_format, stream: bool):
    """One chat completion -> (HTTP status, content, finish_reason, error code)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": message}], "stream": stream}
    if response_format is not None:
        body["response_format"] = response_format
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return r.status_code, None, None, data["error"]["code"]
        choice = data["choices"][0]
        return 200, choice["message"]["content"], choice["finish_reason"], None
    text, finish, code = "", None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                code = event["error"]["code"]
                continue
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
    return 200, text, finish, code


def run_calls(url: str, cases, *, concurrent: bool):
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            if concurrent:
                return await asyncio.gather(*(call(client, *c) for c in cases))
            return [await call(client, *c) for c in cases]
    return asyncio.run(main())


@pytest.fixture(scope="module")
def alone(served):
    """Each case sent on its own: what it must also get among concurrent neighbours."""
    out = run_calls(served[1], CASES, concurrent=False)
    assert all(status == 200 and code is None for status, _, _, code in out)
    return out


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    raise KeyError(name)


def test_concurrent_clients_with_mixed_schemas_get_what_they_get_alone(server, url, alone):
    cases = CASES * 3  # 18 requests over 4 slots: they queue, join and leave between steps
    got = run_calls(url, cases, concurrent=True)
    assert got == alone * 3
    wait_until(lambda: server.loop.running == 0)
    assert metric(url, "constrained_spec_kv_slots_in_use") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_fails_mid_batch_does_not_disturb_its_neighbours(server, url, alone, stream):
    seen: list[int] = []
    build = server.build_requests

    def poisoned(body):  # the POISON request's grammar fails after a few steps
        out = build(body)
        if "POISON" in body.messages[-1].content:
            for req, _, _ in out:
                req.matcher = FailingMatcher(req.matcher, server.loop.engine, after=6, seen=seen)
        return out

    server.build_requests = poisoned
    bad = ("POISON: rate it.", CASES[5][1], stream)  # a schema compiled already: no delay
    got = run_calls(url, [CASES[0], CASES[1], bad, CASES[3]], concurrent=True)
    if stream:  # the stream had begun: the error comes as an event, then [DONE]
        assert got[2][0] == 200 and got[2][3] == "generation_failed"
    else:
        assert got[2][0] == 500 and got[2][3] == "generation_failed"
    assert [got[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    assert seen and max(seen) > 1  # it failed while neighbours were running in its batch
    assert run_calls(url, CASES[:2], concurrent=True) == alone[:2]  # and the server serves on


def test_a_failing_batched_forward_fails_that_step_and_the_next_requests_succeed(
        server, url, alone, monkeypatch):
    runner = server.loop.engine.runner
    forward = runner.forward
    calls = [0]

    def failing_forward(slots, tokens, num_logits, **kw):
        # decoding forwards only: an exact runner prefills a batch of prompts one per forward
        calls[0] += any(num_logits)
        if calls[0] == 3 and any(num_logits):  # a decoding step, some requests in
            raise Boom("the accelerator failed")
        return forward(slots, tokens, num_logits, **kw)

    monkeypatch.setattr(runner, "forward", failing_forward)
    failed_before = metric(url, "constrained_spec_engine_failed_steps_total")
    got = run_calls(url, CASES[:4], concurrent=True)
    errors = [g for g in got if g[3] == "generation_failed"]
    assert errors  # the step's requests failed, cleanly, with the typed error
    for g, a in zip(got, alone):
        assert g[3] == "generation_failed" or g == a
    assert metric(url, "constrained_spec_engine_failed_steps_total") == failed_before + 1
    wait_until(lambda: server.loop.running == 0)
    assert server.loop.slots_in_use == 0
    assert run_calls(url, CASES, concurrent=True) == alone  # the engine is as good as new


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, url, tiny_loaded):
    runner = server.loop.engine.runner
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count for ever."}],
            "stream": True, "max_tokens": 1500}
    cancelled_before = metric(url, 'constrained_spec_requests_total{finish_reason="cancelled"}') \
        if "cancelled" in httpx.get(f"{url}/metrics").text else 0.0
    with httpx.Client(base_url=url, timeout=60) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 4:  # generating: it holds a slot
                assert server.loop.slots_in_use == 1 and runner.slots_in_use == 1
                break
    # leaving the block has closed the connection mid-stream
    wait_until(lambda: server.loop.running == 0)
    assert server.loop.slots_in_use == 0 and runner.slots_in_use == 0
    assert metric(url, 'constrained_spec_requests_total{finish_reason="cancelled"}') == \
        cancelled_before + 1


def test_an_unexpected_500_leaves_the_keep_alive_connection_serving(tiny_loaded):
    from openai_server_process import serve_in_thread

    from constrained_spec.server.app import create_app
    from constrained_spec.server.state import ServerConfig

    app = create_app(tiny_loaded, ServerConfig(model_name=MODEL, max_batch_size=2, max_queue=2,
                                               max_tokens=4, enable_metrics=True))

    @app.get("/boom")
    async def boom() -> None:  # a bug in a route: what no handler expects
        raise RuntimeError("a bug")

    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(2):
            r = client.get("/boom")
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "internal_error" and "a bug" not in r.text
            ok = client.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
            assert ok.status_code == 200 and ok.json()["tokens"]  # on the same connection
        metrics = client.get("/metrics").text
    assert 'route="other",status="500"} 2.0' in metrics
