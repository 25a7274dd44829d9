"""One small exception hierarchy for everything a user can get wrong or run into.

Each error says what went wrong, where (a JSON pointer into the schema, a flag name, a line
number) and, where it helps, what to do. Nothing from xgrammar, outlines-core or torch reaches
a user as a raw traceback for a user mistake.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ConstrainedSpecError(Exception):
    """Base class of every error raised by constrained_spec."""

    attempts: int = 1  # generations run before this error was raised (``max_retries``)


class SchemaError(ConstrainedSpecError, ValueError):
    """The schema cannot be enforced: malformed, unsupported keyword, or too slow to compile."""

    def __init__(
        self,
        message: str,
        *,
        keyword: str | None = None,
        pointer: str | None = None,
        backend: str | None = None,
    ) -> None:
        self.keyword = keyword
        self.pointer = pointer
        self.backend = backend
        where = []
        if keyword is not None:
            where.append(f"keyword {keyword!r}")
        if pointer is not None:
            where.append(f"at {pointer or '/'}")
        if backend is not None:
            where.append(f"backend {backend}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class GrammarStoppedError(SchemaError):
    """A request was stopped mid-generation because of its grammar (the schema's fault, not
    the engine's); the output so far is on ``token_ids`` / ``partial_text``."""

    def __init__(self, message: str, *, token_ids: list[int] | None = None,
                 stats: Any = None) -> None:
        super().__init__(message)
        self.token_ids = list(token_ids or [])
        self.stats = stats
        self.partial_text = ""


class GrammarCostError(GrammarStoppedError):
    """A request's grammar matcher worked longer per token than the engine allows (a grammar so
    ambiguous that each token costs more, such as nested counted repetitions): the request was
    stopped so that the others are served."""


class GrammarDeadEndError(GrammarStoppedError):
    """The grammar allowed no token where it could not end (it matches no complete string
    from there)."""


class IncompleteOutputError(ConstrainedSpecError):
    """max_tokens was reached before the grammar completed; carries the partial output."""

    def __init__(self, message: str, *, partial_text: str, token_ids: list[int] | None = None,
                 stats: Any = None) -> None:
        self.partial_text = partial_text
        self.token_ids = list(token_ids or [])
        self.stats = stats
        super().__init__(message)


class RepetitionLoopError(IncompleteOutputError):
    """The output fell into a repetition loop and was stopped before max_tokens (``loops.py``).

    ``period`` (tokens per repeated unit), ``start`` (token offset into the output where the
    repetition began) and ``repeated_text`` say where; ``max_retries`` retries it like any
    incomplete output.
    """

    def __init__(self, message: str, *, partial_text: str, token_ids: list[int] | None = None,
                 stats: Any = None, period: int = 0, start: int = 0,
                 repeated_text: str = "") -> None:
        self.period = period
        self.start = start
        self.repeated_text = repeated_text
        super().__init__(message, partial_text=partial_text, token_ids=token_ids, stats=stats)


class OutputValidationError(ConstrainedSpecError):
    """A completed output failed final validation (jsonschema / Pydantic)."""

    def __init__(self, message: str, *, text: str, errors: Any = None, stats: Any = None) -> None:
        self.text = text
        self.errors = errors
        self.stats = stats
        super().__init__(message)


class GenerationError(ConstrainedSpecError):
    """A request failed while it was generated; the other requests of its batch went on.

    ``stage`` says where: ``"draft"`` (its grammar matcher or the drafter, for this request),
    ``"commit"`` (its matcher accepting the verified tokens), ``"callback"`` (its ``on_tokens``
    callback), ``"forward"`` / ``"verify"`` (the shared batched target forward or verification:
    every request of that step fails), ``"admit"`` (prefill). The original exception is
    ``__cause__``; the output generated before the failure is on ``token_ids`` (and
    ``partial_text`` once decoded).
    """

    def __init__(self, message: str, *, stage: str, token_ids: list[int] | None = None,
                 partial_text: str | None = None, stats: Any = None) -> None:
        self.stage = stage
        self.token_ids = list(token_ids or [])
        self.partial_text = partial_text
        self.stats = stats
        super().__init__(message)

    @classmethod
    def from_exception(cls, stage: str, exc: BaseException | None, *,
                       token_ids: list[int] | None = None, stats: Any = None) -> GenerationError:
        """The error for ``exc`` raised at ``stage`` (kept as ``__cause__``)."""
        what = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        err = cls(f"generation failed ({stage}){what}", stage=stage, token_ids=token_ids, stats=stats)
        err.__cause__ = exc
        return err


class ModelLoadError(ConstrainedSpecError):
    """The model could not be fetched, verified or loaded."""


class CacheFullError(ModelLoadError):
    """The disk (or the user's quota) holding the cache folder is full: nothing was kept.

    ``folder`` is the cache folder written to; ``needed`` the bytes the step needs there where
    known (else None), ``free`` the bytes free there when it failed (else None).
    """

    def __init__(self, message: str, *, folder: Path, needed: int | None = None,
                 free: int | None = None) -> None:
        self.folder = folder
        self.needed = needed
        self.free = free
        super().__init__(message)


class ConfigError(ConstrainedSpecError, ValueError):
    """An option has a bad value (max_tokens, temperature, speculative config, ...)."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        self.option = option
        super().__init__(f"{option}: {message}" if option else message)


class PromptTooLongError(ConfigError):
    """The prompt does not fit in the model's context together with max_tokens."""


class JSONDepthError(ConfigError):
    """JSON from outside nests objects / arrays deeper than the limit (`json_limits`).

    ``what`` names the text or value (``"the request body"``, ``"--batch line 3"``), ``limit``
    the depth allowed, ``path`` the keys and indices down to the first container past it (its
    first levels; ``...`` where it goes on). A schema's readers raise it as a `SchemaError`.
    """

    def __init__(self, message: str, *, what: str, limit: int, path: list[Any],
                 option: str | None = None) -> None:
        self.what = what
        self.limit = limit
        self.path = list(path)
        super().__init__(message, option=option)


class OutputWarning(UserWarning):
    """Part of an output was dropped but the rest is returned (a tool call cut by
    ``max_tokens`` after complete ones): ``GenerationResult.warnings`` holds the same items."""
