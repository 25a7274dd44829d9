"""Start the OpenAI-compatible server on a free loopback port (test helpers): as a real
``constrained-spec serve`` process (:func:`start_server`, embedded model), or in this process on
a model of the test's choosing (:func:`serve_in_thread`, :func:`serve_tiny`, e.g. the tiny
Llama; the test can then reach into the server)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from constrained_spec.server import ServerConfig, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    stdout_path: Path
    stderr_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _server_env() -> dict[str, str]:
    """This process's environment for the server, without a developer's own API key (a key
    in the environment and ``--api-key`` at once is refused: two sources)."""
    env = {k: v for k, v in os.environ.items() if k != "CONSTRAINED_SPEC_API_KEY"}
    return {**env, "PYTHONUNBUFFERED": "1"}


def start_server(*flags: str, timeout: float = 240.0) -> ServerProcess:
    """Start the server with ``flags`` and wait until ``GET /health`` answers."""
    logs = Path(tempfile.mkdtemp(prefix="openai-server-"))
    last_error: str = ""
    for _ in range(3):  # the free port may be taken between probing and binding
        port = free_port()
        out, err = logs / f"{port}.stdout", logs / f"{port}.stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen([sys.executable, "-m", "constrained_spec", "serve",
                                     "--port", str(port), *flags],
                                    stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                    env=_server_env())
        server = ServerProcess(proc, port, out, err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        server.stop()
        last_error = server.stderr()[-3000:]
        if "address already in use" not in last_error.lower():
            break
    raise RuntimeError(f"the server did not start:\n{last_error}")


@contextlib.contextmanager
def serve_in_thread(app, timeout: float = 60.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yields its base URL.

    The socket is bound here and handed to uvicorn, so no other process can take the port
    between choosing and binding it. The app's lifespan (the engine loop) runs inside.
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="uvicorn-test-server")
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


@contextlib.contextmanager
def serve_tiny(loaded, model_name: str = "tiny", **options) -> Iterator[tuple]:
    """The app over ``loaded`` with the small limits the in-process tests use (batch 4, queue 8,
    8 tokens, metrics on; ``options``: other ServerConfig fields or these), served in a
    thread; yields ``(server, url)``."""
    config = ServerConfig(**{"model_name": model_name, "max_batch_size": 4, "max_queue": 8,
                             "max_tokens": 8, "enable_metrics": True, **options})
    app = create_app(loaded, config)
    with serve_in_thread(app) as url:
        yield app.state.server, url
