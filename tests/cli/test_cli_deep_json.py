"""Deeply nested JSON given to the command line, as an attacker writes it: a schema (file or
inline, for ``generate`` and ``schema-check``) exits 3 naming the limit, a tool file or
``--speculative-config`` exits 2, and a ``--batch`` line gets its own error record while every
other line's output is kept; never an exit 1 or a traceback (the tiny Llama stands in for
the model)."""

from __future__ import annotations

import io
import json

import pytest

from constrained_spec.cli import main
from constrained_spec.json_limits import MAX_JSON_DEPTH
from constrained_spec.schemas.spec import MAX_SCHEMA_DEPTH

ENUM = json.dumps({"enum": ["yes", "no"]})


def arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_schema_text(depth: int = 5000) -> str:
    """A schema whose ``enum`` nests ``depth`` arrays: 10 KB for 5,000 levels."""
    return '{"enum": ' + arrays(depth) + "}"


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("constrained_spec.model.loading.load_model", refuse)


@pytest.fixture
def tiny_cli(tiny_loaded, monkeypatch):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: tiny_loaded)


def one_line_error(capsys, kind: str) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"constrained-spec: {kind}:"), captured.err
    assert "Traceback" not in captured.err and "RecursionError" not in captured.err
    return lines[0]


@pytest.mark.parametrize("inline", [False, True])
def test_a_deep_schema_exits_3_naming_the_limit_before_any_model_loads(inline, tmp_path, capsys,
                                                                       no_model):
    path = tmp_path / "deep.json"
    path.write_text(deep_schema_text())
    schema = deep_schema_text() if inline else str(path)
    assert main(["generate", "p", "--schema", schema]) == 3
    err = one_line_error(capsys, "schema error")
    assert f"deeper than {MAX_SCHEMA_DEPTH} levels" in err and "/enum" in err
    if not inline:
        assert "deep.json" in err


@pytest.mark.parametrize("depth", [5000, MAX_SCHEMA_DEPTH + 1])
def test_schema_check_on_a_deep_schema_exits_3_with_one_line(depth, tmp_path, capsys, no_model):
    path = tmp_path / "deep.json"
    path.write_text(deep_schema_text(depth))
    assert main(["schema-check", str(path)]) == 3
    assert f"deeper than {MAX_SCHEMA_DEPTH} levels" in one_line_error(capsys, "schema error")


def test_a_deep_tool_file_or_speculative_config_is_a_usage_error(tmp_path, capsys, no_model):
    tool = tmp_path / "tool.json"
    tool.write_text(json.dumps({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object"}, "x": "DEEP"}}).replace('"DEEP"', arrays(5000)))
    assert main(["generate", "p", "--tool", str(tool)]) == 2
    assert f"deeper than {MAX_JSON_DEPTH} levels" in one_line_error(capsys, "error")
    assert main(["generate", "p", "--speculative-config", arrays(5000)]) == 2
    err = one_line_error(capsys, "error")
    assert "--speculative-config" in err and f"deeper than {MAX_JSON_DEPTH}" in err


def test_a_batch_with_deep_lines_keeps_every_other_line_output(tmp_path, capsys, tiny_cli):
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "f", "arguments": arrays(5000)}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "1"},
               {"role": "user", "content": "b"}]
    lines = ['"first"',
             '{"prompt": "deep", "x": ' + arrays(5000) + "}",               # the line itself
             json.dumps({"prompt": "p", "schema": json.loads(deep_schema_text(200))}),
             json.dumps({"prompt": "p", "schema": deep_schema_text()}),     # schema as text
             json.dumps({"prompt": history}),                               # call arguments
             '{"prompt": "last"}']
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    code = main(["generate", "--batch", str(batch), "--schema", ENUM, "--max-tokens", "4",
                 "--quiet"])
    captured = capsys.readouterr()
    assert code == 7, captured.err
    assert "Traceback" not in captured.err
    records = [json.loads(r) for r in captured.out.splitlines()]
    assert len(records) == len(lines)
    assert records[0] in ("yes", "no") and records[-1] in ("yes", "no")
    errors = {r["error"]["line"]: r["error"] for r in records[1:-1]}
    assert sorted(errors) == [2, 3, 4, 5]
    assert errors[2]["type"] == "JSONDepthError" and f"{MAX_JSON_DEPTH} levels" in errors[2]["message"]
    assert errors[3]["type"] == errors[4]["type"] == "SchemaError"
    assert all(f"{MAX_SCHEMA_DEPTH} levels" in errors[n]["message"] for n in (3, 4))
    assert errors[5]["type"] == "JSONDepthError" and "messages[1]" in errors[5]["message"]


def test_a_deep_json_prompt_on_stdin_is_text_not_a_crash(monkeypatch, capsys, tiny_cli):
    monkeypatch.setattr("sys.stdin", io.StringIO(arrays(5000)))
    code = main(["generate", "--schema", ENUM, "--max-tokens", "4", "--quiet"])
    captured = capsys.readouterr()
    assert code in (0, 2), captured.err  # an answer, or a prompt longer than the context
    assert "internal error" not in captured.err and "Traceback" not in captured.err
