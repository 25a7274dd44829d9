"""The model cache under concurrent first use, kill points and damage (cache.cached_build).

Builds here are tiny stand-ins for the model conversion (a few files, a sleep to widen the
race); the mechanism is the one the embedded model and user checkpoints go through.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.synchronize import Event
from pathlib import Path

from cs_testlib import race

from constrained_spec.cache import cache_complete, cache_lock, cached_build


def _slow_build(tmp: Path, tag: str = "x", pause: float = 0.3) -> None:
    (tmp / "config.json").write_text('{"tag": "%s"}' % tag)
    time.sleep(pause)  # a long conversion: the other process arrives in the middle of it
    (tmp / "weights.bin").write_bytes(os.urandom(1 << 16))


def _racer(out: str, tag: str, started: Event, results: mp.Queue) -> None:
    started.wait()
    built: list[str] = []

    def build(tmp: Path) -> None:
        built.append(tag)
        _slow_build(tmp, tag)

    path = cached_build(Path(out), build)
    results.put((tag, bool(built), cache_complete(path)))


def test_concurrent_first_use_builds_once_and_leaves_a_complete_cache(tmp_path):
    out = tmp_path / "model-v1"
    got = race(_racer, [(str(out), f"p{i}") for i in range(3)])
    assert sum(built for _, built, _ in got) == 1  # one conversion; the others waited and reused it
    assert all(complete for _, _, complete in got)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["model-v1"]


def test_forced_interleaving_waiting_process_reuses_the_finished_build(tmp_path):
    out = tmp_path / "model-v1"
    ctx = mp.get_context("fork")
    started, results = ctx.Event(), ctx.Queue()
    # hold the lock as a converting process would, then let another process arrive
    with cache_lock(out.with_name(f".{out.name}.lock")):
        proc = ctx.Process(target=_racer, args=(str(out), "late", started, results))
        proc.start()
        started.set()
        time.sleep(0.3)
        assert proc.is_alive()  # it waits for the lock instead of writing beside us
        tmp = tmp_path / ".model-v1.tmp-mine"
        tmp.mkdir()
        _slow_build(tmp, "first", pause=0)
        (tmp / "done").write_text('{"files": {"config.json": %d, "weights.bin": %d}}' % (
            (tmp / "config.json").stat().st_size, (tmp / "weights.bin").stat().st_size))
        os.replace(tmp, out)
    proc.join(30)
    tag, built, complete = results.get(timeout=5)
    assert not built and complete
    assert '"first"' in (out / "config.json").read_text()


def _killed_build(out: str) -> None:
    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        (tmp / "partial.bin").write_bytes(b"\0" * 4096)
        time.sleep(60)

    cached_build(Path(out), build)


def test_a_build_killed_midway_leaves_nothing_that_the_next_run_trusts(tmp_path):
    out = tmp_path / "model-v1"
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_killed_build, args=(str(out),))
    proc.start()
    deadline = time.time() + 10
    while not list(tmp_path.glob(".model-v1.tmp-*/partial.bin")) and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert not out.exists()
    path = cached_build(out, _slow_build)
    assert cache_complete(path)
    assert not list(tmp_path.glob(".model-v1.tmp-*"))  # the orphan temp folder was removed


def test_a_damaged_cache_is_rebuilt_with_a_warning(tmp_path, caplog):
    out = cached_build(tmp_path / "model-v1", _slow_build)
    (out / "weights.bin").write_bytes(b"short")  # truncated by a full disk, say
    assert not cache_complete(out)
    with caplog.at_level("WARNING"):
        cached_build(out, lambda tmp: _slow_build(tmp, "again", pause=0))
    assert cache_complete(out) and '"again"' in (out / "config.json").read_text()
    assert "rebuilding" in caplog.text
