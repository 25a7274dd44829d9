"""Start ``examples/openai_server.py`` as a real process on a free loopback port (test helper)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_server.py"


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


def start_server(*flags: str, timeout: float = 240.0) -> ServerProcess:
    """Start the server with ``flags`` and wait until ``GET /health`` answers."""
    logs = Path(tempfile.mkdtemp(prefix="openai-server-"))
    last_error: str = ""
    for _ in range(3):  # the free port may be taken between probing and binding
        port = free_port()
        out, err = logs / f"{port}.stdout", logs / f"{port}.stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port), *flags],
                                    stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
