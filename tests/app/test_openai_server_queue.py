"""A real server with one slot and a one-place queue: 429 when full, and a client that goes
away (a closed stream, a timed-out request) cancels its request and frees its slot."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from openai_server_process import start_server

pytestmark = pytest.mark.model

# an output that cannot end early: keeps the only slot busy until it is cancelled
LONG = {"type": "json_schema", "json_schema": {"name": "numbers", "strict": True, "schema": {
    "type": "array", "items": {"type": "integer"}, "minItems": 200}}}
MESSAGES = [{"role": "user", "content": "List the numbers from 1 to 300."}]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-batch-size", "1", "--max-queue", "1", "--enable-metrics")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def health(server) -> dict:
    return httpx.get(f"{server.url}/health").json()


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


def cancelled(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith('constrained_spec_requests_total{finish_reason="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_full_queue_is_429_and_a_closed_stream_frees_its_slot(server, client, model):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, response_format=LONG,
                                            max_tokens=1500, stream=True)
    chunks = iter(stream)
    while not (next(chunks).choices[0].delta.content or ""):
        pass  # generating: it holds the only slot
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.setdefault("r", client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5)))
    waiter.start()
    wait_for(lambda: health(server)["waiting"] == 1)

    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5)
    assert info.value.status_code == 429
    err = info.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full"

    before = cancelled(server)
    t0 = time.monotonic()
    stream.close()  # the client goes away mid-stream
    waiter.join(60)
    assert queued["r"].choices[0].finish_reason in ("stop", "length")  # got the freed slot
    assert time.monotonic() - t0 < 30  # long before the 1500-token stream could have ended
    assert cancelled(server) == before + 1
    wait_for(lambda: health(server) == {"status": "ok", "running": 0, "waiting": 0})


def test_a_non_streaming_client_that_times_out_is_cancelled(server, model):
    before = cancelled(server)
    body = {"model": model, "messages": MESSAGES, "response_format": LONG, "max_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=2))
    wait_for(lambda: cancelled(server) == before + 1, timeout=20)
    assert health(server)["running"] == 0
