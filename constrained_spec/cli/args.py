"""Parsed flags -> the library's option objects: schema, tools, speculative config, generator
options, JSON layout, and the server's config.

The server takes these objects, never an argparse namespace: `constrained_spec.server` does not
import the command line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.errors import (
    ConfigError,
    SchemaError,
)
from constrained_spec.frontend.dsl import dsl_to_schema, wrap_multi
from constrained_spec.json_limits import loads

METHOD_ALIASES = {"deepseek_mtp": "mtp"}


def schema_from_args(args: argparse.Namespace) -> Any:
    """The schema object the flags describe (what ``Generator(schema=...)`` takes), or None."""
    from constrained_spec.schemas import Grammar, Regex

    positional = getattr(args, "schema_arg", None)
    if positional is not None and args.schema is not None:
        raise ConfigError("give the schema once: as SCHEMA or with --schema", option="--schema")
    text = positional if positional is not None else args.schema
    tag = getattr(args, "structural_tag", None)
    if args.schema_multi and (args.regex is not None or args.choice or args.grammar is not None
                              or tag is not None):
        raise ConfigError("wraps a JSON Schema (--schema or --pydantic), not --regex, --choice, "
                          "--grammar or --structural-tag", option="--schema-multi")
    schema: Any = None
    if text is not None:
        schema = resolve_schema_text(text)
    elif args.regex is not None:
        schema = Regex(args.regex)
    elif args.choice:
        schema = list(args.choice)
    elif args.grammar is not None:
        schema = Grammar(_read_text(args.grammar, "--grammar"))
    elif tag is not None:
        schema = structural_tag_arg(tag)
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


def structural_tag_arg(value: str) -> Any:
    """``--structural-tag``: a JSON file or inline JSON (`schemas.StructuralTag.from_dict`)."""
    from constrained_spec.schemas import StructuralTag

    path = Path(value).expanduser()
    text = _read_text(str(path), "--structural-tag") if _is_file(path) else value
    return StructuralTag.from_dict(text, where="--structural-tag")


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
    from constrained_spec.schemas.spec import load_schema_json

    try:
        value = load_schema_json(text, what=source)  # too deep: a SchemaError, before parsing
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


def import_ref(ref: str, option: str, form: str = "MODULE:NAME",
               modules: dict[str, Any] | None = None) -> Any:
    """Import ``module:name`` (``module`` a dotted name or a ``.py`` file; the current
    directory is importable); errors name ``option``. ``modules``: the modules imported so far
    by name, each imported once (a ``.py`` file would otherwise run again per name)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"expected {form}, got {ref!r}", option=option)
    if modules is None:
        modules = {}
    if module_name not in modules:
        modules[module_name] = _import_module(module_name, option)
    obj: Any = modules[module_name]
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no {attr!r}", option=option)
        obj = getattr(obj, part)
    return obj


def tool_refs(value: str) -> list[str]:
    """The ``MODULE:NAME`` references of one ``--tools`` value: ``mod.py:f1,f2,other:g`` ->
    ``mod.py:f1``, ``mod.py:f2``, ``other:g`` (a name without a module is from the module
    named before it)."""
    out: list[str] = []
    module = None
    for ref in (r.strip() for r in value.split(",")):
        if not ref:
            continue
        if ":" in ref:
            module = ref.partition(":")[0]
        elif module is not None:
            ref = f"{module}:{ref}"
        out.append(ref)  # a first name without a module: import_ref says what is expected
    return out


def _import_module(module_name: str, option: str) -> Any:
    """The module ``module_name`` (a dotted name or a ``.py`` file), imported."""
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
    return module


