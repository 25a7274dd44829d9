"""``constrained-spec generate --batch``: one engine batch over a JSONL file, one record per line.

Every input line gets exactly one output line, in input order, so the N-th output answers the
N-th input line: a line that fails (a blank one too) gets an error record naming its line in
its place; the other lines' outputs are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from constrained_spec.cli.args import (
    generator_options_from_args,
    layout_from_args,
    resolve_schema_text,
    schema_from_args,
    speculative_from_args,
)
from constrained_spec.cli.exit_codes import EXIT_BATCH_PARTIAL, EXIT_OK, PROG, one_line
from constrained_spec.cli.generate import (
    is_json_schema,
    load_generator,
    output_json,
    preflight_or_raise,
    print_stats,
    read_stdin,
)
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    IncompleteOutputError,
    JSONDepthError,
    OutputValidationError,
    SchemaError,
)
from constrained_spec.frontend.dsl import wrap_multi
from constrained_spec.json_limits import loads


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
    """Parse ``--batch`` lines, one item per line; a bad line (a blank or whitespace-only one
    too) becomes an error record."""
    from constrained_spec.frontend.prompts import build_messages
    from constrained_spec.frontend.tools import check_history_arguments
    from constrained_spec.schemas.spec import lone_surrogate

    items = []
    for number, raw in enumerate(lines, start=1):
        item = BatchLine(number)
        if not raw.strip():  # an item all the same: skipping it would shift every later answer
            item.error = ConfigError("the line is blank; every input line gets one output line, "
                                     "in order, so remove blank lines to have none in the output",
                                     option="batch")
            items.append(item)
            continue
        bad = lone_surrogate(raw)
        if bad is not None:
            item.error = ConfigError(f"the line is not UTF-8 text ({bad})", option="batch")
            items.append(item)
            continue
        try:
            # too deep: this line's error record, before json (and every later walker) recurses
            data = loads(raw, what="the line", option="batch")
        except json.JSONDecodeError as e:
            item.error = ConfigError(f"malformed JSON: {e.msg} at column {e.colno}", option="batch")
            items.append(item)
            continue
        except JSONDepthError as e:
            item.error = e
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
                    from constrained_spec.schemas import normalize_schema

                    normalize_schema(item.schema)  # a malformed schema fails before a model loads
            else:
                raise ConfigError(f"a line is a JSON string (the prompt) or an object "
                                  f"{{\"prompt\": ..., \"schema\": ...}}, got a JSON {type(data).__name__}",
                                  option="batch")
            build_messages(item.prompt, None, False)  # a bad prompt fails before a model loads
            check_history_arguments(item.prompt, option="batch")  # JSON text the template reads
        except ConstrainedSpecError as e:
            item.error = e
        items.append(item)
    return items


def _read_batch_lines(path: str) -> list[str]:
    # decoded with surrogateescape: a line that is not UTF-8 becomes that line's error record
    # (read_batch), not the end of the whole batch
    if path == "-":
        return read_stdin().splitlines()
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path!r}: {e.strerror}", option="--batch") from e
    return data.decode("utf-8", errors="surrogateescape").splitlines()


def error_record(exc: BaseException, line: int) -> dict[str, Any]:
    """The JSON record written for a failed ``--batch`` line."""
    error: dict[str, Any] = {"type": type(exc).__name__, "message": one_line(str(exc)), "line": line}
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


def run_batch(args: argparse.Namespace, out: TextIO) -> int:
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
    preflight_or_raise(schema, args, layout)
    runnable = [it for it in items if it.error is None]
    results: list[Any] = []
    if runnable:
        gen = load_generator(args, schema, options, speculative, layout)
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
            is_json = is_json_schema(it.schema if it.has_schema else schema)
            line = output_json(it.result.text, is_json=is_json,
                               written_indent=None if layout is None else layout.indent)
            item_stats = it.result.stats
        out.write(line + "\n")
        if item_stats is not None:
            stats = item_stats if stats is None else stats.merge(item_stats)
    out.flush()
    if args.stats:
        print_stats(stats)
    if failed:
        if not args.quiet:
            print(f"{PROG}: {failed} of {len(items)} lines failed (error records in the output)",
                  file=sys.stderr)
        return EXIT_BATCH_PARTIAL
    return EXIT_OK
