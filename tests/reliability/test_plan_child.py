"""The child process that measures a kernel plan, attacked.

The child (`loading._measure_plan_apart`) is started at a model's first load on a machine. It
used to run ``python -m constrained_spec`` with the caller's working folder first on
``sys.path``, so a ``constrained_spec/`` or ``torch.py`` planted there ran as our code; it could
also hang the load for an hour without a word. Here a planted package and module, each writing a
marker file when imported, are never imported by the child (built by `plan_child_command`, the
real entry point run with ``--no-model`` or a cheap probe in place of the measurement); a hung
child is killed with its process group at its timeout and the load measures in-process; a
failed child is reported with its exit code and stderr; and a plan cached while the native
kernels loaded is not reused where they do not.

A parent killed while its child measures (kill -9, SIGTERM) used to leave the child running for
minutes and its folder behind: here a forked process runs the real `_measure_plan_apart` with a
child that starts as the real one does (the package import starts its watch) and then sleeps,
the test kills that parent, and the child must be gone within seconds and its folder removed,
also when another process still holds the pipe the child watches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import constrained_spec
from constrained_spec.kernels import cpu_native
from constrained_spec.model import loading, plan
from constrained_spec.model.loading import LoadedModel, _measure_plan_apart, plan_child_command

PACKAGE_DIR = Path(constrained_spec.__file__).resolve().parent


def _plant(folder: Path, markers: Path) -> None:
    """A ``constrained_spec/`` package and a ``torch.py`` in ``folder`` that each write a
    marker file into ``markers`` when imported."""
    (folder / "constrained_spec").mkdir(parents=True)
    for path, name in ((folder / "constrained_spec" / "__init__.py", "constrained_spec"),
                       (folder / "torch.py", "torch")):
        path.write_text(f"open({str(markers / name)!r}, 'w').write('planted code ran')\n")


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """The caller stands in a folder holding planted code, with ``.``, an empty entry and a
    relative one on PYTHONPATH. Yields (that folder, the folder markers would appear in)."""
    caller, markers = tmp_path / "caller", tmp_path / "markers"
    markers.mkdir()
    _plant(caller, markers)
    monkeypatch.chdir(caller)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", ".", "constrained_spec/..", ""]))
    return caller, markers


def _before_module(cmd: list[str]) -> list[str]:
    """The interpreter and its flags of a child command line (what precedes ``-m``)."""
    return cmd[:cmd.index("-m")]


def test_the_plan_child_imports_neither_a_planted_package_nor_a_planted_torch(planted):
    caller, markers = planted
    cmd, env = plan_child_command("default", threads=1)
    if sys.version_info >= (3, 11):
        assert "-P" in _before_module(cmd)
    assert env["PYTHONSAFEPATH"] == "1" and "PYTHONPATH" not in env  # no entry was absolute
    # the child's own entry point and command line, with no model to load: it imports the
    # package and torch as the measuring child does, from a neutral folder
    with tempfile.TemporaryDirectory() as neutral:
        done = subprocess.run([*cmd, "--no-model"], cwd=neutral, env=env, capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "machine" in json.loads(done.stdout)
    assert not list(markers.iterdir()), "planted code ran in the plan child"


def test_the_planted_code_would_run_in_a_child_started_the_old_way(planted):
    # the control: the same interpreter without safe-path mode, in the caller's folder, with
    # the caller's PYTHONPATH, imports the planted package (so the test above can fail)
    caller, markers = planted
    cmd, _ = plan_child_command("default", threads=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    subprocess.run([sys.executable, *cmd[cmd.index("-m"):], "--no-model"], cwd=caller, env=env,
                   capture_output=True, timeout=300)
    assert (markers / "constrained_spec").exists()


def _probe_child(record: Path):
    """A `plan_child_command` that keeps the real interpreter, flags and environment but runs a
    probe instead of measuring: it imports the package and torch and records where it ran."""
    real = plan_child_command

    def command(spec: str, *, threads: int) -> tuple[list[str], dict[str, str]]:
        cmd, env = real(spec, threads=threads)
        probe = ("import json, os, constrained_spec, torch; "
                 f"open({str(record)!r}, 'w').write(json.dumps({{'cwd': os.getcwd(), "
                 "'package': constrained_spec.__file__}))")
        return [*_before_module(cmd), "-c", probe], env
    return command


def test_the_plan_child_runs_in_a_private_folder_and_imports_the_installed_package(
        planted, tmp_path, monkeypatch):
    caller, markers = planted
    record = tmp_path / "record.json"
    monkeypatch.setattr(loading, "plan_child_command", _probe_child(record))
    assert _measure_plan_apart("default", quiet=True, timeout_s=300) is True
    seen = json.loads(record.read_text())
    assert not list(markers.iterdir()), "planted code ran in the plan child"
    # an editable install (this checkout's) is found from the neutral folder too
    assert Path(seen["package"]).resolve().parent == PACKAGE_DIR
    assert Path(seen["cwd"]) != caller and not Path(seen["cwd"]).exists()  # removed after


def test_relative_pythonpath_entries_are_dropped_and_absolute_ones_kept(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    mine = str(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", mine, "", "lib", "./x"]))
    cmd, env = plan_child_command("models/m.gguf", threads=3)
    assert env["PYTHONPATH"] == mine
    # the model path is the caller's, made absolute: the child starts elsewhere
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "models" / "m.gguf")
    assert cmd[cmd.index("--threads") + 1] == "3"


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie left for init to reap counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _hanging_child(pids: Path):
    """A child that starts a grandchild, records both pids and hangs."""
    def command(spec: str, *, threads: int) -> tuple[list[str], dict[str, str]]:
        code = ("import os, subprocess, sys, time; "
                "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}'); time.sleep(120)")
        return [sys.executable, "-c", code], dict(os.environ)
    return command


def test_a_hung_child_is_killed_with_its_group_at_the_timeout_and_the_parent_says_so(
        tmp_path, monkeypatch, caplog, capsys):
    pids = tmp_path / "pids"
    monkeypatch.setattr(loading, "plan_child_command", _hanging_child(pids))
    with caplog.at_level(logging.WARNING, logger="constrained_spec.model.loading"):
        # the child needs a moment to start its grandchild: a timeout of a few seconds
        assert _measure_plan_apart("default", quiet=False, timeout_s=4, progress_s=0.5) is False
    assert "still running after 4 s" in caplog.text and "measuring here" in caplog.text
    err = capsys.readouterr().err
    assert "at most" in err and "still measuring the kernel plan in a child process" in err
    child, grandchild = map(int, pids.read_text().split())
    for _ in range(100):  # init reaps the orphaned grandchild in its own time
        if _gone(child) and _gone(grandchild):
            break
        time.sleep(0.1)
    assert _gone(child) and _gone(grandchild)


def test_a_failed_child_is_reported_with_its_exit_code_and_stderr(monkeypatch, caplog):
    def failing(spec: str, *, threads: int) -> tuple[list[str], dict[str, str]]:
        code = "import sys; sys.stderr.write('boom: no such model'); sys.exit(3)"
        return [sys.executable, "-c", code], dict(os.environ)

    monkeypatch.setattr(loading, "plan_child_command", failing)
    with caplog.at_level(logging.WARNING, logger="constrained_spec.model.loading"):
        assert _measure_plan_apart("default", quiet=True, timeout_s=60) is False
    assert "exit 3" in caplog.text and "boom: no such model" in caplog.text


def test_when_the_child_hangs_the_load_measures_in_process(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loading, "plan_child_command", _hanging_child(tmp_path / "pids"))
    monkeypatch.setattr(loading, "_MEASURE_APART", True)  # off only inside a measuring child
    monkeypatch.setattr(plan, "plan_to_measure", lambda *a, **k: True)
    monkeypatch.setattr(plan, "measure_timeout", lambda *a, **k: 2.0)
    chosen = []
    monkeypatch.setattr(plan, "choose_plan", lambda runner, **k: chosen.append(runner) or "plan")
    model = LoadedModel(name="m", model=None, tokenizer=None, device=torch.device("cpu"),
                        dtype=torch.float32, vocab_size=1, spec="default", quiet=True)
    runner = object()
    with caplog.at_level(logging.WARNING, logger="constrained_spec.model.loading"):
        assert model._plan(runner) == "plan"
    assert chosen == [runner] and "still running after" in caplog.text


class _Runner:
    """What plan_key and plan_to_measure read of a runner."""

    device = torch.device("cpu")
    exact = True


def test_a_plan_cached_with_native_kernels_is_not_used_where_they_cannot_load(
        tmp_path, monkeypatch, cs_env):
    cs_env(CONSTRAINED_SPEC_PLAN=None, CONSTRAINED_SPEC_MEMORY=None)
    runner = _Runner()
    monkeypatch.setattr(cpu_native, "available", lambda build=None: True)
    native_plan = plan.KernelPlan.parse("prefill=q4,decode=q4,lm_head=q8")
    plan._store(tmp_path / plan.PLAN_FILE, plan.plan_key(runner), native_plan)
    assert plan._cached(tmp_path / plan.PLAN_FILE, plan.plan_key(runner)) is not None  # found
    monkeypatch.setattr(cpu_native, "available", lambda build=None: False)  # e.g. no compiler
    # not found there: the load takes the flag plan, which offers q4 only where it loads
    assert plan._cached(tmp_path / plan.PLAN_FILE, plan.plan_key(runner)) is None


class _Sized:
    """A runner of ``layers`` SmolLM2-135M-sized layers (576 wide) for `plan.measure_timeout`."""

    def __init__(self, layers: int) -> None:
        class Lin:
            def __init__(self, n: int, k: int) -> None:
                self.shape = (n, k)

        self._linears = [Lin(n, k) for _ in range(layers)
                         for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
        self.lm_head_weight = Lin(49152, 576)

    def linears(self) -> list:
        return self._linears

    def supports_kernel(self, kernel: str) -> bool:
        return kernel in ("fp32", "bf16", "int4", "q4")


def test_the_child_timeout_is_minutes_for_the_embedded_model_and_grows_with_its_work(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    embedded = plan.measure_timeout(_Sized(30))
    assert 4 * 60 <= embedded <= 15 * 60  # minutes, not the hour it was
    assert plan.measure_timeout(_Sized(300)) > 5 * embedded  # ten times the weights
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert plan.measure_timeout(_Sized(30)) > embedded  # one thread is slower


def test_info_says_when_the_native_kernels_cannot_load_and_why(monkeypatch, capsys):
    from constrained_spec import cli

    monkeypatch.setattr(cpu_native, "available", lambda build=None: False)
    monkeypatch.setattr(cpu_native, "why_unavailable", lambda build=None: "no C compiler (cc)")
    assert cli.main(["info", "--no-model", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native_kernels"]["available"] is False
    assert report["native_kernels"]["why_unavailable"] == "no C compiler (cc)"
    assert cli.main(["info", "--no-model"]) == 0
    assert "native q4/q8 kernels: not available (no C compiler (cc))" in capsys.readouterr().out


# -- a parent killed while its child measures ------------------------------------------------
_CTX = mp.get_context("fork")  # the parent costs no interpreter start: only its child does


def _parent_measuring(record: Path, holder: Path | None) -> None:
    """A process measuring a plan, for the test to kill: the real `_measure_plan_apart` (its
    private folder, the pipe on the child's stdin, the variable naming the parent), whose child
    keeps the real interpreter, flags and environment but runs a probe: it imports the package
    (which starts the child's watch of its parent, as in the real child), records its pid, its
    folder and whether the variable was left for processes it would start, and sleeps as long
    as a measurement lasts. With ``holder``, another process is started holding the parent's
    end of the pipe (its pid written there), so that the pipe never reaches EOF."""
    real_command, real_popen = plan_child_command, subprocess.Popen

    def command(spec: str, *, threads: int) -> tuple[list[str], dict[str, str]]:
        cmd, env = real_command(spec, threads=threads)
        probe = ("import json, os, time, constrained_spec; "
                 "seen = {'pid': os.getpid(), 'cwd': os.getcwd(), "
                 f"'variable_left': {loading._PARENT_VARIABLE!r} in os.environ}}; "
                 f"open({str(record)!r} + '.tmp', 'w').write(json.dumps(seen)); "
                 f"os.replace({str(record)!r} + '.tmp', {str(record)!r}); time.sleep(120)")
        return [*_before_module(cmd), "-c", probe], env

    def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
        child = real_popen(cmd, **kwargs)
        if holder is not None and child.stdin is not None:
            held = real_popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              pass_fds=[child.stdin.fileno()], start_new_session=True)
            holder.write_text(str(held.pid))
        return child

    loading.plan_child_command = command  # this forked process's own module: nothing to undo
    subprocess.Popen = popen  # type: ignore[assignment, misc]
    _measure_plan_apart("default", quiet=True, timeout_s=300)


def _child_of_killed_parent(tmp_path: Path, sig: int, *, hold_pipe: bool) -> tuple[dict, float]:
    """Start `_parent_measuring`, wait for its child to run, send the parent ``sig``. Returns
    what the child recorded and how long after the signal it was gone with its folder (or
    ``inf`` after 10 s; a child left running is killed then)."""
    record, holder = tmp_path / "child.json", tmp_path / "holder.pid"
    parent = _CTX.Process(target=_parent_measuring, args=(record, holder if hold_pipe else None))
    parent.start()
    child: dict = {}
    try:
        deadline = time.monotonic() + 60
        while not record.exists():
            assert parent.is_alive() and time.monotonic() < deadline, "the plan child never ran"
            time.sleep(0.05)
        child = json.loads(record.read_text())
        time.sleep(0.5)  # the child is past its import: measuring, as far as it knows
        assert not _gone(child["pid"]) and Path(child["cwd"]).is_dir()
        assert parent.pid is not None
        os.kill(parent.pid, sig)
        killed = time.monotonic()
        parent.join(10)
        while time.monotonic() - killed < 10:
            if _gone(child["pid"]) and not Path(child["cwd"]).exists():
                return child, time.monotonic() - killed
            time.sleep(0.05)
        return child, float("inf")
    finally:
        for pid in ([child["pid"]] if child else []) + \
                ([int(holder.read_text())] if holder.exists() else []):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if parent.is_alive():
            parent.kill()
            parent.join(5)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_the_plan_child_ends_and_removes_its_folder_when_its_parent_is_killed(tmp_path, sig):
    child, after = _child_of_killed_parent(tmp_path, sig, hold_pipe=False)
    assert after < 5, "the plan child outlived its parent, or left its folder"
    assert child["variable_left"] is False  # what the child starts watches nothing


def test_the_plan_child_ends_with_its_parent_while_another_process_holds_its_pipe(tmp_path):
    # the pipe never reaches EOF: the parent-death signal (Linux) or the pid poll ends it
    _, after = _child_of_killed_parent(tmp_path, signal.SIGKILL, hold_pipe=True)
    assert after < 5, "the plan child outlived its parent, or left its folder"


def test_a_process_not_started_as_a_plan_child_watches_no_parent(monkeypatch):
    monkeypatch.delenv(loading._PARENT_VARIABLE, raising=False)
    threads = threading.active_count()
    loading.end_with_parent()
    assert threading.active_count() == threads
