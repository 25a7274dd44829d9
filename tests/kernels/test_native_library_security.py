"""The native kernel library is executed code read from the cache folder: attacks on it.

A planted library whose constructor (``__attribute__((constructor))``) writes a marker file is
put where `kernels.cpu_native` looks for its own, with every detail right except one: the
kernels folder group-writable, its manifest missing or with a wrong digest, the file owned by
another user or writable by group or others, a symbolic link. The marker must never appear (the
library was never loaded), and the kernels must still work afterwards (rebuilt with a warning
naming the file). A library lacking a kernel, or with the wrong tiles, falls back to torch's
kernels instead of crashing. ``CC`` is a command line and a hung compiler is stopped.

Every test points the cache at its own folder and clears `cpu_native`'s cached library around
itself, so the real cache and the rest of the suite are untouched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from constrained_spec.kernels import cpu_native

BUILD = cpu_native.build_for_this_cpu()
BUILD_NAME = BUILD or "avx2"  # (the module is skipped when BUILD is None)
CC = shutil.which("cc") or "cc"  # (the module is skipped when there is none)
HAS_CC = shutil.which("cc") is not None
pytestmark = [pytest.mark.skipif(BUILD is None, reason="this CPU runs no build of the native kernels"),
              pytest.mark.skipif(not HAS_CC, reason="no C compiler (cc) to build the planted library")]

_PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
/* runs at dlopen, before any symbol is looked up: the attack */
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("CS_PLANTED_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
int cs_q4_tile(void) { return TILE; }
#ifndef WITHOUT_KERNELS  /* otherwise a library that would pass every check but the security ones */
int cs_q4_gemm(void) { return 0; }
int cs_q8_gemm(void) { return 0; }
int cs_attention(void) { return 0; }
int cs_attention_width(void) { return 8; }
#endif
"""


def _build_so(folder: Path, name: str, *defines: str) -> bytes:
    src = folder / f"{name}.c"
    src.write_text(_PLANTED_C)
    out = folder / f"{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", f"-DTILE={cpu_native.BUILDS[BUILD_NAME][2]}", *defines,
                    str(src), "-o", str(out)], check=True, capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, bytes]:
    """The planted libraries' bytes: ``full`` (every symbol, the right tiles), ``no_kernels``
    (only the tile query), ``wrong_tile``."""
    folder = tmp_path_factory.mktemp("planted")
    return {"full": _build_so(folder, "full"),
            "no_kernels": _build_so(folder, "no_kernels", "-DWITHOUT_KERNELS"),
            "wrong_tile": _build_so(folder, "wrong_tile", "-UTILE", "-DTILE=3")}


@pytest.fixture
def kernels(tmp_path, cs_env, monkeypatch):
    """A fresh cache; returns its kernels folder (not created yet). The marker's path is in
    ``CS_PLANTED_MARKER``."""
    monkeypatch.setenv("CS_PLANTED_MARKER", str(tmp_path / "planted-code-ran"))
    monkeypatch.delenv("CC", raising=False)
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"))
    cpu_native._library.cache_clear()
    yield tmp_path / "cache" / "kernels"
    cpu_native._library.cache_clear()


def _name() -> str:
    return f"cpu_native-{BUILD_NAME}-{cpu_native._key(BUILD_NAME)}"


def plant(folder: Path, lib: bytes, *, manifest: str | None = "valid", mode: int = 0o600) -> Path:
    """``lib`` where the kernels' library of this CPU's build is looked for, with a manifest
    recording its digest (``valid``), another digest (``wrong``) or none (None)."""
    folder.mkdir(parents=True, exist_ok=True)
    so = folder / f"{_name()}.so"
    so.write_bytes(lib)
    so.chmod(mode)
    if manifest is not None:
        digest = hashlib.sha256(lib if manifest == "valid" else b"something else").hexdigest()
        path = folder / f"{_name()}.json"
        path.write_text(json.dumps({"sha256": digest, "build": BUILD_NAME, "key": cpu_native._key(BUILD_NAME)}))
        path.chmod(0o600)
    return so


