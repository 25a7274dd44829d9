"""The first-use benchmark times a fresh process to its first line, on its own empty cache."""

from __future__ import annotations

import sys

from benchmarks import first_use


def test_a_run_is_timed_to_its_first_line_on_an_empty_cache_of_its_own(monkeypatch):
    code = ("import os, sys; c = os.environ['CONSTRAINED_SPEC_CACHE']; "
            "print('empty' if not os.listdir(c) else 'used', flush=True); sys.stdout.close()")
    monkeypatch.setattr(first_use, "_command", lambda model, system: [sys.executable, "-c", code])
    row = first_use.time_first_object(None)
    assert row["object"] == "empty" and 0 < float(row["seconds"]) < 60


def test_a_failed_run_says_why(monkeypatch):
    code = "import sys; sys.stderr.write('no model here'); sys.exit(4)"
    monkeypatch.setattr(first_use, "_command", lambda model, system: [sys.executable, "-c", code])
    try:
        first_use.time_first_object(None)
    except RuntimeError as e:
        assert "no model here" in str(e) and "(4)" in str(e)
    else:
        raise AssertionError("a failed run must raise")


def test_the_table_names_the_command_and_every_run():
    rows = [{"condition": "quiet", "run": 1, "seconds": 18.7, "load_start": 0.4, "load_end": 1.0},
            {"condition": "busy (4 spinning processes)", "run": 1, "seconds": 41.0,
             "load_start": 4.1, "load_end": 5.2}]
    text = first_use.table(rows, None)
    assert "examples/quickstart.py" in text and "| quiet | ours | 1 | 18.7 | 0.4 / 1.0 |" in text
    assert "busy (4 spinning processes)" in text
    assert "tiny.gguf" in first_use.table(rows, "/x/tiny.gguf")


def test_with_the_peer_the_runs_alternate_and_the_ratio_is_of_medians(monkeypatch):
    seen = []

    def fake(model, system):
        seen.append(system)
        return {"system": system, "seconds": {"ours": 10.0, "llama-cpp-python": 4.0}[system] + len(seen),
                "load_start": 0.1, "load_end": 0.2, "object": "{}"}

    monkeypatch.setattr(first_use, "time_first_object", fake)
    rows = first_use.run("quiet", 0, 3, "/x/m.gguf", first_use.SYSTEMS)
    assert seen == ["ours", "llama-cpp-python"] * 3
    # ours: 11, 13, 15 -> 13; theirs: 6, 8, 10 -> 8
    assert first_use.ratio_lines(rows) == [
        "- quiet: ours 13.0 s, llama-cpp-python 8.0 s (medians): **1.62x** llama-cpp-python's "
        "time to its first object"]
    assert "| quiet | llama-cpp-python | 2 | 8.0 |" in first_use.table(rows, "/x/m.gguf")


def test_the_peer_needs_a_file():
    import pytest

    with pytest.raises(ValueError, match="needs a GGUF"):
        first_use._command(None, "llama-cpp-python")
