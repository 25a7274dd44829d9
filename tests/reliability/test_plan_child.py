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
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
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
