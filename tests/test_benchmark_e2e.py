"""The pure helpers of ``benchmarks/e2e.py``: output checks, loop detection, verbatim fields,
summary and table, the instruction-set checks of ``--isa``, the machine line, the long prompt
and its table, and the shared RESULTS.md section writer. No model runs here."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks._results import write_section


@pytest.fixture(scope="module")
def e2e():
    from benchmarks import e2e

    return e2e


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
    assert ours[6] == "1.00x" and llama[6] == "2.00x"  # tokens/s to ours off
    assert ours[1] == "12.0" and llama[1] == "24.0"  # valid objects per minute
    assert ours[2] == "0.50x" and llama[2] == "1.00x"  # ... to llama.cpp's


def test_valid_objects_per_minute_count_completed_valid_requests_over_all_wall_time(e2e):
    recs = [_record("ours defaults", "a", 100, 20.0, attempts=3),
            _record("ours defaults", "b", 100, 10.0, completed_valid=False),
            _record("ours defaults", "c", 100, 30.0),
            _record("llama.cpp", "a", 100, 30.0), _record("llama.cpp", "b", 100, 30.0),
            dict(system="llama.cpp", task="c", rep=0, error="failed", skipped=False)]
    s = e2e.summarize(recs, ["llama.cpp", "ours defaults"])
    assert s["ours defaults"]["valid_min"] == pytest.approx(60 * 2 / 60.0)
    # to llama.cpp on tasks a and b only: 1 valid in 30 s against 2 in 60 s
    assert s["ours defaults"]["valid_min_vs"] == pytest.approx(1.0)
    assert s["llama.cpp"]["valid_min"] == pytest.approx(2.0)
    assert e2e.summarize(recs, ["ours defaults"])["ours defaults"]["valid_min_vs"] is None


def test_parse_variant(e2e):
    assert e2e.parse_variant('ours k=8={"speculative": {"num_speculative_tokens": 8}}') == (
        "ours k=8", {"speculative": {"num_speculative_tokens": 8}})
    with pytest.raises(argparse.ArgumentTypeError):
        e2e.parse_variant("no-equals-sign")
    with pytest.raises(argparse.ArgumentTypeError):
        e2e.parse_variant("x=[1]")


def test_write_section_replaces_in_place_and_appends(tmp_path):
    path = tmp_path / "RESULTS.md"
    write_section(path, "## A", "one")
    write_section(path, "## B", "two")
    write_section(path, "## A", "uno\n")
    assert path.read_text() == "# Benchmark results\n\n## A\n\nuno\n\n## B\n\ntwo\n"


# --- instruction-set simulation, machine line, long prompt -----------------------------------
NATIVE_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
               "AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
               "REPACK = 1 | ")
AVX2_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 "
             "| OPENMP = 1 | REPACK = 1 | ")


def test_worker_env_caps_the_isa_and_native_drops_leftover_caps(e2e):
    base = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    native = e2e.worker_env(base, "native", 2)
    assert not set(e2e.ISA_VARS) & set(native)
    assert native["PATH"] == "/bin" and native["OMP_NUM_THREADS"] == "2"
    avx2 = e2e.worker_env({"PATH": "/bin"}, "avx2", 4)
    assert {k: avx2[k] for k in e2e.ISA_VARS} == e2e.ISA_ENV["avx2"]
    assert avx2["MKL_NUM_THREADS"] == "4"


def test_torch_isa_check_refuses_a_torch_that_ignored_the_caps(e2e):
    assert e2e.torch_isa_problem("native", "AVX512", True) is None
    assert e2e.torch_isa_problem("avx2", "AVX2", False) is None
    assert "capability AVX512" in e2e.torch_isa_problem("avx2", "AVX512", False)
    assert "bf16" in e2e.torch_isa_problem("avx2", "AVX2", True)


def test_llama_isa_check_refuses_builds_with_avx512_or_amx(e2e):
    assert e2e.llama_isa_problem("avx2", AVX2_INFO) is None
    assert e2e.llama_isa_problem("native", NATIVE_INFO) is None
    problem = e2e.llama_isa_problem("avx2", NATIVE_INFO)
    assert "AVX512, AVX512_VNNI, AVX512_BF16" in problem and "--llama-cpp-path" in problem
    assert "AMX_INT8" in e2e.llama_isa_problem("avx2", AVX2_INFO + "AMX_INT8 = 1 |")
    assert "does not report AVX2" in e2e.llama_isa_problem("avx2", "CPU : SSE3 = 1 | AVX2 = 0 |")
    assert e2e.llama_features(AVX2_INFO)[:4] == ["SSE3", "SSSE3", "AVX", "AVX2"]


def test_machine_line_names_cpu_flags_simulation_capability_and_plan(e2e):
    facts = {"ours off": {"machine": {"cpu": "X", "capability": "AVX2", "mkldnn_bf16": False},
                          "kernels": {"plan": "prefill=fp32,decode=int4", "plan_source": "measured",
                                      "weights": "210 of 210 linears exact 4-bit groups"}},
             "llama.cpp": {"machine": {"llama_cpp": "0.3.36", "features": ["AVX", "AVX2"]}}}
    line = e2e.machine_line("AMD EPYC", ["avx2", "avx512f"], "avx2", facts)
    for part in ("AMD EPYC", "avx2 avx512f", "AVX2-only simulation", "ATEN_CPU_CAPABILITY=avx2",
                 "capability AVX2, oneDNN bf16 off", "llama.cpp 0.3.36 CPU features AVX AVX2",
                 "prefill=fp32,decode=int4 (measured", "llama.cpp built without AVX-512"):
        assert part in line, part
    refused = {"ours off": facts["ours off"]}  # llama.cpp refused: the line claims nothing of it
    assert "llama.cpp" not in e2e.machine_line("AMD EPYC", ["avx2"], "avx2", refused)
    assert "simulation" not in e2e.machine_line("AMD EPYC", [], "native", {})


def test_public_argv_keeps_no_absolute_path(e2e):
    argv = ["--isa", "avx2", "--llama-cpp-path", "/home/me/builds/avx2-pkg/", "--out=/tmp/x/R.md",
            "--out", "benchmarks/RESULTS.md"]
    assert e2e.public_argv(argv) == ["--isa", "avx2", "--llama-cpp-path", ".../avx2-pkg",
                                     "--out=.../R.md", "--out", "benchmarks/RESULTS.md"]


def test_long_prompt_task_is_the_shortest_document_over_the_target(e2e):
    tasks = [PERSON, {"id": "invoice_extract", "kind": "json_schema", "max_tokens": 256,
                      "prompt": "Invoice INV-1 from A to B.", "schema": {"type": "object"}},
             {"id": "yes_no", "kind": "choice", "max_tokens": 16, "prompt": "Yes or no?",
              "choices": ["yes", "no"]}]

    def words(t):
        return len(t["prompt"].split())

    task = e2e.long_prompt_task(tasks, words, 200)
    assert words(task) >= 200 and task["source"] == "invoice_extract"
    assert task["schema"] == {"type": "object"} and task["max_tokens"] == 256
    assert task["prompt"].count("Invoice INV-1") == 1  # the note to extract is there once
    note = int(task["prompt"].rsplit("note ", 1)[1].split()[0])
    assert f"Note {note}: Invoice INV-1" in task["prompt"]
    length = {}  # notes -> words, over every smaller target
    for target in range(words(task)):
        t = e2e.long_prompt_task(tasks, words, target)
        length[t["notes"]] = words(t)
    assert length[task["notes"] - 1] < 200  # the fewest notes: one fewer falls short
    assert e2e.long_prompt_task(tasks, words, 200, max_tokens=8)["max_tokens"] == 8


def test_long_summary_prefill_is_prompt_tokens_over_median_ttft(e2e):
    recs = [_record("llama.cpp", "long_prompt", 50, 5.0, ttft_s=t, prompt_tokens=1000)
            for t in (2.0, 1.0, 4.0)]
    recs += [_record("ours off", "long_prompt", 50, 2.5, ttft_s=t, prompt_tokens=1000)
             for t in (0.5, 0.4)]
    recs.append(dict(system="ours off", task="long_prompt", rep=2, error="timed out"))
    s = e2e.summarize_long(recs, ["llama.cpp", "ours off"])
    assert s["llama.cpp"]["prefill_tok_s"] == pytest.approx(500.0)  # median TTFT 2 s
    assert s["llama.cpp"]["ttft_range_ms"] == pytest.approx((1000.0, 4000.0))
    assert s["ours off"]["prefill_tok_s"] == pytest.approx(1000 / 0.45)
    assert s["ours off"]["prefill_vs_llama"] == pytest.approx(1000 / 0.45 / 500)
    assert s["ours off"]["tok_s_vs_llama"] == pytest.approx(2.0) and s["ours off"]["n"] == 2
    lines = e2e.render_long_table(s).splitlines()
    assert len(lines) == 4 and "TTFT" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "2000 [1000, 4000]" in lines[2] and "1.00x" in lines[2]


def test_the_defaults_row_runs_the_library_default_retries_and_counts_attempts(e2e):
    from constrained_spec.api import DEFAULT_MAX_RETRIES

    assert e2e.OURS_VARIANTS["ours defaults"] == {"max_retries": DEFAULT_MAX_RETRIES}
    recs = [_record("ours defaults", "a", 100, 4.0, attempts=1),
            _record("ours defaults", "b", 100, 6.0, attempts=3),
            _record("ours off", "a", 100, 10.0)]
    s = e2e.summarize(recs, ["ours off", "ours defaults"])
    assert s["ours defaults"]["attempts"] == pytest.approx(2.0)
    assert s["ours off"]["attempts"] == 1
    assert "| 2.00 |" in e2e.render_table(s, {})


def test_a_workers_peak_rss_is_its_own_not_its_parents(e2e):
    # ru_maxrss survives fork + exec on Linux: a worker started by a parent holding a large
    # file reported the parent's peak. VmHWM starts afresh at exec.
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        pytest.skip("VmHWM is Linux's")
    ballast = bytearray(400 * 1024 * 1024)  # the parent's peak: >= 400 MiB, touched
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    code = "from benchmarks._memory import own_peak_rss_mib; print(own_peak_rss_mib())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(e2e.__file__).parent.parent)
    del ballast
    assert 0 < float(out.stdout) < 300