def marker_written() -> bool:
    return Path(os.environ["CS_PLANTED_MARKER"]).exists()


def kernels_work() -> bool:
    """The kernels load and a q4 product matches the float32 product of the same weights."""
    if not cpu_native.available():
        return False
    n, k = 2 * cpu_native.tile(), 64
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    minimum = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    w = (q.float().view(n, -1, 32) * scale[..., None] + minimum[..., None]).view(n, k)
    x = torch.randn(3, k, generator=g).bfloat16()
    got = cpu_native.matmul(x, cpu_native.pack(q, scale, minimum), out_dtype=torch.float32)
    want = x.float() @ w.T
    return float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def rebuilt(folder: Path, planted_lib: bytes) -> bool:
    """The library in ``folder`` is ours again: not the planted bytes, owner-only, recorded."""
    so = folder / f"{_name()}.so"
    recorded = json.loads((folder / f"{_name()}.json").read_text())["sha256"]
    return (so.read_bytes() != planted_lib and so.stat().st_mode & 0o777 == 0o600
            and hashlib.sha256(so.read_bytes()).hexdigest() == recorded)


def test_a_planted_library_in_a_group_writable_kernels_folder_never_runs(kernels, planted, caplog):
    plant(kernels, planted["full"])  # owner, mode and digest right: only the folder is open
    kernels.chmod(0o770)
    with caplog.at_level(logging.WARNING):
        assert kernels_work()
    assert not marker_written()
    assert kernels.stat().st_mode & 0o777 == 0o700 and rebuilt(kernels, planted["full"])
    assert str(kernels) in caplog.text and "writable by group or others" in caplog.text


@pytest.mark.parametrize("manifest", ["wrong", None], ids=["wrong-digest", "no-manifest"])
def test_a_planted_library_without_its_recorded_digest_never_runs(kernels, planted, manifest, caplog):
    so = plant(kernels, planted["full"], manifest=manifest)
    with caplog.at_level(logging.WARNING):
        assert kernels_work()
    assert not marker_written() and rebuilt(kernels, planted["full"])
    assert str(so) in caplog.text  # the warning names the file


@pytest.mark.parametrize("mode", [0o620, 0o602], ids=["group-writable", "other-writable"])
def test_a_planted_library_that_others_could_write_never_runs(kernels, planted, mode, caplog):
    so = plant(kernels, planted["full"], mode=mode)
    with caplog.at_level(logging.WARNING):
        assert kernels_work()
    assert not marker_written() and rebuilt(kernels, planted["full"])
    assert str(so) in caplog.text and "writable by group or others" in caplog.text


def test_a_planted_manifest_that_others_could_write_is_not_trusted(kernels, planted, caplog):
    plant(kernels, planted["full"])
    (kernels / f"{_name()}.json").chmod(0o666)
    with caplog.at_level(logging.WARNING):
        assert kernels_work()
    assert not marker_written() and rebuilt(kernels, planted["full"])
    assert "manifest" in caplog.text


def test_a_planted_symbolic_link_is_never_followed(kernels, planted, tmp_path):
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(planted["full"])
    plant(kernels, planted["full"])
    so = kernels / f"{_name()}.so"
    so.unlink()
    so.symlink_to(elsewhere)
    assert kernels_work()
    assert not marker_written() and not so.is_symlink() and rebuilt(kernels, planted["full"])


needs_root = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                                reason="giving a file to another user needs root (chown)")
NOBODY = 65534


@needs_root
def test_a_planted_library_owned_by_another_user_never_runs(kernels, planted, caplog):
    so = plant(kernels, planted["full"])
    os.chown(so, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING):
        assert kernels_work()
    assert not marker_written() and rebuilt(kernels, planted["full"])
    assert str(so) in caplog.text and "owned by another user" in caplog.text


