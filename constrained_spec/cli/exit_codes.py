"""Exit codes of the command line, and the one line an error prints on stderr.
"""

from __future__ import annotations

import json
import sys

from constrained_spec.errors import (
    ConfigError,
    IncompleteOutputError,
    ModelLoadError,
    OutputValidationError,
    SchemaError,
)

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
    EXIT_MODEL: ("model error", "the model could not be fetched or loaded (a full cache disk "
                                "too: the error names the folder)"),
    EXIT_VALIDATION: ("invalid output", "the finished output failed final validation"),
    EXIT_BATCH_PARTIAL: ("batch", "--batch: some lines failed (see their error records)"),
}


EPILOG_EXIT_CODES = "exit codes:\n" + "\n".join(
    f"  {code}  {meaning}" for code, (_, meaning) in EXIT_CODES.items())


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


def one_line(text: str) -> str:
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def report_error(exc: BaseException) -> int:
    """Print one line for ``exc`` on stderr (plus the partial text of an incomplete output)."""
    code = exit_code_for(exc)
    attempts = getattr(exc, "attempts", 1)
    after = f" (all {attempts} attempts failed)" if attempts > 1 else ""
    print(f"{PROG}: {EXIT_CODES[code][0]}: {one_line(str(exc)) or type(exc).__name__}{after}",
          file=sys.stderr)
    if isinstance(exc, IncompleteOutputError):
        print(f"{PROG}: partial output: {json.dumps(exc.partial_text, ensure_ascii=False)}",
              file=sys.stderr)
    return code
