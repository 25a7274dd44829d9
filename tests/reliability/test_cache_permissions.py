"""The cache folder is owner-only whatever the umask, says what is wrong with a bad one, and
leaves no lock file behind.

Attacks and mistakes: a process started under ``umask 000`` (whose files would otherwise be
writable by everyone, and then swapped by anyone), a ``CONSTRAINED_SPEC_CACHE`` that is a file
or cannot be created, a cache root that others can write, zero-byte lock files left by failed
and finished builds, and the race that removing a lock file opens unless the lock is taken
with care. Each test points the cache at its own folder.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from constrained_spec.cache import cache_dir, cache_lock, cached_build, write_cached_json, write_private
from constrained_spec.errors import ConfigError


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The most permissive umask for the test's own writes (restored after)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def open_to_others(root: Path) -> list[str]:
    """Every file or folder under ``root`` (itself included) that group or others can write,
    or that is not exactly 0700 (folders) / 0600 (files)."""
    found = []
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        want = 0o700 if p.is_dir() else 0o600
        if not p.is_symlink() and (mode & 0o022 or mode != want):
            found.append(f"{p.relative_to(root.parent)} {mode:03o}")
    return found


def third_party_build(tmp: Path) -> None:
    """A build that writes as libraries do (plain open and mkdir: the umask's modes)."""
    (tmp / "weights.bin").write_bytes(b"\0" * 64)
    (tmp / "tokenizer").mkdir()
    (tmp / "tokenizer" / "tokenizer.json").write_text("{}")



def _import_engine_tests() -> None:
    """tests/engine on sys.path: the tiny GGUF writers live there."""
    engine_tests = str(Path(__file__).resolve().parents[1] / "engine")
    if engine_tests not in sys.path:
        sys.path.append(engine_tests)


def _fresh_fp32_cache(tmp_path, cs_env, monkeypatch, loading) -> None:
    """A fresh cache under ``tmp_path``, a fixed fp32 plan (nothing measured), no model loaded."""
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"),
           CONSTRAINED_SPEC_PLAN="prefill=fp32,decode=fp32,lm_head=fp32")
    monkeypatch.setattr(loading, "_LOADED", {})

def test_a_fresh_cache_under_umask_000_holds_nothing_group_or_other_writable(tmp_path, cs_env, umask_000):
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "deep" / "cache"))
    root = cache_dir()
    out = cached_build(root / "models" / "tiny-v1", third_party_build)
    write_cached_json(out / "source.json", {"int8_worth_it": False})
    write_private(root / "plans" / "ab12" / "plan.json", "{}")
    with cache_lock(root / "gguf" / ".fetch.lock"):
        assert (root / "gguf" / ".fetch.lock").stat().st_mode & 0o777 == 0o600
    assert open_to_others(tmp_path / "deep") == []
    assert json.loads((out / "source.json").read_text()) == {"int8_worth_it": False}


def test_the_stores_of_the_model_loader_are_owner_only_under_umask_000(tmp_path, cs_env, monkeypatch,
                                                                       umask_000):
    """The digest index, a not-lean marker, the dtype marker and the kernel plan store."""
    import torch
    from cs_testlib import tiny_llama

    from constrained_spec.model import loading, plan

    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"))
    gguf = tmp_path / "not-lean.gguf"
    gguf.write_bytes(b"GGUF stand-in")

    def not_lean(*args):
        raise loading._NotLean("architecture 'x' is not one the lean runner runs")

    monkeypatch.setattr(loading, "_convert_gguf", not_lean)
    assert loading.load_gguf_lean(gguf, quiet=True) is None  # digest index + not-lean marker
    folder = tmp_path / "cache" / "plans" / "ab12"
    loading._choose_dtype("auto", torch.device("cpu"), tiny_llama(vocab_size=128), folder)  # dtype marker
    plan._store(folder / plan.PLAN_FILE, "machine", plan.KernelPlan.parse("prefill=fp32,decode=fp32,lm_head=fp32"))
    root = tmp_path / "cache"
    assert {p.name for p in root.rglob("*") if p.is_file()} >= {
        "digests.json", "dtype.json", plan.PLAN_FILE} and list(root.rglob("*.not-lean"))
    assert open_to_others(root) == []


def test_a_converted_gguf_is_owner_only_under_umask_000(tmp_path, cs_env, monkeypatch, umask_000):
    pytest.importorskip("gguf")
    _import_engine_tests()
    from test_gguf_load import write_tiny_llama

    from constrained_spec.model import loading

    _fresh_fp32_cache(tmp_path, cs_env, monkeypatch, loading)
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    loaded = loading.load_model(path, quiet=True)
    assert loaded.path is not None and (loaded.path / "weights.safetensors").is_file()
    assert open_to_others(tmp_path / "cache") == []


