"""The ``constrained-spec`` command line: JSON-mode generation and the schema pre-flight check.

    constrained-spec generate "Ada Lovelace, 36, mathematician" --schema 'name, age int'
    constrained-spec generate --batch people.jsonl --schema person.json > people.out.jsonl
    constrained-spec schema-check person.json
    constrained-spec serve --port 8000            # the OpenAI-compatible server (app extra)

stdout carries nothing but JSON: one value per line (the whole value indented with
``--pretty``). Everything else (progress bars, warnings, stats, errors) goes to stderr, and
what went wrong is told by the exit code (``EXIT_CODES``). Anything a library prints while the
command runs is sent to stderr as well, so a stray ``print`` cannot corrupt the output.

The command line is a thin layer over :class:`~constrained_spec.api.Generator`: it turns flags
into a schema object, the Generator's options (sampling, the opt-in output-quality levers, the
JSON layout) and a speculative config, loads the model (quietly with ``--quiet``) and runs one
engine batch, whether for one prompt or a whole ``--batch`` file. ``serve`` is the exception
to the stdout rule: it hands over to :func:`constrained_spec.server.serve`, whose stdout is
uvicorn's access log.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .config import METHODS, SamplingParams, SpeculativeConfig
from .dsl import dsl_to_schema, wrap_multi
from .errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    IncompleteOutputError,
    ModelLoadError,
    OutputValidationError,
    SchemaError,
)
from .settings import overridden, settings

PROG = "constrained-spec"

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_SCHEMA = 3
EXIT_INCOMPLETE = 4
EXIT_MODEL = 5
EXIT_VALIDATION = 6
EXIT_BATCH_PARTIAL = 7

#: exit code -> (label on the error line, meaning in --help).
EXIT_CODES: dict[int, tuple[str, str]] = {
    EXIT_OK: ("ok", "success"),
    EXIT_INTERNAL: ("internal error", "unexpected internal error (a bug: please report it)"),
    EXIT_USAGE: ("error", "bad arguments or option values"),
    EXIT_SCHEMA: ("schema error", "bad schema: malformed, or a keyword the backend cannot enforce"),
    EXIT_INCOMPLETE: ("incomplete output", "--max-tokens ran out or the output looped, on every "
                                           "attempt (partial text on stderr)"),
    EXIT_MODEL: ("model error", "the model could not be fetched or loaded"),
    EXIT_VALIDATION: ("invalid output", "the finished output failed final validation"),
    EXIT_BATCH_PARTIAL: ("batch", "--batch: some lines failed (see their error records)"),
}

EPILOG_EXIT_CODES = "exit codes:\n" + "\n".join(
    f"  {code}  {meaning}" for code, (_, meaning) in EXIT_CODES.items())

GENERATE_EPILOG = f"""\
examples:
  {PROG} generate "Ada Lovelace, 36, mathematician" --schema 'name, age int, bio: a short bio'
  echo "Call me on 555-0199" | {PROG} generate --regex '\\d{{3}}-\\d{{4}}'
  {PROG} generate --batch people.jsonl --schema person.json > people.out.jsonl

--schema takes a file, an inline JSON Schema ('{{"type": ...}}') or the concise language of
llm: comma- (or newline-) separated fields 'name [type][: description]', types int, float,
bool, str (default str), all required.

--batch lines are a JSON string (the prompt) or an object {{"prompt": ..., "schema": ...}}
(schema optional: a JSON Schema object or a concise-language string). One JSON line comes out
per input line, in order: the value, or {{"error": {{"type", "message", "line"}}}}.

Outputs that are not JSON by themselves (--regex, --choice, --grammar, no schema) are printed
as JSON strings. With --stream the text is written to stdout as tokens are accepted.

