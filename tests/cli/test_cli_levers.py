"""The output-quality levers (retries on by default, the others opt-in) and the JSON layout on
the command line.

Flags -> Generator options (the library's defaults, its checks and messages, exit 2 before a
model is loaded); then ``main`` in process on a bigram Llama that loops by construction
(``cs_testlib.bigram_llama``; ``load_model`` is patched to return it): each lever changes what
comes out, for one prompt and for ``--batch``.
"""

from __future__ import annotations

import inspect
import json

import pytest
from cs_testlib import bigram_loaded
from test_cli_parsing import stderr_of_exit_2_before_loading

from constrained_spec import ConfigError, Generator, IncompleteOutputError, JsonLayout
from constrained_spec.cli import main
from constrained_spec.cli.args import generator_options_from_args, layout_from_args
from constrained_spec.cli.batch import error_record
from constrained_spec.cli.exit_codes import report_error
from constrained_spec.cli.generate import output_json
from constrained_spec.cli.parser import build_parser

# {"a": "abab...": inside the string a -> b (5) -> a (5) -> ...; after a, c comes second (4)
# and the closing quote third (3); after c the quote (5). Greedy never closes the string.
# The space before the value's quote prefers the quote (else a penalty on the quote, once
# written, would favour the byte-level token '":' there).
LOOP_EDGES = {("Ġ", '"'): 5.0, ('"', "a"): 5.0, ("a", "b"): 5.0, ("b", "a"): 5.0,
              ("a", "c"): 4.0, ("a", '"'): 3.0, ("b", '"'): 3.0, ("c", '"'): 5.0}
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                     "additionalProperties": False})


def parse(*argv: str):
    return build_parser().parse_args(["generate", "a prompt", *argv])


def generator_defaults() -> dict:
    return {name: p.default for name, p in inspect.signature(Generator.__init__).parameters.items()}


# -- flags -> options ---------------------------------------------------------------------------

def test_lever_flag_defaults_are_the_generator_defaults():
    options = generator_options_from_args(parse())
    defaults = generator_defaults()
    for name in ("repetition_penalty", "no_repeat_ngram_size", "max_string_length", "max_items",
                 "max_retries", "retry_temperature", "max_tokens", "temperature", "top_p", "top_k",
                 "seed"):
        assert options[name] == defaults[name], name
    assert layout_from_args(parse()) is None  # the library's compact default


def test_lever_flags_become_generator_options():
    options = generator_options_from_args(parse(
        "--repetition-penalty", "1.2", "--no-repeat-ngram-size", "8", "--max-string-length", "64",
        "--max-items", "8", "--max-retries", "2", "--retry-temperature", "0.5"))
    assert {k: options[k] for k in ("repetition_penalty", "no_repeat_ngram_size", "max_string_length",
                                    "max_items", "max_retries", "retry_temperature")} == {
        "repetition_penalty": 1.2, "no_repeat_ngram_size": 8, "max_string_length": 64,
        "max_items": 8, "max_retries": 2, "retry_temperature": 0.5}


def test_indent_is_the_layout_the_model_writes():
    assert layout_from_args(parse("--indent", "4")) == JsonLayout(indent=4)
    assert layout_from_args(parse("--indent", "0", "--pretty")) == JsonLayout(indent=0)
    # --stream --pretty: the streamed text is the output, so the model writes it indented
    assert layout_from_args(parse("--stream", "--pretty")) == JsonLayout(indent=2)
    assert layout_from_args(parse("--stream", "--pretty", "--indent", "4")) == JsonLayout(indent=4)
    assert layout_from_args(parse("--pretty")) is None  # re-indented after generation, as before


def test_printed_json_is_one_line_unless_pretty_whatever_layout_the_model_wrote():
    value = {"a": "x", "b": [1, 2]}
    compact, two = json.dumps(value), json.dumps(value, indent=2)
    assert output_json(compact, is_json=True) == compact
    assert output_json(two, is_json=True, written_indent=2) == compact
    assert output_json(compact, is_json=True, indent=2) == two
    assert output_json(two, is_json=True, indent=2, written_indent=2) is two  # as written
    assert output_json(json.dumps(value, indent=4), is_json=True, indent=2, written_indent=4) == two
    assert output_json("a\nb", is_json=False, written_indent=2) == '"a\\nb"'


@pytest.mark.parametrize("argv, match", [
    (["p", "--repetition-penalty", "0.5"], "repetition_penalty: must be a number in [1, 10]"),
    (["p", "--repetition-penalty", "nan"], "repetition_penalty"),
    (["p", "--no-repeat-ngram-size", "-1"], "no_repeat_ngram_size: must be an integer in 0..64"),
    (["p", "--max-string-length", "0"], "max_string_length: must be an integer >= 1"),
    (["p", "--max-items", "0"], "max_items: must be an integer >= 1"),
    (["p", "--max-retries", "-1"], "max_retries: must be an integer >= 0"),
    (["p", "--max-retries", "1", "--retry-temperature", "0"], "retry_temperature: must be a number"),
    (["p", "--indent", "-1"], "--indent: must be an integer >= 0"),
    (["p", "--stream", "--indent", "2"], "--indent: --stream prints the text as the model writes"),
    (["p", "--stream", "--max-retries", "1"], "--max-retries: cannot be combined with --stream"),
    (["--batch", "no/such/file.jsonl", "--no-repeat-ngram-size", "65"], "no_repeat_ngram_size"),
    (["--batch", "no/such/file.jsonl", "--max-items", "0"], "max_items"),
])
def test_bad_lever_values_exit_2_with_one_line_before_any_model_is_loaded(argv, match, capsys,
                                                                         monkeypatch):
    err = stderr_of_exit_2_before_loading(argv, capsys, monkeypatch)
    assert err.count("\n") == 1 and match in err, err


