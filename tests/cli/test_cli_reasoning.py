"""``constrained-spec generate`` on a reasoning model (``load_model`` patched to a bigram Llama
whose template opens a think block; it thinks "abab..." until its budget, then answers "c"):
stdout carries the answer only, streamed or not; ``--show-reasoning`` puts the thinking on
stderr; ``--reasoning off`` leaves the model as it is; bad values exit 2 before loading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_reasoning import LOOPING, OPEN, think_loaded  # noqa: E402

from constrained_spec.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    return think_loaded(OPEN, LOOPING)


@pytest.mark.parametrize("stream", [False, True])
def test_stdout_has_the_answer_and_stderr_the_thinking(loaded, capsys, monkeypatch, stream):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: loaded)
    argv = ["generate", "go", "--max-reasoning-tokens", "4", "--show-reasoning", "--quiet",
            "--max-tokens", "20", "--max-retries", "0"] + (["--stream"] if stream else [])
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == '"c"\n'  # the free-text answer as a JSON string, no marker
    assert "reasoning: abab" in captured.err


def test_reasoning_off_treats_the_markers_as_text(loaded, capsys, monkeypatch):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: loaded)
    # off: no budget, nothing forced; the bigram loops "abab" until max_tokens, and free text
    # that reaches max_tokens is returned as it is (finish_reason "length"), markers never forced
    code = main(["generate", "go", "--reasoning", "off", "--quiet", "--max-tokens", "8",
                 "--max-retries", "0"])
    assert code == 0 and json.loads(capsys.readouterr().out) == "abababab"


@pytest.mark.parametrize("flag, value", [("--max-reasoning-tokens", "-1"), ("--reasoning", "maybe")])
def test_bad_reasoning_flags_exit_2_before_loading(capsys, monkeypatch, flag, value):
    def refuse(*a, **k):
        raise AssertionError("loaded a model for a bad flag")

    monkeypatch.setattr("constrained_spec.model.loading.load_model", refuse)
    try:  # argparse exits for a bad choice; a ConfigError is exit status 2 from main
        code = main(["generate", "go", flag, value])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err.replace("-", "_")