@needs_root
def test_a_kernels_folder_owned_by_another_user_is_neither_built_in_nor_loaded(kernels, planted, caplog):
    so = plant(kernels, planted["full"])
    os.chown(kernels, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING):
        assert not cpu_native.available()
    assert not marker_written() and so.read_bytes() == planted["full"]  # nothing built there
    assert "owned by another user" in (cpu_native.why_unavailable() or "")
    assert str(kernels) in caplog.text


@pytest.mark.parametrize("lib", ["no_kernels", "wrong_tile"])
def test_a_library_lacking_a_kernel_falls_back_to_torch_without_a_crash(kernels, planted, lib,
                                                                          monkeypatch, caplog):
    from constrained_spec.model.weights import Int4Groups, Linear

    so = plant(kernels, planted[lib])  # ours, recorded: only its contents are wrong
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert not cpu_native.available()
    assert str(so) in caplog.text
    why = cpu_native.why_unavailable() or ""
    assert "failed its check" in why and ("lacks a kernel" in why or "tiles" in why)
    assert "no C compiler (no-such-compiler)" in why
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    assert not Linear(int4=Int4Groups.from_values(q, torch.ones(32, 2), torch.zeros(32, 2))).supports("q4")
    # with a compiler, the next process builds a good one in its place
    monkeypatch.delenv("CC")
    cpu_native._library.cache_clear()
    assert kernels_work() and rebuilt(kernels, planted[lib])


def test_a_fresh_kernels_folder_is_owner_only_under_umask_000(kernels):
    umask = os.umask(0)
    try:
        assert kernels_work()
    finally:
        os.umask(umask)
    assert cpu_native.why_unavailable() is None
    assert kernels.parent.stat().st_mode & 0o777 == 0o700 and kernels.stat().st_mode & 0o777 == 0o700
    # the library and its manifest, nothing else: no lock file, temp folder or loaded copy left
    assert sorted((p.name, p.stat().st_mode & 0o777) for p in kernels.iterdir()) == [
        (f"{_name()}.json", 0o600), (f"{_name()}.so", 0o600)]


def test_cc_is_a_command_line(kernels, tmp_path, monkeypatch):
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc-wrapper.sh"  # as "ccache gcc" would: a program, then the compiler
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{CC}" "$@"\n')
    monkeypatch.setenv("CC", f"sh {wrapper}")
    assert kernels_work()
    assert str(cpu_native.SOURCE) in log.read_text()


@pytest.mark.parametrize("cc, reason", [("no-such-compiler --flag", "no C compiler (no-such-compiler --flag)"),
                                        ("'unbalanced", "is not a command line")])
def test_a_cc_that_is_not_a_compiler_is_no_compiler(kernels, monkeypatch, cc, reason):
    monkeypatch.setenv("CC", cc)
    assert not cpu_native.available()
    assert reason in (cpu_native.why_unavailable() or "")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def test_a_hung_compiler_is_stopped_and_reported(kernels, tmp_path, monkeypatch, caplog):
    pid_file = tmp_path / "pid"
    hung = tmp_path / "hung-cc.sh"  # a compiler driver whose pass never ends
    hung.write_text(f'#!/bin/sh\nsleep 600 &\necho $! > "{pid_file}"\nwait\n')
    monkeypatch.setenv("CC", f"sh {hung}")
    monkeypatch.setattr(cpu_native, "_TIMEOUT", 1)
    with caplog.at_level(logging.WARNING):
        assert not cpu_native.available()
    assert f"sh {hung}" in caplog.text and "over 1 s" in caplog.text
    assert "timed out" in (cpu_native.why_unavailable() or "")
    assert _gone(int(pid_file.read_text()))  # the pass it started was stopped with it
    assert not list(kernels.glob(".*build-*"))  # its temp folder removed
