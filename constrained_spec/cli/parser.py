"""The argument parser of ``constrained-spec``: every subcommand, flag and help text.

The parser only reads flags; `args.py` turns them into the library's option objects.
"""

from __future__ import annotations

import argparse
from typing import Any

from constrained_spec.cli.args import METHOD_ALIASES
from constrained_spec.cli.exit_codes import EPILOG_EXIT_CODES, PROG
from constrained_spec.config import METHODS, SamplingParams

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
examples:
  {PROG} serve --port 8000 --enable-metrics
  CONSTRAINED_SPEC_API_KEY=$(cat ~/.config/key) {PROG} serve --host 0.0.0.0
  {PROG} serve --host 0.0.0.0 --api-key-file ~/.config/key

Routes: POST /v1/chat/completions, GET /v1/models, GET /health, and GET /metrics with
--enable-metrics. With an API key every route but /health needs 'Authorization: Bearer KEY'.
The key comes from one of CONSTRAINED_SPEC_API_KEY (as vLLM's VLLM_API_KEY), --api-key-file or
--api-key; the first two keep it out of the command line, which `ps` shows to every local
user. A --host other than localhost, 127.0.0.0/8 or ::1 (0.0.0.0, ::, a LAN address, a host
name) needs a key, or --allow-unauthenticated to serve without one on purpose. Logs go to
stderr; stdout carries uvicorn's access log only. Needs the app extra:
pip install constrained_spec[app]."""


SCHEMA_CHECK_EPILOG = """\
Prints what the grammar backend would not enforce, with JSON pointers into the schema:
"unsupported" keywords make generation refuse the schema, "ignored" ones are not enforced
while generating (the output is still validated at the end). No model is loaded.

exit codes: 0 the schema would run under --schema-mode (ignored keywords may be listed),
3 it would be refused (or is malformed), 2 bad arguments."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``constrained-spec`` (subcommands ``generate``, ``schema-check``,
    ``info``, ``serve``, ``export-hf``)."""
    from constrained_spec import __version__

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
    _add_export_parser(sub)
    return parser


def _add_export_parser(sub: Any) -> None:
    export = sub.add_parser(
        "export-hf", help="a GGUF file (or the embedded model) as a dense Hugging Face folder",
        description="Write a dense Hugging Face folder (config, safetensors, tokenizer) for a "
                    ".gguf file or the embedded model: what vLLM and transformers load "
                    "(--engine vllm does this by itself, once, in the cache). Prints "
                    '{"path": ...} on stdout.')
    export.add_argument("--model", metavar="FILE.gguf", default=None,
                        help="the GGUF file (default: the embedded model)")
    export.add_argument("--out", metavar="FOLDER", default=None,
                        help="a new (or empty) folder to write; default: the cache's own copy")
    export.add_argument("--quiet", action="store_true", help="no progress bars")


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
    _add_engine_arguments(gen)
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
                            ".py file; mod.py:f1,f2 takes several from one module); repeatable")
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


def _add_engine_arguments(parser: Any) -> None:
    """The engine flags ``generate`` and ``serve`` share: ours, or vLLM's (docs/scale-out.md)."""
    group = parser.add_argument_group(
        "engine", "native: this package's engine, in this process (default); vllm: vLLM's "
                  "engine (GPUs, tensor / pipeline parallel, several nodes; the vllm extra)")
    group.add_argument("--engine", choices=("native", "vllm"), default="native",
                       help="(default: %(default)s)")
    group.add_argument("--tensor-parallel-size", type=int, metavar="N", default=None,
                       help="vllm: GPUs that split each layer (one node)")
    group.add_argument("--pipeline-parallel-size", type=int, metavar="N", default=None,
                       help="vllm: stages that split the layers (across nodes with "
                            "--distributed-executor-backend ray)")
    group.add_argument("--distributed-executor-backend", choices=("mp", "ray", "uni"),
                       default=None, help="vllm: how its workers run (default: vLLM chooses)")
    group.add_argument("--vllm-arg", action="append", metavar="NAME=VALUE", default=[],
                       help="vllm: any other vllm.EngineArgs field (VALUE as JSON, else a "
                            "string), e.g. enforce_eager=true or gpu_memory_utilization=0.8; "
                            "repeatable")


def _add_speculation_arguments(group: Any) -> None:
    """The speculation flags ``generate`` and ``serve`` share."""
    group.add_argument("--speculative-config", metavar="JSON",
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 5}\' (FastDeploy / vLLM style)')
    group.add_argument("--speculative-algorithm", metavar="METHOD",
                       choices=[*METHODS, *METHOD_ALIASES],
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
    from constrained_spec.api import (
        DEFAULT_MAX_RETRIES,
        DEFAULT_RETRY_FROM,
        DEFAULT_RETRY_TEMPERATURE,
        RETRY_FROM,
    )

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
    levers.add_argument("--retry-from", choices=RETRY_FROM, default=DEFAULT_RETRY_FROM,
                        help="where a retry after a loop or --max-tokens starts: resume the "
                             "failed attempt from its last good point, or start the output "
                             "again (default: %(default)s)")
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
    _add_engine_arguments(serve)
    group = serve.add_argument_group("serving")
    group.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on; beyond loopback it needs an API key or "
                            "--allow-unauthenticated (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    auth = serve.add_argument_group(
        "authentication", "'Authorization: Bearer KEY' on every route but /health (else 401).\n"
                          "The key from one source: --api-key, --api-key-file or the\n"
                          "CONSTRAINED_SPEC_API_KEY environment variable (as vLLM's VLLM_API_KEY).")
    auth.add_argument("--api-key", default=None, metavar="KEY",
                      help="the key on the command line, where `ps` shows it to every local "
                           "user: prefer CONSTRAINED_SPEC_API_KEY or --api-key-file")
    auth.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="read the key from the first line of FILE (keep it chmod 600)")
    auth.add_argument("--allow-unauthenticated", action="store_true",
                      help="serve a --host beyond loopback without a key, on purpose (a warning "
                           "names the address); without it such a --host needs a key")
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


def _add_info_parser(sub: Any) -> None:
    info = sub.add_parser(
        "info", help="this machine's CPU features, torch's kernels and a model's kernel plan",
        description="Print the CPU's features (from the OS), torch's capability, and the kernel "
                    "plan for a model on this machine: chosen from the CPU's flags, or measured "
                    "(--measure) and cached with when and under what load it was measured.")
    info.add_argument("--model", metavar="PATH", help="a checkpoint folder or .gguf file "
                      "(default: the embedded model)")
    info.add_argument("--no-model", action="store_true", help="only the machine; load no model")
    info.add_argument("--measure", action="store_true",
                      help="measure the plan now (kept for this machine unless other load "
                           "disturbed the measurement)")
    info.add_argument("--json", action="store_true", dest="as_json", help="one JSON object")
    info.add_argument("--quiet", action="store_true", help="no progress bars")
    # how a model's first load measures its plan in a child process (models._measure_plan_apart)
    info.add_argument("--measure-here", action="store_true", help=argparse.SUPPRESS)
    info.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)


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
    forms.add_argument("--structural-tag", metavar="TAG",
                       help="free text with tagged segments: a JSON file or inline JSON in vLLM's "
                            "shape ({\"structures\": [{\"begin\", \"schema\", \"end\"}], "
                            "\"triggers\": [...]}) or xgrammar's ({\"format\": {...}}); each "
                            "segment is validated, the text printed as a JSON string")
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
