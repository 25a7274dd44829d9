"""``constrained-spec generate`` for one prompt: load, generate, print the JSON result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

from constrained_spec.cli.args import (
    engine_options_from_args,
    generator_options_from_args,
    layout_from_args,
    schema_from_args,
    speculative_from_args,
    tools_from_args,
)
from constrained_spec.cli.exit_codes import EXIT_OK
from constrained_spec.errors import (
    ConfigError,
)


def preflight_or_raise(schema: Any, args: argparse.Namespace, layout: Any) -> None:
    """Refuse a bad schema before loading a model (the Generator repeats this, with warnings)."""
    if schema is None:
        return
    from constrained_spec.schemas import JsonLayout, check_schema, normalize_schema

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = normalize_schema(schema, layout=layout or JsonLayout())
        check_schema(spec, args.backend, args.schema_mode)


def is_json_schema(schema: Any) -> bool:
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


def read_stdin() -> str:
    """stdin as text, decoded as UTF-8 whatever the locale; bytes that are not UTF-8 become
    lone surrogates (``surrogateescape``), which the prompt checks then name by position."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (tests, embedding programs)
        return sys.stdin.read()
    return buffer.read().decode("utf-8", errors="surrogateescape")


def _read_prompt(args: argparse.Namespace) -> str:
    from constrained_spec.frontend.prompts import check_text

    if args.prompt is not None and args.prompt != "-":
        # argv bytes that are not UTF-8 arrive as lone surrogates (Python's surrogateescape)
        check_text(args.prompt, "prompt", "the PROMPT argument")
        return args.prompt
    if args.prompt is None and sys.stdin.isatty():
        raise ConfigError("give PROMPT, or pipe it on stdin", option="prompt")
    text = read_stdin()
    check_text(text, "prompt", "the prompt read from stdin (not UTF-8?)")
    if not text.strip():
        raise ConfigError("the prompt read from stdin is empty", option="prompt")
    return text.rstrip("\n")


def load_generator(args: argparse.Namespace, schema: Any, options: dict[str, Any],
                    speculative: Any, layout: Any) -> Any:
    from constrained_spec.api import Generator
    from constrained_spec.frontend.prompts import check_text
    from constrained_spec.model.loading import load_model

    if isinstance(args.system, str):  # before the model loads
        check_text(args.system, "--system", "the system prompt")
    engine = engine_options_from_args(args)
    # loading takes seconds (tens on a first run): say so on stderr, the results' stream
    # (stdout) stays the output alone. No "constrained-spec:" prefix: that one starts errors
    if not args.quiet:
        print(f"loading model {args.model or '(the embedded default)'} ...",
              file=sys.stderr, flush=True)
    started = time.perf_counter()
    with _transformers_quiet(args.quiet):
        loaded = load_model(args.model, quiet=args.quiet, **engine)
    if not args.quiet:
        print(f"model loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)
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


def run_generate(args: argparse.Namespace, out: TextIO) -> int:
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
        return run_tools(args, out, tools, schema, options, speculative, layout)
    prompt = _read_prompt(args)
    preflight_or_raise(schema, args, layout)
    gen = load_generator(args, schema, options, speculative, layout)
    is_json = is_json_schema(schema)
    stream = TextStream(gen.model.tokenizer, out, quote=not is_json,
                        after=None if gen.reasoning is None else gen.reasoning.end) \
        if args.stream else None
    [item] = gen.batch([prompt], return_result=True, on_tokens=stream)
    if stream is not None:
        stream.finish(None if isinstance(item, BaseException) else item.text)
    _print_reasoning(args, item)
    if args.stats:
        print_stats(getattr(item, "stats", None))
    if isinstance(item, BaseException):
        raise item
    if stream is None:
        indent = (2 if args.indent is None else args.indent) if args.pretty else None
        out.write(output_json(item.text, is_json=is_json, indent=indent,
                              written_indent=None if layout is None else layout.indent) + "\n")
        out.flush()
    return EXIT_OK


def run_tools(args: argparse.Namespace, out: TextIO, tools: Any, schema: Any,
               options: dict[str, Any], speculative: Any, layout: Any) -> int:
    """``generate`` with tools: prints the call(s) as JSON, or the text as a JSON string."""
    from constrained_spec.frontend.tools import ToolCall

    if tools.active and schema is not None:
        raise ConfigError("a schema applies to text answers, and with tools the answer may be a "
                          "call: drop the schema, or give --tool-choice none", option="--tool")
    if args.stream:
        raise ConfigError("tool calls are printed once complete and validated; drop --stream",
                          option="--stream")
    prompt = _read_prompt(args)
    preflight_or_raise(schema, args, layout)
    gen = load_generator(args, schema, {**options, "tools": tools}, speculative, layout)
    [item] = gen.batch([prompt], return_result=True)
    _print_reasoning(args, item)
    if args.stats:
        print_stats(getattr(item, "stats", None))
    if isinstance(item, BaseException):
        raise item
    value = item.value
    indent = (2 if args.indent is None else args.indent) if args.pretty else None
    if isinstance(value, ToolCall):
        text = json.dumps(value.to_json(), ensure_ascii=False, indent=indent)
    elif isinstance(value, list) and all(isinstance(v, ToolCall) for v in value):
        text = json.dumps([v.to_json() for v in value], ensure_ascii=False, indent=indent)
    else:  # a text answer (auto), or the schema's value (tool choice none)
        text = output_json(item.text, is_json=is_json_schema(schema), indent=indent)
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


def print_stats(stats: Any) -> None:
    if stats is not None:
        print(json.dumps(stats.to_dict()), file=sys.stderr, flush=True)
