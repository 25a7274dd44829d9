"""Bad input on the command line, in process: one error line on stderr, nothing on stdout, the
exit code of the error's type, and no model loaded for a bad schema or option. With --batch,
bad lines become error records while the good lines run."""

from __future__ import annotations

import io
import json
import sys

import pytest
from cs_testlib import recording_http_server

from constrained_spec.cli import main
from constrained_spec.schemas.spec import MAX_SCHEMA_DEPTH


@pytest.fixture
def no_model(monkeypatch):
    def load(*a, **k):
        raise AssertionError("a model was loaded for bad input")

    monkeypatch.setattr("constrained_spec.model.loading.load_model", load)
    monkeypatch.setattr("constrained_spec.api.load_model", load)


def run(argv, capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def deep_schema(depth: int) -> str:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.mark.parametrize("flags, where", [
    (["--schema", '{"type": "object", "properties": '], "malformed JSON"),
    (["--schema", "[1, 2, 3]"], "a JSON Schema is an object"),
    (["--schema", '{"type": "strin"}'], "/type"),
    (["--schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}'],
     "/properties/a/$ref"),
    (["--schema", '{"$ref": "other.json#/x"}'], "/$ref"),
    (["--schema", deep_schema(MAX_SCHEMA_DEPTH)], f"deeper than {MAX_SCHEMA_DEPTH}"),
    (["--schema", json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(12_000)}})],
     "/properties"),
    (["--schema", '{"type": "string", "pattern": "(unclosed"}'], "/pattern"),
    (["--regex", "(unclosed"], "invalid regular expression"),
    (["--schema", "name, age integer"], "age"),
])
def test_bad_schema_exits_3_with_one_line_naming_where(flags, where, capsys, no_model):
    code, out, err = run(["generate", "a prompt", *flags], capsys)
    assert code == 3
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("constrained-spec: schema error:")
    assert where in lines[0]


@pytest.mark.parametrize("mode", ["default", "strict", "lenient"])
def test_refs_outside_the_schema_exit_3_and_are_never_read(mode, tmp_path, capsys, monkeypatch,
                                                           no_model):
    secret = tmp_path / "secret.json"
    secret.write_text('{"const": "cli-secret-81d2"}')
    with recording_http_server() as (base, paths):
        for ref in (f"{base}/s.json", secret.as_uri()):
            schema = json.dumps({"type": "object", "properties": {"a": {"$ref": ref}}})
            for argv in (["generate", "a prompt", "--schema", schema, "--schema-mode", mode],
                         ["schema-check", schema, "--schema-mode", mode]):
                code, out, err = run(argv, capsys)
                assert code == 3, argv
                assert "/properties/a/$ref" in err and "never fetched" in err
                assert "cli-secret-81d2" not in out + err
            line = json.dumps({"prompt": "p", "schema": json.loads(schema)})
            code, out, err = run(["generate", "--batch", "-", "--schema-mode", mode], capsys,
                                 stdin=line + "\n", monkeypatch=monkeypatch)
            assert code == 7
            assert json.loads(out)["error"]["type"] == "SchemaError"
            assert "cli-secret-81d2" not in out + err
        assert paths == []


