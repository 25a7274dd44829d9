"""The ``constrained-spec`` command line (``constrained_spec.cli:main``).

`parser` reads the flags, `args` turns them into the library's option objects (shared with the
server's config), `generate` and `batch` run the generate command, `exit_codes` says what went
wrong, `commands` holds `main` and dispatches the subcommands (schema-check, serve, info among them).
"""

from constrained_spec.cli.commands import main

__all__ = ["main"]