def tools_from_args(args: argparse.Namespace) -> Any:
    """The ToolSet of ``--tool`` / ``--tools`` / ``--tool-choice`` / ``--parallel-tool-calls``
    (None without tools), checked before any model is loaded."""
    from constrained_spec.frontend.tools import ToolSet

    tools: list[Any] = []
    for path in args.tool or []:
        text = _read_text(path, "--tool")
        try:
            value = loads(text, what=f"the file {path}", option="--tool")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: malformed JSON: {e.msg} at line {e.lineno}",
                              option="--tool") from e
        tools.extend(value if isinstance(value, list) else [value])
    modules: dict[str, Any] = {}
    for refs in args.tools or []:
        tools.extend(import_ref(ref, "--tools", "MODULE:FUNCTION[,FUNCTION...]", modules)
                     for ref in tool_refs(refs))
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


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | bool | None:
    """``None`` (the library's best default), ``False`` (--no-speculation) or a config."""
    data: dict[str, Any] = {}
    if args.speculative_config is not None:
        try:
            data = loads(args.speculative_config, what="the value",
                         option="--speculative-config")
        except json.JSONDecodeError as e:
            raise ConfigError(f"malformed JSON: {e.msg} at column {e.colno}",
                              option="--speculative-config") from e
        if not isinstance(data, dict):
            raise ConfigError("must be a JSON object such as {\"method\": \"ngram\"}",
                              option="--speculative-config")
    flags = {
        "method": METHOD_ALIASES.get(args.speculative_algorithm, args.speculative_algorithm),
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


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``load_model``'s engine keywords from ``--engine`` and the vLLM flags ({} for ours); a
    vLLM flag without ``--engine vllm`` is a usage error."""
    chosen = {name: getattr(args, name) for name in
              ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")
              if getattr(args, name, None) is not None}
    extra: dict[str, Any] = {}
    for item in getattr(args, "vllm_arg", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ConfigError(f"--vllm-arg {item!r}: give NAME=VALUE (a vllm.EngineArgs field)",
                              option="vllm-arg")
        try:
            extra[name.strip()] = loads(value, what=f"--vllm-arg {name}", option="vllm-arg")
        except json.JSONDecodeError:
            extra[name.strip()] = value  # a plain string, e.g. kv_cache_dtype=fp8
    if getattr(args, "engine", "native") != "vllm":
        given = [f"--{n.replace('_', '-')}" for n in chosen] + (["--vllm-arg"] if extra else [])
        if given:
            raise ConfigError(f"{', '.join(given)}: options of the vLLM engine; add --engine vllm",
                              option=given[0].lstrip("-"))
        return {}
    return {"engine": "vllm", **chosen, **extra}


def generator_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Generator keywords the flags set: sampling, the repetition guard, bounds and retries.

    Bad values fail here, before a model is loaded, with the library's own checks and messages.
    """
    from constrained_spec.api import DEFAULT_RETRY_FROM, RetryPolicy
    from constrained_spec.config import check_count
    from constrained_spec.frontend.reasoning import check_reasoning_budget

    options: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "repetition_penalty": args.repetition_penalty,
        "no_repeat_ngram_size": args.no_repeat_ngram_size}
    SamplingParams(**options)
    for name in ("max_string_length", "max_items"):
        options[name] = check_count(getattr(args, name), name, minimum=1, allow_none=True)
    # max_retries None: the library's default (retries on, off while streaming)
    retries = RetryPolicy(args.max_retries, args.retry_temperature,
                          getattr(args, "retry_from", DEFAULT_RETRY_FROM))
    options["max_retries"], options["retry_temperature"] = retries.max_retries, retries.temperature
    options["retry_from"] = retries.retry_from
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
    from constrained_spec.schemas import JsonLayout

    return JsonLayout(indent=indent)  # json.dumps(indent=N)'s layout: no space before a newline


def server_config_from_args(args: argparse.Namespace) -> Any:
    """The `ServerConfig` the ``constrained-spec serve`` flags describe (its model name empty
    unless ``--served-model-name`` gives one: `serve` fills in the loaded model's). Bad flags
    fail here, before the model loads: the API key from one of ``--api-key``,
    ``CONSTRAINED_SPEC_API_KEY`` and ``--api-key-file`` (`resolve_api_key`), and a ``--host``
    beyond loopback without a key or ``--allow-unauthenticated`` (`check_exposure`)."""
    from constrained_spec.server import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
    from constrained_spec.server.state import check_exposure, resolve_api_key

    config = ServerConfig(model_name=args.served_model_name or "",
                          speculative=speculative_from_args(args), backend=args.backend,
                          max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                          max_tokens=args.max_tokens,
                          api_key=resolve_api_key(flag=args.api_key, file=args.api_key_file),
                          allow_unauthenticated=args.allow_unauthenticated,
                          max_request_bytes=(DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None
                                             else args.max_request_bytes),
                          enable_metrics=args.enable_metrics)
    check_exposure(args.host, config)  # `serve` checks again (and warns), for Python callers
    return config
