"""The installed ``constrained-spec`` console script, driven in a subprocess as a user runs it.

Tests marked ``model`` load the embedded model in each subprocess (~5-10 s each once cached),
so there are few of them and each checks several things. The others never load a model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

SCRIPT = Path(sys.executable).with_name("constrained-spec")

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def run_cli(*args: str, stdin: str = "", cwd: Path | None = None, timeout: float = 900,
            ) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), f"{SCRIPT} is missing: install the package (pip install -e .)"
    return subprocess.run([str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("constrained-spec")]


# -- without a model ---------------------------------------------------------------------------

def test_console_script_and_python_dash_m_are_the_same_command():
    script = run_cli("--version")
    module = subprocess.run([sys.executable, "-m", "constrained_spec", "--version"],
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == module.returncode == 0
    assert script.stdout == module.stdout and script.stdout.startswith("constrained-spec ")


def test_bad_arguments_exit_2_with_a_clear_line_and_nothing_on_stdout():
    unknown = run_cli("generate", "hi", "--no-such-flag")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines()[-1].startswith("constrained-spec: error: unrecognized arguments")
    bad_value = run_cli("generate", "hi", "--temperature", "-0.5")
    assert bad_value.returncode == 2 and bad_value.stdout == ""
    assert bad_value.stderr.splitlines() == [
        "constrained-spec: error: temperature: must be a finite number in [0, 100], got -0.5"]


def test_bad_schema_exits_3_with_one_line_before_loading_a_model():
    malformed = run_cli("generate", "hi", "--schema", '{"type": "object",')
    assert malformed.returncode == 3 and malformed.stdout == ""
    assert malformed.stderr.splitlines() == [
        "constrained-spec: schema error: --schema: malformed JSON: Expecting property name "
        "enclosed in double quotes at line 1 column 19"]
    dsl = run_cli("generate", "hi", "--schema", "name, age number")
    assert dsl.returncode == 3 and dsl.stdout == ""
    assert len(dsl.stderr.splitlines()) == 1 and "field 'age' has unknown type 'number'" in dsl.stderr


def test_model_problem_exits_5_with_one_line(tmp_path):
    proc = run_cli("generate", "hi", "--schema", "name", "--model", str(tmp_path / "no-such-model"))
    assert proc.returncode == 5 and proc.stdout == ""
    assert len(error_lines(proc)) == 1 and error_lines(proc)[0].startswith("constrained-spec: model error:")


def test_schema_check_reports_ignored_keywords_with_pointers_without_a_model(tmp_path):
    schema = tmp_path / "tags.json"
    schema.write_text(json.dumps({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "name": {"type": "string"}}}))
    proc = run_cli("schema-check", str(schema))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "ignored: uniqueItems at /properties/tags/uniqueItems (xgrammar): array items may repeat: "
        "'uniqueItems' is not enforced"]
    as_json = run_cli("schema-check", "--json", "--schema-mode", "strict", str(schema))
    assert as_json.returncode == 3  # strict mode refuses ignored keywords
    report = json.loads(as_json.stdout)
    assert report["refused"] is True and report["kind"] == "json_schema"
    assert [(i["level"], i["pointer"]) for i in report["issues"]] == [
        ("ignored", "/properties/tags/uniqueItems")]
    assert error_lines(as_json)[0].startswith("constrained-spec: schema error:")
    dsl = run_cli("schema-check", "name, age int, bio: a short bio")
    assert dsl.returncode == 0 and dsl.stdout == "xgrammar: every keyword is enforced\n"


def test_schema_check_refuses_unsupported_keywords_with_exit_3():
    proc = run_cli("schema-check", '{"type": "string", "pattern": "(?<=a)b"}')
    assert proc.returncode == 3
    assert proc.stdout.startswith("unsupported: pattern at /pattern (xgrammar)")
    assert "look-behind" in error_lines(proc)[0]


# -- with the embedded model -------------------------------------------------------------------

@pytest.mark.model
def test_dsl_schema_prints_only_one_json_line_and_stats_go_to_stderr():
    proc = run_cli("generate", "Extract the person: Ada Lovelace is 36 years old.",
                   "--schema", "name, age int: age in years", "--stats", "--max-tokens", "48")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1
    jsonschema.validate(json.loads(proc.stdout), PERSON)
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["emitted_tokens"] > 0 and stats["acceptance_length"] >= 1.0


@pytest.mark.model
def test_stdin_prompt_with_schema_file_multi_streamed_pretty_and_quiet(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"]}))
    proc = run_cli("generate", "--schema", str(schema), "--schema-multi", "--stream", "--pretty",
                   "--quiet", "--max-tokens", "200",
                   stdin="List the people: Ada Lovelace and Alan Turing.\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --quiet: no progress bars, no log lines
    value = json.loads(proc.stdout)
    assert proc.stdout == json.dumps(value, indent=2, ensure_ascii=False) + "\n"
    assert isinstance(value["items"], list) and all(isinstance(p["name"], str) for p in value["items"])


@pytest.mark.model
def test_regex_output_is_a_json_string_matching_the_pattern():
    proc = run_cli("generate", "What is the phone number? Call 555-0199 after six.",
                   "--regex", r"\d{3}-\d{4}", "--no-speculation", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"\d{3}-\d{4}", json.loads(proc.stdout))


@pytest.mark.model
def test_choice_output_streams_as_one_json_string():
    proc = run_cli("generate", "Is this review positive or negative? 'I loved every minute.'",
                   "--choice", "positive", "--choice", "negative", "--stream",
                   "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout in ('"positive"\n', '"negative"\n')


@pytest.mark.model
def test_grammar_file_output_is_in_the_grammar(tmp_path):
    grammar = tmp_path / "answer.ebnf"
    grammar.write_text('root ::= ("yes" | "no") ", " ("certainly" | "probably")\n')
    proc = run_cli("generate", "Is water wet?", "--grammar", str(grammar), "--max-tokens", "16",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"(yes|no), (certainly|probably)", json.loads(proc.stdout))


@pytest.mark.model
def test_pydantic_class_from_the_current_directory(tmp_path):
    (tmp_path / "cli_people.py").write_text(
        "from pydantic import BaseModel\n"
        "class Person(BaseModel):\n    name: str\n    age: int\n")
    proc = run_cli("generate", "Extract the person: Grace Hopper, 85 years old.",
                   "--pydantic", "cli_people:Person", "--max-tokens", "48", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1
    jsonschema.validate(json.loads(proc.stdout), PERSON)


@pytest.mark.model
def test_batch_keeps_input_order_and_failing_lines_become_error_records(tmp_path):
    name_only = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    lines = [
        json.dumps("Extract the person: Ada Lovelace, 36."),
        "{not json",
        json.dumps({"prompt": "Extract the person: Grace Hopper.", "schema": name_only}),
        json.dumps({"prompt": "Alan Turing", "schema": "name, age integer"}),
        json.dumps({"prompt": "Alan Turing", "schema": {"type": "objekt"}}),
        "",
        json.dumps({"prompt": "Extract the person: Alan Turing, 41.", "schema": "name, age int"}),
    ]
    batch = tmp_path / "people.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    proc = run_cli("generate", "--batch", str(batch), "--schema", "name, age int", "--stats",
                   "--max-tokens", "48")
    assert proc.returncode == 7, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 7  # one per input line, the blank one too, in order
    jsonschema.validate(records[0], PERSON)
    jsonschema.validate(records[2], name_only)
    jsonschema.validate(records[6], PERSON)
    errors = {r["error"]["line"]: r["error"]["type"] for r in records if "error" in r}
    assert errors == {2: "ConfigError", 4: "SchemaError", 5: "SchemaError", 6: "ConfigError"}
    assert [i + 1 for i, r in enumerate(records) if "error" in r] == sorted(errors)  # in place
    assert "'age'" in records[3]["error"]["message"]
    assert "constrained-spec: 4 of 7 lines failed" in proc.stderr
    stats = json.loads(next(line for line in proc.stderr.splitlines() if line.startswith("{")))
    assert stats["emitted_tokens"] > 0


@pytest.mark.model
def test_exhausted_max_tokens_exits_4_with_the_partial_text_on_stderr():
    proc = run_cli("generate", "Extract the person: Ada Lovelace, 36.", "--schema", json.dumps(PERSON),
                   "--max-tokens", "3", "--no-speculation")
    assert proc.returncode == 4
    assert proc.stdout == ""
    incomplete, partial = error_lines(proc)
    assert incomplete.startswith("constrained-spec: incomplete output: max_tokens=3")
    text = json.loads(partial.removeprefix("constrained-spec: partial output: "))
    assert text and '{"name": "Ada Lovelace", "age": 36}'.startswith(text[:2])