A small model that loops or runs out of --max-tokens is retried by default: up to 2 more
generations (sampled, seeded), and the first valid output is printed; an output that completes
on the first attempt is exactly the one without retries. --max-retries 0 turns retries off.
With --stream there are none (a failed attempt's text would already be on stdout), and
--max-retries N > 0 with --stream is an error. --no-repeat-ngram-size,
--repetition-penalty, --max-string-length and --max-items change what is generated (see
docs/quality.md, "Output quality on small models").

{EPILOG_EXIT_CODES}"""

SERVE_EPILOG = f"""\
example:
  {PROG} serve --port 8000 --api-key sk-local --enable-metrics

Routes: POST /v1/chat/completions, GET /v1/models, GET /health, and GET /metrics with
--enable-metrics. Logs go to stderr; stdout carries uvicorn's access log only. Needs the app
extra: pip install constrained_spec[app]."""

SCHEMA_CHECK_EPILOG = """\
Prints what the grammar backend would not enforce, with JSON pointers into the schema:
"unsupported" keywords make generation refuse the schema, "ignored" ones are not enforced
while generating (the output is still validated at the end). No model is loaded.

exit codes: 0 the schema would run under --schema-mode (ignored keywords may be listed),
3 it would be refused (or is malformed), 2 bad arguments."""


# ------------------------------------------------------------------------------------------------
# the parser
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``constrained-spec`` (subcommands ``generate``, ``schema-check``,
    ``info``, ``serve``)."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Schema-constrained generation with local language models, made fast by "
                    "speculative decoding. stdout carries nothing but JSON.",
        epilog=EPILOG_EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_generate_parser(sub)
    _add_schema_check_parser(sub)
    _add_info_parser(sub)
    _add_serve_parser(sub)
    return parser


def _add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser(
        "generate", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=GENERATE_EPILOG,
        help="generate JSON that matches a schema",
        description="Generate output that matches a schema and print it as JSON on stdout.")
    gen.add_argument("prompt", nargs="?", metavar="PROMPT",
                     help="the prompt; read from stdin when omitted or '-'")
    _add_schema_arguments(gen)
    model = gen.add_argument_group("model and speculation")
    model.add_argument("--model", metavar="PATH", default=None,
                       help="a checkpoint folder or .gguf file (default: the embedded model, "
                            "fetched and converted once)")
    _add_speculation_arguments(model)
    _add_sampling_arguments(gen)
    _add_lever_arguments(gen)
    tools = gen.add_argument_group(
        "tool calls", "the model answers with calls to these tools, printed as "
        '{"name": ..., "arguments": {...}} (a list with --parallel-tool-calls), or with text '
        "(a JSON string) under --tool-choice auto")
    tools.add_argument("--tool", action="append", metavar="FILE.json",
                       help="an OpenAI tool ({\"type\": \"function\", \"function\": {name, "
                            "description, parameters}}) or a list of them; repeatable")
    tools.add_argument("--tools", action="append", metavar="MODULE:FUNCTION,...",
                       help="typed Python functions or Pydantic models as tools (MODULE may be a "
                            ".py file); repeatable")
    tools.add_argument("--tool-choice", metavar="CHOICE", default=None,
                       help="auto (default: text or calls), required, none, or a tool's name")
    tools.add_argument("--parallel-tool-calls", action="store_true",
                       help="allow several calls in one answer")
    output = gen.add_argument_group("input and output")
    output.add_argument("--batch", metavar="FILE.jsonl",
                        help="one prompt or {prompt, schema} per line ('-' = stdin); JSONL out, "
                             "in input order, run as one batch")
    output.add_argument("--pretty", action="store_true",
                        help="indent the JSON output (by --indent N, else 2)")
    output.add_argument("--indent", type=int, metavar="N",
                        help="the model writes JSON indented by N spaces (json.dumps(indent=N)) "
                             "instead of on one line; printed on one line unless --pretty")
    output.add_argument("--stream", action="store_true",
                        help="write the output to stdout as tokens are accepted")
    output.add_argument("--stats", action="store_true",
                        help="print the speculation stats as JSON on stderr")
    output.add_argument("--quiet", "-q", action="store_true",
                        help="no progress bars, warnings or log messages on stderr (errors only)")
    gen.set_defaults(func=_cmd_generate)


def _add_speculation_arguments(group: Any) -> None:
    """The speculation flags ``generate`` and ``serve`` share."""
    group.add_argument("--speculative-config", metavar="JSON",
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 5}\' (FastDeploy / vLLM style)')
    group.add_argument("--speculative-algorithm", metavar="METHOD",
                       choices=[*METHODS, *_METHOD_ALIASES],
                       help=f"the drafter: {', '.join(METHODS)} (lmdeploy's flag; "
                            "deepseek_mtp = mtp)")
    group.add_argument("--speculative-num-draft-tokens", type=int, metavar="N",
                       help="drafts proposed per step (lmdeploy's flag)")
    group.add_argument("--speculative-draft-model", metavar="PATH",
                       help="the drafter's weights (lmdeploy's flag; method draft_model unless "
                            "--speculative-algorithm says otherwise)")
    group.add_argument("--no-speculation", action="store_true",
                       help="plain decoding: no drafts at all, not even forced tokens")


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SamplingParams()
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=defaults.temperature,
                          help="0 = greedy (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=defaults.top_p,
                          help="nucleus sampling (default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=defaults.top_k,
                          help="top-k sampling, 0 = off (default: %(default)s)")
    sampling.add_argument("--seed", type=int, default=None, help="for reproducible sampling")
    sampling.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                          help="tokens to generate at most (default: %(default)s)")
    sampling.add_argument("--system", metavar="TEXT", default=None,
                          help="the system message (default: one describing the schema)")


def _add_lever_arguments(parser: argparse.ArgumentParser) -> None:
    from .api import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_TEMPERATURE

    defaults = SamplingParams()
    levers = parser.add_argument_group(
        "output quality", "levers for a small model that loops until --max-tokens runs out "
                          "(retries on by default, the others opt-in)")
    levers.add_argument("--max-retries", type=int, default=None, metavar="N",
                        help="after an incomplete, looping or invalid output, generate again up "
                             "to N times and print the first valid one; 0 = off (default: "
                             f"{DEFAULT_MAX_RETRIES}, or 0 with --stream, where N > 0 is an "
                             "error)")
    levers.add_argument("--retry-temperature", type=float, default=DEFAULT_RETRY_TEMPERATURE,
                        metavar="F", help="temperature of the retries when --temperature is 0 "
                                          "(retry k has seed --seed + k; default: %(default)s)")
    levers.add_argument("--no-repeat-ngram-size", type=int,
                        default=defaults.no_repeat_ngram_size, metavar="N",
                        help="ban a token that would repeat an N-gram already in the output, "
                             "0 = off (default: %(default)s)")
    levers.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty,
                        metavar="F", help="penalise the tokens already in the output, 1 = off, "
                                          "1.1 to 1.3 typical (default: %(default)s)")
    levers.add_argument("--max-string-length", type=int, metavar="N",
                        help="maxLength N on every string of the schema that has no bound")
    levers.add_argument("--max-items", type=int, metavar="N",
                        help="maxItems N on every array of the schema that has no bound")
    thinking = parser.add_argument_group(
        "reasoning models", "a model that thinks (<think> ... </think>) before its answer: the "
                            "thinking is free, the schema applies to the answer")
    thinking.add_argument("--reasoning", choices=("auto", "on", "off"), default="auto",
                          help="auto: on when the chat template names reasoning markers "
                               "(default: %(default)s)")
    thinking.add_argument("--max-reasoning-tokens", type=int, default=None, metavar="N",
                          help="thinking tokens before the end marker is forced (default: no budget)")
    thinking.add_argument("--show-reasoning", action="store_true",
                          help="print the thinking to stderr (stdout keeps the answer only)")


def _add_schema_check_parser(sub: Any) -> None:
    check = sub.add_parser(
        "schema-check", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SCHEMA_CHECK_EPILOG, help="pre-flight report of a schema (no model loaded)",
        description="Report which schema keywords the grammar backend would not enforce.")
    check.add_argument("schema_arg", nargs="?", metavar="SCHEMA",
                       help="a file, an inline JSON Schema, or the concise language (as --schema)")
    _add_schema_arguments(check)
    check.add_argument("--json", action="store_true", dest="as_json",
                       help="print the report as a JSON object")
    check.set_defaults(func=_cmd_schema_check)


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SERVE_EPILOG,
        help="an OpenAI-compatible chat-completions server (needs the app extra)",
        description="An OpenAI-compatible chat-completions server: schema-constrained outputs, "
                    "speculative decoding, continuous batching.")
    model = serve.add_argument_group("model and speculation (as generate)")
    model.add_argument("--model", metavar="PATH", default=None,
                       help="a checkpoint folder or .gguf file (default: the embedded model)")
    model.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model id clients send and /v1/models lists (default: the model's name)")
    _add_speculation_arguments(model)
    model.add_argument("--backend", choices=("xgrammar", "outlines"), default="xgrammar",
                       help="grammar backend (default: %(default)s)")
    group = serve.add_argument_group("serving")
    group.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (else 401)")
    group.add_argument("--max-batch-size", type=int, default=8,
                       help="requests decoded together (default: %(default)s)")
    group.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for a slot; past it the server answers 429 "
                            "(default: %(default)s)")
    group.add_argument("--max-request-bytes", type=int, default=None,
                       help="larger request bodies are refused with 413 (default: 1 MiB)")
    group.add_argument("--max-tokens", type=int, default=512,
                       help="max_tokens of a request that gives none (default: %(default)s)")
    group.add_argument("--enable-metrics", action="store_true",
                       help="expose Prometheus metrics on GET /metrics")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace, out: TextIO) -> int:
    # imported here: without the app extra this raises a ConfigError naming it
    from .server import serve

    return serve(args)


def _add_info_parser(sub: Any) -> None:
    info = sub.add_parser(
        "info", help="this machine's CPU features, torch's kernels and a model's kernel plan",
        description="Print the CPU's features (from the OS), torch's capability, and the kernel "
                    "plan for a model on this machine with the times it was chosen by (measured at "
                    "the model's first load on a machine, then cached).")
    info.add_argument("--model", metavar="PATH", help="a checkpoint folder or .gguf file "
                      "(default: the embedded model)")
    info.add_argument("--no-model", action="store_true", help="only the machine; load no model")
    info.add_argument("--measure", action="store_true",
                      help="measure the plan again instead of reading the cached one")
    info.add_argument("--json", action="store_true", dest="as_json", help="one JSON object")
    info.add_argument("--quiet", action="store_true", help="no progress bars")
    # how a model's first load measures its plan in a child process (models._measure_plan_apart)
    info.add_argument("--measure-here", action="store_true", help=argparse.SUPPRESS)
    info.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    info.set_defaults(func=_cmd_info)


def _cmd_info(args: argparse.Namespace, out: TextIO) -> int:
    from .plan import machine_info

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"machine": machine_info()}
    if not args.no_model:
        from . import models
        from .models import load_model

        if args.measure_here:
            models._MEASURE_APART = False

        # --measure is CONSTRAINED_SPEC_PLAN=measure for this load (the plan is chosen when
        # describe_kernels first builds the runner)
        with overridden(plan="measure") if args.measure else contextlib.nullcontext():
            loaded = load_model(args.model, quiet=args.quiet)
            report["model"] = loaded.describe_kernels()
    if args.as_json:
        print(json.dumps(report), file=out)
        return EXIT_OK
    m = report["machine"]
    lines = [f"cpu: {m['cpu']}", f"cpu flags: {' '.join(m['flags']) or '(none reported)'}",
             f"torch {m['torch']}: capability {m['capability']}, oneDNN bf16 "
             f"{'yes' if m['mkldnn_bf16'] else 'no'}, {m['threads']} threads"]
    if m["isa_env"]:
        lines.append("restricted by: " + " ".join(f"{k}={v}" for k, v in m["isa_env"].items()))
    if "model" in report:
        d = report["model"]
        lines += [f"model: {d['name']} ({d['runner']}, {d['device']})",
                  f"weights: {d['weights']}",
                  f"resident weight bytes: {d['resident_bytes'] / 2**20:.1f} MiB",
                  f"kernel plan ({d['plan_source']}): {d['plan']}"]
        for phase, times in d.get("times_ms", {}).items():
            lines.append(f"  {phase:>10}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                                          sorted(times.items(), key=lambda kv: kv[1])))
    print("\n".join(lines), file=out)
    return EXIT_OK


_METHOD_ALIASES = {"deepseek_mtp": "mtp"}


def _add_schema_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("schema (one of)")
    forms = group.add_mutually_exclusive_group()
    forms.add_argument("--schema", metavar="SCHEMA",
                       help="a JSON Schema file, an inline JSON Schema, or the concise language "
                            "('name, age int, bio: a short bio')")
    forms.add_argument("--regex", metavar="PATTERN", help="a regular expression the output matches")
    forms.add_argument("--choice", action="append", metavar="TEXT",
                       help="one allowed output; repeat for each choice")
    forms.add_argument("--grammar", metavar="FILE.ebnf", help="an EBNF grammar file (xgrammar syntax)")
    forms.add_argument("--pydantic", metavar="MODULE:CLASS",
                       help="a Pydantic model class (the current directory is importable; "
                            "MODULE may be a .py file)")
    group.add_argument("--schema-multi", action="store_true",
                       help='wrap the schema: {"items": [...]} of any number of matching items')
    group.add_argument("--backend", choices=("xgrammar", "outlines"), default="xgrammar",
                       help="grammar backend (default: %(default)s)")
    group.add_argument("--schema-mode", choices=("default", "strict", "lenient"), default="default",
                       help="pre-flight policy: default refuses unsupported keywords and warns on "
                            "ignored ones, strict refuses both, lenient warns (default: %(default)s)")


# ------------------------------------------------------------------------------------------------
# schema inputs
# ------------------------------------------------------------------------------------------------

def schema_from_args(args: argparse.Namespace) -> Any:
    """The schema object the flags describe (what ``Generator(schema=...)`` takes), or None."""
    from .schemas import Grammar, Regex

    positional = getattr(args, "schema_arg", None)
    if positional is not None and args.schema is not None:
        raise ConfigError("give the schema once: as SCHEMA or with --schema", option="--schema")
    text = positional if positional is not None else args.schema
    if args.schema_multi and (args.regex is not None or args.choice or args.grammar is not None):
        raise ConfigError("wraps a JSON Schema (--schema or --pydantic), not --regex, --choice "
                          "or --grammar", option="--schema-multi")
    schema: Any = None
    if text is not None:
        schema = resolve_schema_text(text)
    elif args.regex is not None:
        schema = Regex(args.regex)
    elif args.choice:
        schema = list(args.choice)
    elif args.grammar is not None:
        schema = Grammar(_read_text(args.grammar, "--grammar"))
    elif args.pydantic is not None:
        schema = load_pydantic(args.pydantic)
        if args.schema_multi:
            try:
                schema = schema.model_json_schema()
            except Exception as e:  # pydantic raises several kinds for unschematisable fields
                raise SchemaError(f"--pydantic: {args.pydantic} has no JSON Schema: {e}") from e
    elif args.schema_multi:
        raise ConfigError("needs a schema (--schema or --pydantic)", option="--schema-multi")
    if args.schema_multi:
        schema = wrap_multi(schema)
    return schema


def resolve_schema_text(value: str, *, allow_file: bool = True,
                        source: str = "--schema") -> dict[str, Any]:
    """``--schema``: a file (JSON Schema, or the concise language), inline JSON, or the concise language.

    Text that starts with ``{`` (or ``[``) is JSON; a ``.json`` file always is; anything else is
    the concise language.
    """
    path = Path(value).expanduser()
    if allow_file and _is_file(path):
        text = _read_text(str(path), "--schema")
        return _schema_from_text(text, source=f"file {value}", force_json=path.suffix == ".json")
    if allow_file and value.strip().endswith(".json") and not any(c in value for c in ",:{\n"):
        raise ConfigError(f"schema file {value!r} not found", option="--schema")
    return _schema_from_text(value, source=source, force_json=False)


def _schema_from_text(text: str, *, source: str, force_json: bool) -> dict[str, Any]:
    if not (force_json or text.lstrip().startswith(("{", "["))):
        return dsl_to_schema(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SchemaError(f"{source}: malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(value, dict):
        raise SchemaError(f"{source}: a JSON Schema is an object such as {{\"type\": \"string\"}}, "
                          f"got a JSON {type(value).__name__}", pointer="")
    return value


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte: not a path
        return False


def _read_text(path: str, option: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path!r}: {e.strerror if isinstance(e, OSError) else e}",
                          option=option) from e


def load_pydantic(ref: str) -> type:
    """Import ``module:Class`` (``module`` may be a dotted name or a ``.py`` file)."""
    obj = import_ref(ref, "--pydantic", "MODULE:CLASS")
    from pydantic import BaseModel

    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        raise SchemaError(f"--pydantic: {ref} is not a Pydantic model class "
                          f"(got {type(obj).__name__})")
    return obj


def import_ref(ref: str, option: str, form: str = "MODULE:NAME") -> Any:
    """Import ``module:name`` (``module`` a dotted name or a ``.py`` file; the current
    directory is importable); errors name ``option``."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"expected {form}, got {ref!r}", option=option)
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None or not Path(module_name).is_file():
                raise FileNotFoundError(f"no file {module_name!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            cwd = os.getcwd()
            if cwd not in sys.path and "" not in sys.path:
                sys.path.insert(0, cwd)
            module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may raise anything while it is imported
        raise ConfigError(f"cannot import {module_name!r}: {type(e).__name__}: {e}",
                          option=option) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no {attr!r}", option=option)
        obj = getattr(obj, part)
    return obj


def tools_from_args(args: argparse.Namespace) -> Any:
    """The ToolSet of ``--tool`` / ``--tools`` / ``--tool-choice`` / ``--parallel-tool-calls``
    (None without tools), checked before any model is loaded."""
    from .tools import ToolSet

    tools: list[Any] = []
    for path in args.tool or []:
        text = _read_text(path, "--tool")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: malformed JSON: {e.msg} at line {e.lineno}",
                              option="--tool") from e
        tools.extend(value if isinstance(value, list) else [value])
    for refs in args.tools or []:
        tools.extend(import_ref(ref.strip(), "--tools", "MODULE:FUNCTION")
                     for ref in refs.split(",") if ref.strip())
    if not tools:
        if args.tool_choice is not None or args.parallel_tool_calls:
            raise ConfigError("needs tools (--tool FILE.json or --tools MODULE:FUNCTION)",
                              option="--tool-choice" if args.tool_choice else
                              "--parallel-tool-calls")
        return None
    try:
        return ToolSet(tools, args.tool_choice or "auto", args.parallel_tool_calls)
    except ConfigError as e:
        raise ConfigError(str(e).removeprefix(f"{e.option}: "),
                          option={"tools": "--tool", "tool_choice": "--tool-choice"}.get(
                              e.option or "", e.option)) from e


# ------------------------------------------------------------------------------------------------
# options
# ------------------------------------------------------------------------------------------------

def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | bool | None:
    """``None`` (the library's best default), ``False`` (--no-speculation) or a config."""
    data: dict[str, Any] = {}
    if args.speculative_config is not None:
        try:
            data = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"malformed JSON: {e.msg} at column {e.colno}",
                              option="--speculative-config") from e
        if not isinstance(data, dict):
            raise ConfigError("must be a JSON object such as {\"method\": \"ngram\"}",
                              option="--speculative-config")
    flags = {
        "method": _METHOD_ALIASES.get(args.speculative_algorithm, args.speculative_algorithm),
        "num_speculative_tokens": args.speculative_num_draft_tokens,
        "model": args.speculative_draft_model,
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.speculative_draft_model is not None and "method" not in flags and "method" not in data:
        flags["method"] = "draft_model"
    for key, value in flags.items():
        if key in data and data[key] != value:
            raise ConfigError(f"{key} is {data[key]!r} in --speculative-config but {value!r} in "
                              "its own flag; give it once", option="--speculative-config")
    data.update(flags)
    if args.no_speculation:
        if data:
            raise ConfigError("cannot be combined with the --speculative-* options",
                              option="--no-speculation")
        return False
    return SpeculativeConfig.from_dict(data) if data else None


def generator_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Generator keywords the flags set: sampling, the repetition guard, bounds and retries.

    Bad values fail here, before a model is loaded, with the library's own checks and messages.
    """
    from .api import _check_count, _check_retry_temperature
    from .reasoning import check_reasoning_budget

    options: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "repetition_penalty": args.repetition_penalty,
        "no_repeat_ngram_size": args.no_repeat_ngram_size}
    SamplingParams(**options)
    for name in ("max_string_length", "max_items"):
        options[name] = _check_count(getattr(args, name), name, minimum=1, allow_none=True)
    # None: the library's default (retries on, off while streaming)
    options["max_retries"] = _check_count(args.max_retries, "max_retries", minimum=0,
                                          allow_none=True)
    options["retry_temperature"] = _check_retry_temperature(args.retry_temperature)
    reasoning = getattr(args, "reasoning", "auto")
    options["reasoning"] = {"auto": "auto", "on": True, "off": False}[reasoning]
    options["max_reasoning_tokens"] = check_reasoning_budget(getattr(args, "max_reasoning_tokens", None))
    return options


def layout_from_args(args: argparse.Namespace) -> Any:
    """The JSON layout the model writes: ``--indent N``; with ``--stream --pretty`` an indented
    one (2 unless ``--indent``), since the streamed text is the output; else None (compact)."""
    indent = args.indent
    if indent is not None and indent < 0:
        raise ConfigError(f"must be an integer >= 0, got {indent}", option="--indent")
    if args.stream and indent is not None and not args.pretty:
        raise ConfigError("--stream prints the text as the model writes it, and --indent lays "
                          "it over several lines: add --pretty (or drop --indent)",
                          option="--indent")
    if args.stream and args.pretty and indent is None:
        indent = 2
    if indent is None:
        return None
    from .schemas import JsonLayout

    return JsonLayout(indent=indent)  # json.dumps(indent=N)'s layout: no space before a newline


def _preflight(schema: Any, args: argparse.Namespace, layout: Any) -> None:
    """Refuse a bad schema before loading a model (the Generator repeats this, with warnings)."""
    if schema is None:
        return
    from .schemas import JsonLayout, check_schema, normalize_schema

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = normalize_schema(schema, layout=layout or JsonLayout())
        check_schema(spec, args.backend, args.schema_mode)


def _is_json_schema(schema: Any) -> bool:
    """Whether outputs under ``schema`` are JSON texts (else they are printed as JSON strings)."""
    from pydantic import BaseModel

    return isinstance(schema, (dict, str)) or (isinstance(schema, type) and issubclass(schema, BaseModel))


def output_json(text: str, *, is_json: bool, indent: int | None = None,
                written_indent: int | None = None) -> str:
    """What is printed for one output ``text``: a JSON text indented by ``indent`` (None: on one
    line), anything else as a JSON string. ``written_indent`` is the layout the model wrote
    (``--indent``): a text already in the printed layout is printed as it is."""
    if not is_json:
        return json.dumps(text, ensure_ascii=False)
    if indent == written_indent:
        return text
    return json.dumps(json.loads(text), ensure_ascii=False, indent=indent)


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------

def _read_stdin() -> str:
    """stdin as text, decoded as UTF-8 whatever the locale; bytes that are not UTF-8 become
    lone surrogates (``surrogateescape``), which the prompt checks then name by position."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (tests, embedding programs)
        return sys.stdin.read()
    return buffer.read().decode("utf-8", errors="surrogateescape")


def _read_prompt(args: argparse.Namespace) -> str:
    from .prompts import check_text

    if args.prompt is not None and args.prompt != "-":
        # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
        check_text(args.prompt, "prompt", "the PROMPT argument")
        return args.prompt
    if args.prompt is None and sys.stdin.isatty():
        raise ConfigError("give PROMPT, or pipe it on stdin", option="prompt")
    text = _read_stdin()
    check_text(text, "prompt", "the prompt read from stdin (not UTF-8?)")
    if not text.strip():
        raise ConfigError("the prompt read from stdin is empty", option="prompt")
    return text.rstrip("\n")


def _load_generator(args: argparse.Namespace, schema: Any, options: dict[str, Any],
                    speculative: Any, layout: Any) -> Any:
    from .api import Generator
    from .models import load_model
    from .prompts import check_text

    if isinstance(args.system, str):  # before the model loads
        check_text(args.system, "--system", "the system prompt")
    with _transformers_quiet(args.quiet):
        loaded = load_model(args.model, quiet=args.quiet)
    return Generator(loaded, schema=schema, speculative=speculative, backend=args.backend,
                     schema_mode=args.schema_mode, system_prompt=args.system, layout=layout,
                     **options)


@contextlib.contextmanager
def _transformers_quiet(quiet: bool) -> Iterator[None]:
    """Under --quiet, also silence transformers' own "Loading weights" bar and log messages
    (``load_model(quiet=True)`` only silences the fetch / convert of the embedded model)."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    if args.batch is not None:
        if args.tool or args.tools:
            raise ConfigError("tools apply to one prompt; --batch is not supported with them",
                              option="--batch")
        return _cmd_batch(args, out)
    layout = layout_from_args(args)
    schema = schema_from_args(args)
    options = generator_options_from_args(args)
    if args.stream and options["max_retries"]:
        # only an explicit N > 0: the default retries are simply off while streaming
        raise ConfigError("cannot be combined with --stream: the text of a failed attempt would "
                          "already be on stdout; drop --max-retries (no retries while "
                          "streaming) or drop --stream", option="--max-retries")
    speculative = speculative_from_args(args)
    tools = tools_from_args(args)
    if tools is not None:
        return _cmd_tools(args, out, tools, schema, options, speculative, layout)
    prompt = _read_prompt(args)
    _preflight(schema, args, layout)
    gen = _load_generator(args, schema, options, speculative, layout)
    is_json = _is_json_schema(schema)
    stream = TextStream(gen.model.tokenizer, out, quote=not is_json,
                        after=None if gen.reasoning is None else gen.reasoning.end) \
        if args.stream else None
    [item] = gen.batch([prompt], return_result=True, on_tokens=stream)
    if stream is not None:
        stream.finish(None if isinstance(item, BaseException) else item.text)
    _print_reasoning(args, item)
    if args.stats:
        _print_stats(getattr(item, "stats", None))
    if isinstance(item, BaseException):
        raise item
    if stream is None:
        indent = (2 if args.indent is None else args.indent) if args.pretty else None
        out.write(output_json(item.text, is_json=is_json, indent=indent,
                              written_indent=None if layout is None else layout.indent) + "\n")
        out.flush()
    return EXIT_OK


def _cmd_tools(args: argparse.Namespace, out: TextIO, tools: Any, schema: Any,
               options: dict[str, Any], speculative: Any, layout: Any) -> int:
    """``generate`` with tools: prints the call(s) as JSON, or the text as a JSON string."""
    from .tools import ToolCall

    if tools.active and schema is not None:
        raise ConfigError("a schema applies to text answers, and with tools the answer may be a "
                          "call: drop the schema, or give --tool-choice none", option="--tool")
    if args.stream:
        raise ConfigError("tool calls are printed once complete and validated; drop --stream",
                          option="--stream")
    prompt = _read_prompt(args)
    _preflight(schema, args, layout)
    gen = _load_generator(args, schema, {**options, "tools": tools}, speculative, layout)
    [item] = gen.batch([prompt], return_result=True)
    _print_reasoning(args, item)
    if args.stats:
        _print_stats(getattr(item, "stats", None))
    if isinstance(item, BaseException):
        raise item
    value = item.value
    indent = (2 if args.indent is None else args.indent) if args.pretty else None
    if isinstance(value, ToolCall):
        text = json.dumps(value.to_json(), ensure_ascii=False, indent=indent)
    elif isinstance(value, list) and all(isinstance(v, ToolCall) for v in value):
        text = json.dumps([v.to_json() for v in value], ensure_ascii=False, indent=indent)
    else:  # a text answer (auto), or the schema's value (tool choice none)
        text = output_json(item.text, is_json=_is_json_schema(schema), indent=indent)
    out.write(text + "\n")
    out.flush()
    return EXIT_OK


class TextStream:
    """``on_tokens`` callback writing the output to ``out`` as tokens are accepted.

    The ids so far are decoded as a whole and the new suffix written (decoding token by token
    would split multi-byte characters). Outputs that are not JSON texts are written as one JSON
    string, escaped piece by piece, so stdout still carries JSON.
    """

    def __init__(self, tokenizer: Any, out: TextIO, *, quote: bool, after: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.quote = quote
        self.after = after  # a reasoning model's end marker: only the answer after it is written
        self.ids: list[int] = []
        self.written = ""
        self.started = False

    def __call__(self, index: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        # an incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        if self.after is not None:
            cut = text.find(self.after)
            if cut < 0:
                return  # still thinking
            text = text[cut + len(self.after):]
        self._write_upto(text)

    def _write_upto(self, text: str) -> None:
        if not text.startswith(self.written):
            return  # decoding rewrote an earlier character; wait for more (or the final text)
        new = text[len(self.written):]
        if not new and not (self.quote and not self.started):
            return
        if not self.started and self.quote:
            self.out.write('"')
        self.started = True
        self.out.write(json.dumps(new, ensure_ascii=False)[1:-1] if self.quote else new)
        self.out.flush()
        self.written = text

    def finish(self, text: str | None) -> None:
        """End the output line; ``text`` is the final text, ``None`` after an error."""
        if text is not None:
            self._write_upto(text)
            if self.quote:
                self.out.write('"')
        if self.started:
            self.out.write("\n")
            self.out.flush()


def _print_reasoning(args: argparse.Namespace, item: Any) -> None:
    """--show-reasoning: a reasoning model's thinking on stderr (an error's partial output
    holds it already)."""
    thought = getattr(item, "reasoning", None)
    if getattr(args, "show_reasoning", False) and thought is not None:
        print(f"reasoning: {thought}", file=sys.stderr, flush=True)


def _print_stats(stats: Any) -> None:
    if stats is not None:
        print(json.dumps(stats.to_dict()), file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# --batch
# ------------------------------------------------------------------------------------------------

@dataclass
class BatchLine:
    """One input line of ``--batch``: a prompt (and its own schema), or why it cannot run."""

    line: int
    prompt: Any = None
    schema: Any = None
    has_schema: bool = False
    error: BaseException | None = None
    result: Any = None  # the GenerationResult once it ran


def read_batch(lines: list[str], *, multi: bool = False) -> list[BatchLine]:
    """Parse ``--batch`` lines (blank lines are skipped); a bad line becomes an error record."""
    from .prompts import build_messages
    from .schemas.spec import lone_surrogate

    items = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        item = BatchLine(number)
        bad = lone_surrogate(raw)
        if bad is not None:
            item.error = ConfigError(f"the line is not UTF-8 text ({bad})", option="batch")
            items.append(item)
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            item.error = ConfigError(f"malformed JSON: {e.msg} at column {e.colno}", option="batch")
            items.append(item)
            continue
        try:
            if isinstance(data, str):
                item.prompt = data
            elif isinstance(data, dict):
                unknown = sorted(set(data) - {"prompt", "schema"})
                if unknown:
                    raise ConfigError(f"unknown keys {unknown}; a line is {{\"prompt\": ..., "
                                      "\"schema\": ...}", option="batch")
                if "prompt" not in data:
                    raise ConfigError("the line has no \"prompt\"", option="batch")
                item.prompt = data["prompt"]
                if data.get("schema") is not None:
                    schema = data["schema"]
                    if isinstance(schema, str):
                        schema = resolve_schema_text(schema, allow_file=False,
                                                     source="the line's schema")
                    elif not isinstance(schema, dict):
                        raise SchemaError(f"a line's schema is a JSON Schema object or a "
                                          f"concise-language string, got a JSON {type(schema).__name__}")
                    item.schema = wrap_multi(schema) if multi else schema
                    item.has_schema = True
                    from .schemas import normalize_schema

                    normalize_schema(item.schema)  # a malformed schema fails before a model loads
            else:
                raise ConfigError(f"a line is a JSON string (the prompt) or an object "
                                  f"{{\"prompt\": ..., \"schema\": ...}}, got a JSON {type(data).__name__}",
                                  option="batch")
            build_messages(item.prompt, None, False)  # a bad prompt fails before a model loads
        except ConstrainedSpecError as e:
            item.error = e
        items.append(item)
    return items


def _read_batch_lines(path: str) -> list[str]:
    # decoded with surrogateescape: a line that is not UTF-8 becomes that line's error record
    # (read_batch), not the end of the whole batch
    if path == "-":
        return _read_stdin().splitlines()
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path!r}: {e.strerror}", option="--batch") from e
    return data.decode("utf-8", errors="surrogateescape").splitlines()


def error_record(exc: BaseException, line: int) -> dict[str, Any]:
    """The JSON record written for a failed ``--batch`` line."""
    error: dict[str, Any] = {"type": type(exc).__name__, "message": _one_line(str(exc)), "line": line}
    attempts = getattr(exc, "attempts", 1)
    if attempts > 1:  # retried (--max-retries): every attempt failed
        error["attempts"] = attempts
    if isinstance(exc, (IncompleteOutputError, GenerationError)) and exc.partial_text is not None:
        error["partial_text"] = exc.partial_text
    elif isinstance(exc, OutputValidationError):
        error["text"] = exc.text
    return {"error": error}


def _json_text(value: Any) -> str:
    """One JSON line, UTF-8 where it can be: a string that is not Unicode text (a lone surrogate
    echoed from the input) is written as a JSON escape instead of failing the whole output."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def _cmd_batch(args: argparse.Namespace, out: TextIO) -> int:
    if args.prompt is not None:
        raise ConfigError("give either PROMPT or --batch, not both", option="--batch")
    for flag in ("stream", "pretty"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag} cannot be used with --batch (JSONL is one record per line)",
                              option="--batch")
    layout = layout_from_args(args)
    schema = schema_from_args(args)
    options = generator_options_from_args(args)
    speculative = speculative_from_args(args)
    items = read_batch(_read_batch_lines(args.batch), multi=args.schema_multi)
    _preflight(schema, args, layout)
    runnable = [it for it in items if it.error is None]
    results: list[Any] = []
    if runnable:
        gen = _load_generator(args, schema, options, speculative, layout)
        schemas = ([it.schema if it.has_schema else schema for it in runnable]
                   if any(it.has_schema for it in runnable) else None)
        from tqdm.auto import tqdm

        # the engine reports accepted tokens, not finished requests: the bar counts tokens
        # (those of retried attempts too). on_progress, not on_tokens: it leaves retries on.
        with tqdm(desc=f"{len(runnable)} prompts", unit="tok", file=sys.stderr,
                  disable=args.quiet, leave=False) as bar:
            results = gen.batch([it.prompt for it in runnable], schemas=schemas,
                                return_result=True,
                                on_progress=None if args.quiet else bar.update)
    for it, result in zip(runnable, results):
        if isinstance(result, BaseException):
            it.error = result
        else:
            it.result = result
    failed = 0
    stats = None
    for it in items:
        if it.error is not None:
            failed += 1
            line = _json_text(error_record(it.error, it.line))
            item_stats = getattr(it.error, "stats", None)
        else:
            is_json = _is_json_schema(it.schema if it.has_schema else schema)
            line = output_json(it.result.text, is_json=is_json,
                               written_indent=None if layout is None else layout.indent)
            item_stats = it.result.stats
        out.write(line + "\n")
        if item_stats is not None:
            stats = item_stats if stats is None else stats.merge(item_stats)
    out.flush()
    if args.stats:
        _print_stats(stats)
    if failed:
        if not args.quiet:
            print(f"{PROG}: {failed} of {len(items)} lines failed (error records in the output)",
                  file=sys.stderr)
        return EXIT_BATCH_PARTIAL
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# schema-check
# ------------------------------------------------------------------------------------------------

def _cmd_schema_check(args: argparse.Namespace, out: TextIO) -> int:
    from .schemas import check_schema, normalize_schema, preflight

    schema = schema_from_args(args)
    if schema is None:
        raise ConfigError("give the schema to check (SCHEMA, --regex, --choice, --grammar or "
                          "--pydantic)", option="schema-check")
    spec = normalize_schema(schema)
    refused: SchemaError | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report lists what the warnings would say
        try:
            report = check_schema(spec, args.backend, args.schema_mode)
        except SchemaError as e:  # the policy of --schema-mode refuses it; still show everything
            refused = e
            report = preflight(spec, args.backend)
    if args.as_json:
        out.write(json.dumps({
            "backend": report.backend, "kind": spec.kind, "schema_mode": args.schema_mode,
            "enforced": report.ok, "refused": refused is not None,
            "issues": [{"level": i.level, "keyword": i.keyword, "pointer": i.pointer,
                        "message": i.message} for i in report.issues],
        }, ensure_ascii=False) + "\n")
    else:
        out.write(report.format() + "\n")
    out.flush()
    if refused is not None:
        raise refused
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def exit_code_for(exc: BaseException) -> int:
    """The exit code for an error (``EXIT_CODES``)."""
    if isinstance(exc, SchemaError):
        return EXIT_SCHEMA
    if isinstance(exc, IncompleteOutputError):
        return EXIT_INCOMPLETE
    if isinstance(exc, ModelLoadError):
        return EXIT_MODEL
    if isinstance(exc, OutputValidationError):
        return EXIT_VALIDATION
    if isinstance(exc, ConfigError):
        return EXIT_USAGE
    return EXIT_INTERNAL


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def report_error(exc: BaseException) -> int:
    """Print one line for ``exc`` on stderr (plus the partial text of an incomplete output)."""
    code = exit_code_for(exc)
    attempts = getattr(exc, "attempts", 1)
    after = f" (all {attempts} attempts failed)" if attempts > 1 else ""
    print(f"{PROG}: {EXIT_CODES[code][0]}: {_one_line(str(exc)) or type(exc).__name__}{after}",
          file=sys.stderr)
    if isinstance(exc, IncompleteOutputError):
        print(f"{PROG}: partial output: {json.dumps(exc.partial_text, ensure_ascii=False)}",
              file=sys.stderr)
    return code


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                  line: Any = None) -> None:
    print(f"{PROG}: warning: {_one_line(str(message))}", file=sys.stderr)


