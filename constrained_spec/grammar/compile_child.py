"""The compile child's side of `compile_worker` (``python -m constrained_spec.grammar.compile_child``).

Reads the tokenizer (xgrammar's ``TokenizerInfo``, serialized), answers ``("ready", key)``,
then compiles one spec at a time until EOF on stdin (its parent closed the pipe or died).
Kept apart from `compile_worker`, which the package imports: a module run with ``-m`` must not
be imported before it runs.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import IO, Any

from constrained_spec.grammar.compile_worker import read_message, write_message


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child's loop: the tokenizer, then specs until EOF."""
    import xgrammar

    from .compile import (
        CompiledSpec,
        _compile_outlines,
        _compile_xgrammar,
        as_schema_error,
        check_matcher,
    )
    from .tokenizer import TokenizerData

    info = read_message(stdin)
    if info is None:
        return
    tok = TokenizerData._from_info(xgrammar.TokenizerInfo.deserialize_json(info))
    write_message(stdout, ("ready", tok.key))
    while (message := read_message(stdin)) is not None:
        spec, backend = message
        try:
            compile_: Any = _compile_xgrammar if backend == "xgrammar" else _compile_outlines
            obj, heard = compile_(spec, tok)
            check_matcher(CompiledSpec(spec, backend, tok, obj, heard))
            payload = obj.serialize_json() if backend == "xgrammar" else pickle.dumps(obj.index)
            write_message(stdout, ("ok", payload, heard))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            error = as_schema_error(exc, spec, backend)
            write_message(stdout, ("err", str(error), error.keyword, error.pointer, error.backend))


def main() -> None:
    # a compile yields the cores to the engine: generation for the running requests first
    try:
        os.nice(10)
    except OSError:
        pass
    # the protocol owns the real stdout; anything printed goes to stderr instead
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, stdout)


if __name__ == "__main__":
    main()