def test_a_gguf_without_a_tokenizer_is_a_model_load_error_naming_it(tmp_path, cs_env, monkeypatch):
    import numpy as np

    pytest.importorskip("gguf")
    _import_engine_tests()
    from test_gguf_weights import finish, llama_writer

    from constrained_spec import cli
    from constrained_spec.model import loading

    _fresh_fp32_cache(tmp_path, cs_env, monkeypatch, loading)
    path = tmp_path / "no-tokenizer.gguf"
    rng = np.random.default_rng(0)
    hidden, ffn, vocab = 64, 128, 32
    w = llama_writer(path, layers=1, context=64, hidden=hidden, ffn=ffn, heads=2, kv_heads=1, vocab=vocab)
    shapes = {"token_embd": (vocab, hidden), "blk.0.attn_q": (hidden, hidden), "blk.0.attn_k": (32, hidden),
              "blk.0.attn_v": (32, hidden), "blk.0.attn_output": (hidden, hidden),
              "blk.0.ffn_gate": (ffn, hidden), "blk.0.ffn_up": (ffn, hidden),
              "blk.0.ffn_down": (hidden, ffn), "output": (vocab, hidden)}
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (0.05 * rng.standard_normal(shape)).astype(np.float32))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(hidden, dtype=np.float32))
    finish(w)  # every tensor and hyperparameter, no tokenizer.ggml.* entry
    from constrained_spec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="no tokenizer") as e:
        loading.load_model(path, quiet=True)
    assert str(path) in str(e.value) and "tokenizer.ggml.model" in str(e.value)
    # the failed conversion left no lock file (nor temp folder) behind
    assert not [p.name for p in (tmp_path / "cache").rglob(".*")]
    assert cli.main(["info", "--model", str(path), "--quiet"]) == 5


def test_a_cache_variable_naming_a_file_is_a_config_error_naming_it(tmp_path, cs_env, monkeypatch, capsys):
    from constrained_spec import cli
    from constrained_spec.model import loading

    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    cs_env(CONSTRAINED_SPEC_CACHE=str(not_a_folder))
    with pytest.raises(ConfigError, match="CONSTRAINED_SPEC_CACHE") as e:
        cache_dir()
    assert e.value.option == "CONSTRAINED_SPEC_CACHE" and str(not_a_folder) in str(e.value)
    assert "is a file" in str(e.value)
    monkeypatch.setattr(loading, "_LOADED", {})  # a model loaded earlier would not read the cache
    assert cli.main(["info", "--quiet"]) == 2
    assert "CONSTRAINED_SPEC_CACHE" in capsys.readouterr().err


def test_a_cache_that_cannot_be_created_is_a_config_error_naming_it(tmp_path, cs_env):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cs_env(CONSTRAINED_SPEC_CACHE=str(blocker / "cache"))
    with pytest.raises(ConfigError, match="cannot be created") as e:
        cache_dir()
    assert e.value.option == "CONSTRAINED_SPEC_CACHE" and str(blocker / "cache") in str(e.value)


def test_a_cache_root_others_can_write_is_warned_about_once(tmp_path, cs_env, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cs_env(CONSTRAINED_SPEC_CACHE=str(shared))
    with caplog.at_level(logging.WARNING, logger="constrained_spec.cache"):
        assert cache_dir() == shared
        cache_dir()
    warned = [r for r in caplog.records if str(shared) in r.getMessage()]
    assert len(warned) == 1 and "writable by group or others" in warned[0].getMessage()
    assert shared.stat().st_mode & 0o777 == 0o777  # the user's folder: warned about, not changed


def test_failed_and_finished_builds_leave_no_lock_file(tmp_path, cs_env):
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"))
    models = cache_dir() / "models"

    def failing(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise ValueError("the conversion failed")

    with pytest.raises(ValueError):
        cached_build(models / "broken-v1", failing)
    cached_build(models / "fine-v1", third_party_build)
    assert sorted(p.name for p in models.iterdir()) == ["fine-v1"]


def _count_under_lock(lock: str, counter: str, rounds: int) -> None:
    """Increment ``counter`` ``rounds`` times, each a read, a pause and a write under ``lock``:
    an increment is lost whenever two processes are inside at once."""
    for _ in range(rounds):
        with cache_lock(Path(lock)):
            value = int(Path(counter).read_text())
            time.sleep(0.0005)
            Path(counter).write_text(str(value + 1))


def test_removing_lock_files_keeps_the_lock_exclusive(tmp_path):
    """A waiter that locked a file its holder removed must not work beside a process that
    locked the new file at the same path (cache_lock's check after flock)."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_count_under_lock, args=(str(tmp_path / ".x.lock"), str(counter), 40))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert int(counter.read_text()) == 160
    assert not (tmp_path / ".x.lock").exists()


def test_a_process_forked_while_the_lock_was_held_gets_it_after_the_release(tmp_path):
    """The lock is released by flock, not by closing our descriptor: a child forked while it
    was held shares the open file, and waiting for the lock it would otherwise wait on itself."""
    lock = tmp_path / ".y.lock"
    (tmp_path / "n").write_text("0")
    ctx = mp.get_context("fork")
    with cache_lock(lock):
        child = ctx.Process(target=_count_under_lock, args=(str(lock), str(tmp_path / "n"), 1))
        child.start()
        time.sleep(0.3)
        assert child.is_alive()  # waiting for the lock
    child.join(30)  # still waiting if the release did not reach the file it shares
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0 and (tmp_path / "n").read_text() == "1"