@pytest.mark.parametrize("flags, where", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "-3"], "max_tokens"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--top-p", "nan"], "top_p"),
    (["--seed", str(2 ** 63)], "seed"),
    (["--seed", str(-(2 ** 64))], "seed"),
    (["--speculative-config", '{"method": "ngram", "max_forced_tokens": 1000000000}'],
     "max_forced_tokens"),
    (["--speculative-config", '{"method": "medusa"}'], "speculative.method"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'],
     "num_speculative_tokens"),
    (["--speculative-config", "not json"], "--speculative-config"),
])
def test_bad_option_exits_2_with_one_line_naming_the_option(flags, where, capsys, no_model):
    code, out, err = run(["generate", "a prompt", "--schema", "name", *flags], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and where in lines[0]


def test_unknown_speculative_algorithm_is_refused_by_the_parser(capsys, no_model):
    with pytest.raises(SystemExit) as info:
        main(["generate", "a prompt", "--speculative-algorithm", "medusa"])
    assert info.value.code == 2
    assert "medusa" in capsys.readouterr().err


def test_empty_prompt_on_stdin_exits_2(capsys, monkeypatch, no_model):
    code, out, err = run(["generate", "--schema", "name"], capsys, stdin="  \n", monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "prompt" in err


def test_schema_check_reports_bad_schemas_with_exit_3(capsys, no_model):
    code, out, err = run(["schema-check", '{"type": "object", "properties": {"a": {"$ref": "#/x"}}}'],
                         capsys)
    assert code == 3 and "/properties/a/$ref" in out + err
    code, out, err = run(["schema-check", "--json", '{"type": "number", "minimum": NaN}'], capsys)
    assert code == 3 and "/minimum" in err


@pytest.mark.model
def test_batch_runs_good_lines_and_reports_bad_ones(tmp_path, capsys, embedded, monkeypatch):
    from constrained_spec.model import loading as models
    monkeypatch.setattr(models, "load_model", lambda *a, **k: embedded)
    lines = [
        '{"prompt": "Is water wet? Answer yes or no.", "schema": {"enum": ["yes", "no"]}}',
        '{"prompt": "x", "schema": {"type": 5}}',
        '{"prompt": "x", "schema": {"$ref": "#/nope"}}',
        '{"prompt": "", "schema": {"enum": ["yes", "no"]}}',
        '{"prompt": "' + "word " * (embedded.max_context + 10) + '", "schema": {"enum": ["a"]}}',
        "{broken",
        '{"prompt": "Is fire cold? Answer yes or no.", "schema": {"enum": ["yes", "no"]}}',
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run(["generate", "--batch", str(path), "--max-tokens", "8", "--quiet"], capsys)
    assert code == 7
    records = [json.loads(x) for x in out.splitlines()]
    assert len(records) == len(lines)
    assert records[0] in ("yes", "no") and records[6] in ("yes", "no")
    types = [r["error"]["type"] if isinstance(r, dict) and "error" in r else None for r in records]
    assert types == [None, "SchemaError", "SchemaError", "ConfigError", "PromptTooLongError",
                     "ConfigError", None]
    assert [r["error"]["line"] for r in records if isinstance(r, dict) and "error" in r] == [2, 3, 4, 5, 6]


def byte_stdin(monkeypatch, data: bytes) -> None:
    """stdin as the real thing: a text stream over bytes (``.buffer``), not a StringIO."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_text_that_is_not_unicode_exits_2_or_3_naming_it(capsys, monkeypatch, no_model):
    byte_stdin(monkeypatch, b"Ada Lovelace \xff\xfe, 36")
    code, out, err = run(["generate", "--schema", "name"], capsys)
    assert code == 2 and out == "" and "stdin" in err and "U+DCFF at character 13" in err
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)
    code, out, err = run(["generate", "Ada \udcff", "--schema", "name"], capsys)
    assert code == 2 and "PROMPT" in err
    code, out, err = run(["generate", "hi", "--schema", "name", "--system", "be \ud800"], capsys)
    assert code == 2 and "--system" in err
    for flags in (["--choice", "a", "--choice", "b\udcff"], ["--regex", "a\ud800"],
                  ["--schema", '{"enum": ["\\ud800"]}']):
        code, out, err = run(["generate", "hi", *flags], capsys)
        assert code == 3 and "lone surrogate" in err, flags


def test_batch_lines_that_are_not_unicode_are_error_records_and_the_rest_run(
        tmp_path, capsys, monkeypatch, tiny_loaded):
    from constrained_spec.model import loading as models
    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_loaded)
    lines = [b'"Say a."', b'"caf\xe9 in latin-1"', b'"an escaped \\ud800 surrogate"',
             b'{"prompt": "p", "schema": {"enum": ["\\udc80"]}}',
             b'{"prompt": [{"role": "user", "content": null}]}', b'"Say b."']
    for source in ("file", "stdin"):
        if source == "file":
            path = tmp_path / "in.jsonl"
            path.write_bytes(b"\n".join(lines) + b"\n")
            argv = ["generate", "--batch", str(path)]
        else:
            byte_stdin(monkeypatch, b"\n".join(lines) + b"\n")
            argv = ["generate", "--batch", "-"]
        code, out, err = run([*argv, "--choice", "a", "--choice", "b", "--max-tokens", "4",
                              "--no-speculation", "--quiet"], capsys)
        assert code == 7
        out.encode("utf-8")  # the output is UTF-8 text
        records = [json.loads(x) for x in out.splitlines()]
        assert len(records) == len(lines)
        assert records[0] in ("a", "b") and records[-1] in ("a", "b")
        errors = [r["error"] for r in records[1:-1]]
        assert [e["type"] for e in errors] == ["ConfigError", "ConfigError", "SchemaError",
                                               "ConfigError"]
        assert [e["line"] for e in errors] == [2, 3, 4, 5]
        assert "not UTF-8" in errors[0]["message"] and "lone surrogate" in errors[1]["message"]
