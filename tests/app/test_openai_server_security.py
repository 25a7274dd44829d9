"""The server with untrusted schemas, in this process on the tiny Llama: a ``$ref`` outside the
schema is a 400 naming its pointer in every ``strict`` setting, nothing is ever fetched or
read, and ``/health`` answers within a second while requests are in flight (final validation
runs off the event loop)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from cs_testlib import recording_http_server, silent_listener
from openai_server_process import serve_tiny

MODEL = "tiny"
HEALTH_LIMIT_S = 1.0


@pytest.fixture(scope="module")
def served(tiny_loaded):
    with serve_tiny(tiny_loaded, MODEL) as served:
        yield served


def body(schema, strict):
    spec = {"name": "s", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": spec}}


class HealthPoller:
    """Polls ``GET /health`` in a thread; records how long each answer took."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.times: list[float] = []  # seconds per answer
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5 * HEALTH_LIMIT_S) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    assert client.get(f"{self.url}/health").status_code == 200
                    self.times.append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 -- a timeout is the failure looked for
                    self.failures.append(repr(e))
                time.sleep(0.02)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self.failures, self.failures
        assert self.times and max(self.times) < HEALTH_LIMIT_S, max(self.times, default=None)


@pytest.mark.parametrize("strict", [True, None, False])
def test_http_refs_are_400_naming_the_pointer_and_never_fetched(served, strict):
    _, url = served
    with recording_http_server() as (base, paths):
        schema = {"type": "object", "properties": {"a": {"$ref": f"{base}/s.json"}}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body(schema, strict), timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_schema"
        assert err["param"] == "response_format.json_schema.schema"
        assert "/properties/a/$ref" in err["message"] and "never fetched" in err["message"]
        assert paths == []


def test_a_file_ref_is_400_and_its_content_never_appears(served, tmp_path):
    _, url = served
    secret = tmp_path / "secret.json"
    secret.write_text('{"const": "server-secret-5e3b"}')
    for strict in (True, None, False):
        r = httpx.post(f"{url}/v1/chat/completions",
                       json=body({"$ref": secret.as_uri()}, strict), timeout=30)
        assert r.status_code == 400
        assert "server-secret-5e3b" not in r.text


def test_a_ref_to_a_host_that_never_answers_is_400_and_health_stays_live(served):
    server, url = served
    with silent_listener() as (base, accepted), HealthPoller(url):
        schema = {"type": "object", "properties": {"a": {"$ref": f"{base}/hang.json"}},
                  "required": ["a"]}
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=body(schema, False), timeout=60)
        assert r.status_code == 400 and "/properties/a/$ref" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10
        time.sleep(0.2)  # a few more polls after the request
        assert accepted == []  # no connection was even opened
    assert server.loop.running == 0


def test_slow_final_validation_does_not_block_the_event_loop(served, monkeypatch):
    """Final validation runs on the finish threads: a slow one (a large output) leaves /health
    answering while the request is in flight."""
    server, url = served
    gen = server.generator  # one Generator serves every schema mode
    real = gen.finalize
    started = threading.Event()

    def slow_finalize(*args, **kwargs):
        started.set()
        time.sleep(2.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "finalize", slow_finalize)
    with HealthPoller(url) as poller:
        r = httpx.post(f"{url}/v1/chat/completions",
                       json=body({"enum": ["red", "green"]}, False), timeout=60)
        assert started.is_set()
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] in ('"red"', '"green"')
    assert len(poller.times) >= 5  # /health was answered all along the slow validation
