"""The pure helpers of ``benchmarks/e2e.py``: output checks, loop detection, verbatim fields,
summary and table, and the shared RESULTS.md section writer. No model runs here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    key = f"constrained_spec_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture(scope="module")
def e2e():
    return _load("e2e")


PERSON = {"id": "person_extract", "kind": "json_schema", "max_tokens": 64,
          "prompt": "Extract the person: Ada Lovelace is a 36 year old mathematician. Fee 4.50 USD.",
          "schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False}}


def test_check_output_per_task_kind(e2e):
    assert e2e.check_output(PERSON, '{"name": "Ada", "age": 36}')
    assert not e2e.check_output(PERSON, '{"name": "Ada", "age": "36"}')  # schema violation
    assert not e2e.check_output(PERSON, '{"name": "Ada", "age": 3')  # truncated JSON
    regex = {"kind": "regex", "regex": r"\d{4}-\d{2}-\d{2}"}
    assert e2e.check_output(regex, "2024-03-14")
    assert not e2e.check_output(regex, "2024-03-14 ")  # fullmatch, not search
    choice = {"kind": "choice", "choices": ["yes", "no"]}
    assert e2e.check_output(choice, "no") and not e2e.check_output(choice, "No")


@pytest.mark.parametrize("text", [
    '{"notes": "' + "ha" * 20,                          # a short block, over and over
    '{"items": [' + '{"id": 7, "ok": true}, ' * 3,       # whole objects repeat
    '{"items": [' + ", ".join(f'{{"id": {i}}}' for i in range(8, 14)),  # a counter still loops
    '{"a": ' + "\n" * 30,                                # runaway whitespace
    '{"x": "' + "abcdefghij" * 3 + "abcd",               # ends inside the next copy
    '{"sku": "' + "1234567890" * 5,                      # a digit string that never ends
])
def test_ends_in_loop_detects_repetitive_tails(e2e, text):
    assert e2e.ends_in_loop(text)


@pytest.mark.parametrize("text", [
    '{"name": "Ada Lovelace", "age": 36, "occupation": "mathematician", "city": "Lon',
    "short",
    '{"x": "' + "ab" * 5,                                # too short a span to call a loop
    '{"a": [' + '{"v": "first"}, {"v": "second"}, {"v": "third"}, ',  # varied values
])
def test_ends_in_loop_ignores_progress(e2e, text):
    assert not e2e.ends_in_loop(text)


def test_verbatim_fields_counts_strings_and_numbers_in_the_prompt(e2e):
    value = {"name": "Ada Lovelace", "age": 36, "job": "Mathematician", "fee": 4.5,
             "tags": ["", "USD"], "flag": True, "zip": 3}
    # "Mathematician" is not verbatim (case), 3 is not a number of the prompt, "" and True are
    # not counted as fields
    assert e2e.verbatim_fields(value, PERSON["prompt"]) == (4, 6)
    assert e2e.verbatim_fields({"date": 14}, "due 2024-03-14") == (1, 1)


def test_expand_shorthands_keeps_the_language(e2e):
    import re

    assert e2e.expand_shorthands(r"\(\d{3}\) \d{3}-\d{4}") == r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    assert e2e.expand_shorthands(r"[\d.]+\w\s?") == r"[0-9.]+[A-Za-z0-9_][ \t\n\r\x0b\x0c]?"
    for text in ("(555) 123-4567", "555 123-4567", "(55) 123-4567"):
        pattern = r"\(\d{3}\) \d{3}-\d{4}"
        assert bool(re.fullmatch(pattern, text)) == bool(re.fullmatch(e2e.expand_shorthands(pattern), text))
    schema = {"properties": {"pattern": {"type": "string", "pattern": r"^\d+$"}}}
    assert e2e.expand_shorthands_in_patterns(schema) == {
        "properties": {"pattern": {"type": "string", "pattern": "^[0-9]+$"}}}


def _record(system, task, tokens, wall, **kw):
    base = dict(system=system, task=task, rep=0, tokens=tokens, wall_s=wall, ttft_s=0.1,
                compile_s=0.01, forwards=tokens, valid=True, completed_valid=True, loop=False,
                verbatim=None)
    return {**base, **kw}


def test_summary_ratios_use_the_tasks_both_systems_ran(e2e):
    recs = [
        _record("ours off", "a", 100, 10.0), _record("ours off", "b", 100, 10.0),
        _record("ours forced+ngram", "a", 100, 4.0, forwards=40),
        _record("ours forced+ngram", "b", 100, 5.0, forwards=25, loop=True, completed_valid=False),
        _record("llama.cpp", "a", 100, 5.0),
        dict(system="llama.cpp", task="b", rep=0, error="skipped here", skipped=True),
        _record("transformers+xgrammar", "a", 100, 20.0), _record("transformers+xgrammar", "b", 100, 20.0),
    ]
    systems = ["transformers+xgrammar", "llama.cpp", "ours off", "ours forced+ngram"]
    s = e2e.summarize(recs, systems)
    assert s["ours off"]["tok_s"] == pytest.approx(10.0)
    assert s["ours forced+ngram"]["vs_baseline"] == pytest.approx(200 / 9 / 10)
    assert s["ours forced+ngram"]["acc_len"] == pytest.approx(200 / 65)
    assert s["ours forced+ngram"]["loop"] == 0.5 and s["ours forced+ngram"]["completed_valid"] == 0.5
    assert s["ours forced+ngram"]["tok_s_ok"] == pytest.approx(25.0)  # task "a" only
    # best peer is llama.cpp (20 tok/s on its one task); ratios to it only on task "a"
    assert s["ours off"]["best_peer"] == "llama.cpp"
    assert s["ours forced+ngram"]["vs_best_peer"] == pytest.approx(25 / 20)
    assert s["llama.cpp"]["n"] == 1


def test_render_table_has_one_row_per_system_and_dashes_for_missing(e2e):
    recs = [_record("ours off", "a", 50, 5.0), _record("llama.cpp", "a", 50, 2.5, ttft_s=None)]
    table = e2e.render_table(e2e.summarize(recs, ["llama.cpp", "ours off"]), {"ours off": 812.4})
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| system |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    llama, ours = lines[2].split(" | "), lines[3].split(" | ")
    assert llama[0] == "| llama.cpp" and ours[0] == "| ours off"
    assert "812" in lines[3] and "—" in lines[2]  # no RSS, no TTFT for llama.cpp here
    assert ours[4] == "1.00x" and llama[4] == "2.00x"


def test_parse_variant(e2e):
    assert e2e.parse_variant('ours k=8={"speculative": {"num_speculative_tokens": 8}}') == (
        "ours k=8", {"speculative": {"num_speculative_tokens": 8}})
    with pytest.raises(Exception):
        e2e.parse_variant("no-equals-sign")
    with pytest.raises(Exception):
        e2e.parse_variant("x=[1]")


def test_write_section_replaces_in_place_and_appends(tmp_path):
    write_section = _load("_results").write_section
    path = tmp_path / "RESULTS.md"
    write_section(path, "## A", "one")
    write_section(path, "## B", "two")
    write_section(path, "## A", "uno\n")
    assert path.read_text() == "# Benchmark results\n\n## A\n\nuno\n\n## B\n\ntwo\n"