def test_a_non_number_is_argparses_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--max-retries", "two")
    assert exc.value.code == 2
    assert "--max-retries: invalid int value: 'two'" in capsys.readouterr().err


def test_an_error_after_retries_says_how_many_attempts_failed(capsys):
    err = IncompleteOutputError("max_tokens=3 reached", partial_text='{"a')
    err.attempts = 3
    assert report_error(err) == 4
    assert capsys.readouterr().err.splitlines()[0].endswith("(all 3 attempts failed)")
    assert error_record(err, 2)["error"]["attempts"] == 3
    assert "attempts" not in error_record(ConfigError("x"), 2)["error"]


# -- in process, on a model that loops ------------------------------------------------------------

@pytest.fixture(scope="module")
def looping():
    return bigram_loaded(LOOP_EDGES)


@pytest.fixture
def cli(looping, monkeypatch, capsys):
    """Run ``constrained-spec generate ARGS`` on the looping model -> (exit code, stdout, stderr)."""
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: looping)

    def run(*argv: str):
        code = main(["generate", *argv, "--schema", SCHEMA, "--max-tokens", "40", "--quiet"])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


def test_without_retries_or_a_lever_the_loop_runs_out_of_max_tokens(cli):
    code, out, err = cli("x", "--max-retries", "0", "--stats")
    assert (code, out) == (4, "")
    assert "ababab" in err and "attempts failed" not in err
    assert stats_of(err)["attempts"] == 1


def test_retries_are_on_by_default_and_off_by_default_with_stream(cli):
    code, out, err = cli("x", "--stats")
    assert code == 0, err
    assert set(json.loads(out)) == {"a"}
    assert stats_of(err)["attempts"] >= 2  # the greedy first attempt loops, a retry completes
    code, out, err = cli("x", "--stream", "--stats")
    assert code == 4  # one attempt: its text is already on stdout
    assert out.startswith('{"a": "ababab') and stats_of(err)["attempts"] == 1


@pytest.mark.parametrize("lever, value", [
    (["--no-repeat-ngram-size", "3"], "abab"),  # a third "aba" is banned: the quote comes next
    (["--repetition-penalty", "2"], "abac"),  # b, once written, falls below c
])
def test_the_repetition_guard_breaks_the_loop(cli, lever, value):
    code, out, err = cli("x", *lever)
    assert code == 0, err
    assert json.loads(out) == {"a": value}


def test_max_string_length_stops_the_loop_at_the_bound(cli):
    code, out, _ = cli("x", "--max-string-length", "3")
    assert (code, out) == (0, '{"a": "aba"}\n')


def stats_of(err: str) -> dict:
    return json.loads(next(line for line in err.splitlines() if line.startswith("{")))


def test_max_retries_returns_a_valid_retry_and_stats_count_the_attempts(cli):
    code, out, err = cli("x", "--max-retries", "2", "--stats")
    assert code == 0, err
    assert set(json.loads(out)) == {"a"}
    assert stats_of(err)["attempts"] >= 2  # the greedy first attempt loops
    code, out, err = cli("x", "--max-retries", "2", "--retry-temperature", "0.01", "--stats")
    assert (code, out) == (4, "")  # near-greedy retries loop too
    assert "(all 3 attempts failed)" in err
    assert stats_of(err)["attempts"] == 3


def test_indent_makes_the_model_write_indented_json_printed_on_one_line_unless_pretty(cli):
    code, out, _ = cli("x", "--indent", "2", "--max-string-length", "3")
    assert (code, out) == (0, '{"a": "aba"}\n')
    code, out, _ = cli("x", "--indent", "3", "--max-string-length", "3", "--pretty")
    assert (code, out) == (0, '{\n   "a": "aba"\n}\n')
    code, out, _ = cli("x", "--indent", "3", "--max-string-length", "3", "--pretty", "--stream")
    assert (code, out) == (0, '{\n   "a": "aba"\n}\n')


def test_batch_lines_honour_the_levers(cli, tmp_path):
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('"x"\n{"prompt": "y"}\n')
    code, out, _ = cli("--batch", str(batch), "--max-retries", "0")
    assert code == 7
    assert [json.loads(line)["error"]["type"] for line in out.splitlines()] == [
        "IncompleteOutputError"] * 2
    code, out, err = cli("--batch", str(batch), "--repetition-penalty", "2", "--indent", "2")
    assert code == 0, err
    assert out == '{"a": "abac"}\n' * 2  # one record per line, whatever the layout
    code, out, err = cli("--batch", str(batch), "--max-retries", "1", "--retry-temperature",
                         "0.01", "--stats")
    assert code == 7
    assert [json.loads(line)["error"]["attempts"] for line in out.splitlines()] == [2, 2]
    assert stats_of(err)["attempts"] == 4
    code, out, err = cli("--batch", str(batch))  # retries on by default
    assert code == 0, err
    assert all(set(json.loads(line)) == {"a"} for line in out.splitlines())
