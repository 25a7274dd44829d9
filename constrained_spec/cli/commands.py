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
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from constrained_spec.cli.args import engine_options_from_args, schema_from_args, server_config_from_args
from constrained_spec.cli.batch import run_batch
from constrained_spec.cli.exit_codes import EXIT_CODES, EXIT_INTERNAL, EXIT_OK, PROG, one_line, report_error
from constrained_spec.cli.generate import run_generate
from constrained_spec.cli.parser import build_parser
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    SchemaError,
)
from constrained_spec.settings import overridden, settings


def run_serve(args: argparse.Namespace, out: TextIO) -> int:
    # imported here: without the app extra this raises a ConfigError naming it
    from constrained_spec.server import serve

    config = server_config_from_args(args)
    return serve(args.model, config, host=args.host, port=args.port, log_level=args.log_level,
                 load_options=engine_options_from_args(args))


def run_export(args: argparse.Namespace, out: TextIO) -> int:
    from constrained_spec.model.export import export_hf

    path = export_hf(args.model, args.out, quiet=args.quiet)
    out.write(json.dumps({"path": str(path)}) + "\n")
    return EXIT_OK


def run_info(args: argparse.Namespace, out: TextIO) -> int:
    from constrained_spec.kernels import cpu_native
    from constrained_spec.model.plan import machine_info

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"machine": machine_info()}
    # the q4 / q8 kernels take a compiler and a library that loads, not only the CPU: when they
    # do not run, say why (the plan then never offers them)
    native = cpu_native.available()
    report["native_kernels"] = {"build": cpu_native.build_for_this_cpu(), "available": native,
                                "why_unavailable": None if native else cpu_native.why_unavailable()}
    if not args.no_model:
        from constrained_spec.model import loading as models
        from constrained_spec.model.loading import load_model

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
    nk = report["native_kernels"]
    lines.append(f"native q4/q8 kernels: {nk['build']} build, available" if nk["available"] else
                 f"native q4/q8 kernels: not available ({nk['why_unavailable']}); torch's run instead")
    if "model" in report:
        d = report["model"]
        lines += [f"model: {d['name']} ({d['runner']}, {d['device']})",
                  f"weights: {d['weights']}",
                  f"resident weight bytes: {d['resident_bytes'] / 2**20:.1f} MiB",
                  f"kernel plan: {d['plan']}", "  " + _plan_origin(d)]
        for phase, times in d.get("times_ms", {}).items():
            lines.append(f"  {phase:>10}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                                          sorted(times.items(), key=lambda kv: kv[1])))
    print("\n".join(lines), file=out)
    return EXIT_OK


def _plan_origin(d: dict[str, Any]) -> str:
    """Where the kernel plan that runs came from, in words (`run_info`)."""
    from constrained_spec.model.plan import Conditions

    source = d["plan_source"]
    if source == "flags":
        return ("chosen from the CPU's flags and the weights' formats, not measured "
                "(`constrained-spec info --measure` times the kernels on a quiet machine)")
    if source == "measured" and d.get("plan_conditions"):
        return Conditions(**d["plan_conditions"]).describe() + ", cached for this machine"
    if source == "measured":
        return "measured (when, and under what load, was not recorded)"
    if source == "env":
        return "fixed by CONSTRAINED_SPEC_PLAN"
    return "fixed by the model's dtype or device"


def run_schema_check(args: argparse.Namespace, out: TextIO) -> int:
    from constrained_spec.schemas import check_schema, normalize_schema, preflight

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


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                  line: Any = None) -> None:
    print(f"{PROG}: warning: {one_line(str(message))}", file=sys.stderr)


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


def _generate_or_batch(args: argparse.Namespace, out: TextIO) -> int:
    if args.batch is None:
        return run_generate(args, out)
    if args.tool or args.tools:
        raise ConfigError("tools apply to one prompt; --batch is not supported with them",
                          option="--batch")
    return run_batch(args, out)


def _command(name: str) -> Callable[[argparse.Namespace, TextIO], int]:
    """The function that runs subcommand ``name`` (looked up at each call)."""
    return {"generate": _generate_or_batch, "schema-check": run_schema_check, "serve": run_serve,
            "info": run_info, "export-hf": run_export}[name]


def _run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the subcommand; an error becomes its one line on stderr and its exit code."""
    try:
        settings()  # a bad CONSTRAINED_SPEC_* value is a usage error, before any work
        return int(_command(args.command)(args, out))
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
        if settings().debug:  # read (and so validated) before the command ran
            import traceback

            traceback.print_exc()
        print(f"{PROG}: {EXIT_CODES[EXIT_INTERNAL][0]}: {type(e).__name__}: "
              f"{one_line(str(e))} (CONSTRAINED_SPEC_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL
