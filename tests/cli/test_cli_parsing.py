"""The command line's pieces, in process and without a model: flags -> schema, speculative
config and sampling; --batch lines; error records; exit codes; streaming as JSON."""

from __future__ import annotations

import io
import json

import pytest

from constrained_spec import (
    ConfigError,
    ConstrainedSpecError,
    Grammar,
    IncompleteOutputError,
    ModelLoadError,
    OutputValidationError,
    PromptTooLongError,
    Regex,
    SchemaError,
    SpeculativeConfig,
)
from constrained_spec.cli import main
from constrained_spec.cli.args import resolve_schema_text, schema_from_args, speculative_from_args
from constrained_spec.cli.batch import error_record, read_batch
from constrained_spec.cli.exit_codes import EXIT_CODES, exit_code_for
from constrained_spec.cli.generate import TextStream
from constrained_spec.cli.parser import build_parser

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def parse(*argv: str):
    return build_parser().parse_args(["generate", "a prompt", *argv])


# -- schema inputs ---------------------------------------------------------------------------

def test_schema_file_inline_json_and_dsl_give_the_same_schema(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    dsl_file = tmp_path / "person.txt"
    dsl_file.write_text("name, age int")
    assert resolve_schema_text(str(path)) == PERSON
    assert resolve_schema_text(json.dumps(PERSON)) == PERSON
    assert resolve_schema_text("name, age int") == PERSON
    assert resolve_schema_text(str(dsl_file)) == PERSON


def test_missing_json_file_is_a_usage_error_not_a_field_named_like_it():
    with pytest.raises(ConfigError, match="not found"):
        resolve_schema_text("no/such/person.json")


def test_malformed_inline_json_is_a_schema_error_with_its_position():
    with pytest.raises(SchemaError, match="malformed JSON.*line 1 column"):
        resolve_schema_text('{"type": "object",}')
    with pytest.raises(SchemaError, match="is an object"):
        resolve_schema_text('["name"]')


def test_a_very_long_dsl_text_is_not_mistaken_for_a_path():
    text = ", ".join(f"field{i} int" for i in range(400))
    assert len(resolve_schema_text(text)["properties"]) == 400


def test_each_schema_flag_gives_the_library_schema_object(tmp_path):
    grammar = tmp_path / "yn.ebnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    assert schema_from_args(parse("--regex", r"\d+")) == Regex(r"\d+")
    assert schema_from_args(parse("--choice", "red", "--choice", "blue")) == ["red", "blue"]
    assert schema_from_args(parse("--grammar", str(grammar))) == Grammar('root ::= "yes" | "no"\n')
    assert schema_from_args(parse("--schema", "name, age int")) == PERSON
    assert schema_from_args(parse()) is None


def test_schema_forms_are_mutually_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--regex", "a", "--choice", "b")
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_schema_multi_wraps_json_schemas_and_refuses_other_forms():
    wrapped = schema_from_args(parse("--schema", "name, age int", "--schema-multi"))
    assert wrapped == {"type": "object", "properties": {"items": {"type": "array", "items": PERSON}},
                       "required": ["items"]}
    with pytest.raises(ConfigError, match="--schema-multi"):
        schema_from_args(parse("--regex", "a+", "--schema-multi"))


def test_pydantic_reference_imports_a_class_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cli_models_a.py").write_text(
        "from pydantic import BaseModel\n"
        "class Pet(BaseModel):\n    kind: str\n"
        "class Person(BaseModel):\n    name: str\n    pet: Pet\n"
        "NOT_A_MODEL = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    cls = schema_from_args(parse("--pydantic", "cli_models_a:Person"))
    assert cls.__name__ == "Person" and cls(name="a", pet={"kind": "cat"}).pet.kind == "cat"
    assert schema_from_args(parse("--pydantic", "cli_models_a.py:Pet")).__name__ == "Pet"
    multi = schema_from_args(parse("--pydantic", "cli_models_a:Person", "--schema-multi"))
    assert multi["properties"]["items"]["items"]["properties"]["pet"] == {"$ref": "#/$defs/Pet"}
    assert "Pet" in multi["$defs"]
    with pytest.raises(SchemaError, match="not a Pydantic model"):
        schema_from_args(parse("--pydantic", "cli_models_a:NOT_A_MODEL"))
    with pytest.raises(ConfigError, match="has no 'Nobody'"):
        schema_from_args(parse("--pydantic", "cli_models_a:Nobody"))
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        schema_from_args(parse("--pydantic", "no_such_module_xyz:Person"))
    with pytest.raises(ConfigError, match="MODULE:CLASS"):
        schema_from_args(parse("--pydantic", "cli_models_a"))


def test_unreadable_grammar_file_is_a_usage_error(tmp_path):
    with pytest.raises(ConfigError, match="--grammar: cannot read"):
        schema_from_args(parse("--grammar", str(tmp_path / "missing.ebnf")))


# -- speculative decoding and sampling ---------------------------------------------------------

def test_speculation_defaults_to_the_library_choice_and_can_be_switched_off():
    assert speculative_from_args(parse()) is None
    assert speculative_from_args(parse("--no-speculation")) is False


def test_speculative_config_json_is_read_as_fastdeploy_does():
    config = speculative_from_args(parse("--speculative-config",
                                         '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_lmdeploy_flags_fill_the_same_config():
    config = speculative_from_args(parse("--speculative-algorithm", "ngram",
                                         "--speculative-num-draft-tokens", "2"))
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert speculative_from_args(parse("--speculative-algorithm", "deepseek_mtp")).method == "mtp"
    draft = speculative_from_args(parse("--speculative-draft-model", "/models/small"))
    assert (draft.method, draft.model) == ("draft_model", "/models/small")
    both = speculative_from_args(parse("--speculative-config", '{"method": "ngram"}',
                                       "--speculative-num-draft-tokens", "4"))
    assert both == SpeculativeConfig(method="ngram", num_speculative_tokens=4)


@pytest.mark.parametrize("argv, match", [
    (["--speculative-config", "{method: ngram}"], "malformed JSON"),
    (["--speculative-config", "[1]"], "JSON object"),
    (["--speculative-config", '{"method": "magic"}'], "unknown method"),
    (["--speculative-config", '{"k": 3}'], "unknown keys"),
    (["--speculative-config", '{"method": "ngram"}', "--speculative-algorithm", "mtp"], "give it once"),
    (["--speculative-num-draft-tokens", "99"], "num_speculative_tokens"),
    (["--no-speculation", "--speculative-num-draft-tokens", "2"], "--no-speculation"),
])
def test_bad_speculative_options_are_config_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        speculative_from_args(parse(*argv))


def test_sampling_flag_defaults_are_the_library_defaults():
    from constrained_spec import SamplingParams

    args, defaults = parse(), SamplingParams()
    assert (args.temperature, args.top_p, args.top_k, args.max_tokens, args.seed) == (
        defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens, defaults.seed)


@pytest.mark.parametrize("argv, match", [
    (["p", "--temperature", "-1"], "temperature"),
    (["p", "--top-p", "0"], "top_p"),
    (["p", "--max-tokens", "0"], "max_tokens"),
    (["--stream", "--batch", "x.jsonl"], "--stream cannot be used with --batch"),
    (["--pretty", "--batch", "x.jsonl"], "--pretty cannot be used with --batch"),
    (["p", "--batch", "x.jsonl"], "either PROMPT or --batch"),
    (["--batch", "no/such/file.jsonl"], "--batch: cannot read"),
])
def test_bad_option_values_exit_2_before_any_model_is_loaded(argv, match, capsys, monkeypatch):
    err = stderr_of_exit_2_before_loading(argv, capsys, monkeypatch)
    assert len(err.strip().splitlines()) == 1 and match in err


def stderr_of_exit_2_before_loading(argv: list[str], capsys, monkeypatch) -> str:
    """``constrained-spec generate ARGV`` must exit 2 with nothing on stdout and without
    loading a model; returns what it wrote to stderr."""
    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("constrained_spec.model.loading.load_model", no_model)
    assert main(["generate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_bad_schema_exits_3_before_any_model_is_loaded(capsys, monkeypatch):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: 1 / 0)
    assert main(["generate", "p", "--schema", '{"type": "object", "properties": {"a": '
                 '{"type": "string", "pattern": "(?<=x)y"}}}']) == 3
    err = capsys.readouterr().err
    assert err.startswith("constrained-spec: schema error:") and "/properties/a/pattern" in err


# -- --batch lines -----------------------------------------------------------------------------

def test_batch_lines_are_prompts_or_prompt_schema_objects_and_bad_lines_become_errors():
    lines = [
        '"just a prompt"',
        "",
        '{"prompt": "p2", "schema": "name, age int"}',
        '{"prompt": "p3", "schema": {"type": "string"}}',
        "{not json",
        '{"schema": "name"}',
        '{"prompt": "p7", "schema": "age integer"}',
        '{"prompt": "p8", "id": 3}',
        "42",
    ]
    items = read_batch(lines)
    assert [it.line for it in items] == list(range(1, 10))  # one item per line, the blank one too
    ok = [it for it in items if it.error is None]
    assert [(it.line, it.prompt, it.has_schema) for it in ok] == [
        (1, "just a prompt", False), (3, "p2", True), (4, "p3", True)]
    assert ok[1].schema == PERSON and ok[2].schema == {"type": "string"}
    errors = {it.line: it.error for it in items if it.error is not None}
    assert isinstance(errors[5], ConfigError) and "malformed JSON" in str(errors[5])
    assert isinstance(errors[2], ConfigError) and "blank" in str(errors[2])
    assert "no \"prompt\"" in str(errors[6])
    assert isinstance(errors[7], SchemaError) and "'age'" in str(errors[7])
    assert "unknown keys ['id']" in str(errors[8])
    assert "got a JSON int" in str(errors[9])


def test_blank_and_whitespace_only_batch_lines_keep_their_place_as_error_records():
    lines = ['"a"', "", '"b"', "   \t", '"c"', "{bad", '"d"']
    items = read_batch(lines)
    assert [it.line for it in items] == [1, 2, 3, 4, 5, 6, 7]
    assert [it.prompt for it in items if it.error is None] == ["a", "b", "c", "d"]
    assert [it.line for it in items if it.error is not None] == [2, 4, 6]


def test_batch_line_schemas_are_wrapped_by_schema_multi():
    [item] = read_batch(['{"prompt": "p", "schema": "name, age int"}'], multi=True)
    assert item.schema["properties"]["items"]["items"] == PERSON


def test_error_record_names_type_message_line_and_keeps_the_partial_text():
    record = error_record(IncompleteOutputError("max_tokens=3 reached\nraise it", partial_text='{"na'), 7)
    assert record == {"error": {"type": "IncompleteOutputError", "message": "max_tokens=3 reached; raise it",
                                "line": 7, "partial_text": '{"na'}}
    json.dumps(record)


# -- exit codes --------------------------------------------------------------------------------

def test_each_error_kind_has_its_exit_code():
    assert exit_code_for(SchemaError("x")) == 3
    assert exit_code_for(IncompleteOutputError("x", partial_text="")) == 4
    assert exit_code_for(ModelLoadError("x")) == 5
    assert exit_code_for(OutputValidationError("x", text="")) == 6
    assert exit_code_for(ConfigError("x")) == 2
    assert exit_code_for(PromptTooLongError("x")) == 2
    assert exit_code_for(ConstrainedSpecError("x")) == 1
    assert exit_code_for(RuntimeError("x")) == 1


def test_help_lists_every_exit_code(capsys):
    for argv in ([], ["generate"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        for code in EXIT_CODES:
            assert f"\n  {code}  " in text


def test_an_unexpected_exception_is_one_line_and_exit_1(capsys, monkeypatch):
    def broken(args, out):
        raise KeyError("boom")

    monkeypatch.setattr("constrained_spec.cli.commands.run_schema_check", broken)
    assert main(["schema-check", "name"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: KeyError" in err


# -- streaming ---------------------------------------------------------------------------------

class ByteTokenizer:
    """Each id is one byte of UTF-8 (so a character can arrive in several pieces)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(stream, text, step=1):
    data = list(text.encode("utf-8"))
    for i in range(0, len(data), step):
        stream(0, data[i: i + step])
    stream.finish(text)


@pytest.mark.parametrize("text", ['line "one"\nzwei ß – 東京 \\ end', "", "plain"])
def test_streamed_non_json_output_is_one_json_string_equal_to_the_output(text):
    out = io.StringIO()
    feed(TextStream(ByteTokenizer(), out, quote=True), text)
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1
    assert json.loads(out.getvalue()) == text


def test_streamed_json_output_is_the_text_itself_written_in_pieces():
    text = '{"name": "Zoë", "city": "東京"}'
    out = io.StringIO()
    writes = []
    out.write = lambda s, _w=out.write: (writes.append(s), _w(s))[1]
    feed(TextStream(ByteTokenizer(), out, quote=False), text, step=2)
    assert out.getvalue() == text + "\n"
    assert len(writes) > 5 and "\ufffd" not in "".join(writes)


def test_a_failed_stream_still_ends_its_line():
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out, quote=False)
    stream(0, list(b'{"na'))
    stream.finish(None)
    assert out.getvalue() == '{"na\n'