@contextlib.contextmanager
def _diagnostics(quiet: bool) -> Iterator[None]:
    """Warnings and the library's log messages as one-liners on stderr; none but errors if quiet."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    package = logging.getLogger("constrained_spec")
    saved = package.level, package.propagate
    package.addHandler(handler)
    package.setLevel(logging.ERROR if quiet else logging.WARNING)
    package.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            if quiet:
                warnings.simplefilter("ignore")
            yield
    finally:
        package.removeHandler(handler)
        package.level, package.propagate = saved


@contextlib.contextmanager
def _stdout_for_results() -> Iterator[TextIO]:
    """Yield the real stdout for results; meanwhile ``sys.stdout`` is stderr, so nothing else
    printed while the command runs can land among the JSON."""
    out = sys.stdout
    original = sys.__stdout__  # None in a process started without a stdout
    if original is not None and out is original and hasattr(out, "reconfigure"):
        with contextlib.suppress(Exception):
            original.reconfigure(encoding="utf-8")  # JSON is UTF-8 (RFC 8259), whatever the locale
    sys.stdout = sys.stderr
    try:
        yield out
    finally:
        sys.stdout = out


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (``EXIT_CODES``)."""
    args = build_parser().parse_args(argv)  # bad arguments: argparse exits with 2
    if args.command == "serve":
        # the server logs to stderr at its --log-level, and stdout is uvicorn's access log
        return _run(args, sys.stdout)
    with _stdout_for_results() as out, _diagnostics(getattr(args, "quiet", False)):
        return _run(args, out)


def _run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the subcommand; an error becomes its one line on stderr and its exit code."""
    try:
        settings()  # a bad CONSTRAINED_SPEC_* value is a usage error, before any work
        return int(args.func(args, out))
    except ConstrainedSpecError as e:
        return report_error(e)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (| head): stop quietly, and keep the interpreter's final
        # flush of stdout from failing again
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except Exception as e:
        if settings().debug:  # read (and so validated) before args.func ran
            import traceback

            traceback.print_exc()
        print(f"{PROG}: {EXIT_CODES[EXIT_INTERNAL][0]}: {type(e).__name__}: "
              f"{_one_line(str(e))} (CONSTRAINED_SPEC_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL
