"""Compile a `SchemaSpec` for one tokenizer and backend, once: the compile-once half of the
compile / per-request split (`CompiledSpec` -> `Matcher`).

Compiles are cached by ``(spec.key, tok.key, backend)``, least recently used first out past a
bound in bytes (``CONSTRAINED_SPEC_COMPILE_CACHE_MB``, 64: xgrammar counts what a compiled
grammar holds; a grammar of 20,000 choices holds 95 MB, a typical schema under 1 MB). A compile
runs in a daemon worker thread (both backends release the GIL while compiling) and the caller
waits at most ``timeout_s``: past it `SchemaError` is raised and the process never hangs.

Where a compile must also be *stopped* at the deadline (a server: one client's schema must not
keep a core and its memory), ``compile_spec(workers=...)`` runs it in a child process
(`compile_worker.CompileWorkers`), killed at the deadline. Otherwise the abandoned compile keeps
running in its thread and stays in the cache as pending, so retrying the same spec (with a
larger timeout) waits for that work instead of starting it again.

What the backend logs on fd 2 while building and compiling the grammar is heard, not leaked
(`schemas.backend_log`): it stays with the cached `CompiledSpec` (``backend_warnings``), and
what the compile adds to the conversion's messages is logged.

Pre-flight (`schemas.check_schema`) is the caller's business; this module only compiles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

from constrained_spec.errors import SchemaError
from constrained_spec.schemas import SchemaSpec
from constrained_spec.schemas.backend_log import BackendMessage, hear_compile, hear_conversion
from constrained_spec.schemas.backends import conversion
from constrained_spec.schemas.patterns import python_regex, strip_edge_anchors
from constrained_spec.schemas.spec import clean_backend_message
from constrained_spec.settings import settings

from .compile_worker import CompileWorkers, stopped_error
from .matcher import Matcher, OutlinesMatcher, XGrammarMatcher, _OutlinesTables
from .tokenizer import TokenizerData

__all__ = ["CompiledSpec", "CompileWorkers", "compile_spec", "clear_compile_cache",
           "compile_cache_info"]

Backend = Literal["xgrammar", "outlines"]

_cache: OrderedDict[tuple[str, str, str], Future] = OrderedDict()
_sizes: dict[tuple[str, str, str], int] = {}  # bytes of each finished compile in the cache
_cache_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0}

_log = logging.getLogger(__name__)


class CompiledSpec:
    """A spec compiled for one tokenizer and backend; `new_matcher` starts a request.

    ``backend_warnings``: what the backend logged while building and compiling the grammar
    (`schemas.backend_log`; the pre-flight report has the conversion's share as issues). Kept
    with the cached compile, so a cache hit carries the same warnings."""

    def __init__(self, spec: SchemaSpec, backend: str, tok: TokenizerData, backend_object: Any,
                 backend_warnings: tuple[BackendMessage, ...] = ()) -> None:
        self.spec = spec
        self.backend = backend
        self.tok = tok
        # xgrammar: CompiledGrammar; outlines: _OutlinesTables (Index + per-state masks)
        self.backend_object = backend_object
        self.backend_warnings = backend_warnings
        self._ebnf: str | None = None

    def ebnf(self) -> str:
        """The compiled grammar written back as xgrammar EBNF (computed once): how an engine
        that compiles grammars itself (vLLM's, `generation.vllm_engine`) receives exactly this
        one -- our JSON conversion, bounds and fixes included. xgrammar only."""
        if self.backend != "xgrammar":
            raise SchemaError(f"only an xgrammar-compiled grammar has an EBNF form, not a "
                              f"{self.backend} one", backend=self.backend)
        if self._ebnf is None:
            self._ebnf = str(self.backend_object.grammar)
        return self._ebnf

    def new_matcher(self) -> Matcher:
        if self.backend == "xgrammar":
            return XGrammarMatcher(self)
        return OutlinesMatcher(self.backend_object)

    def __repr__(self) -> str:
        return f"CompiledSpec(kind={self.spec.kind!r}, backend={self.backend!r}, key={self.spec.key[:12]})"


def compile_spec(spec: SchemaSpec, tok: TokenizerData, *, backend: Backend = "xgrammar",
                 timeout_s: float | None = 30.0, workers: CompileWorkers | None = None) -> CompiledSpec:
    """Compile `spec` for `tok` on `backend` (cached).

    ``workers``: compile in their child processes, where a compile past ``timeout_s`` is
    stopped (the server's mode, `compile_worker`), not in a thread of this process.

    Raises
    ------
    SchemaError
        The backend cannot compile the spec (its message, ``backend=`` set), the backend does not
        support the spec kind (EBNF on outlines), or compiling took longer than `timeout_s`.
    """
    if backend not in ("xgrammar", "outlines"):
        raise SchemaError(f"unknown backend {backend!r}; use 'xgrammar' or 'outlines'")
    if backend == "outlines" and spec.kind == "grammar":
        raise SchemaError("EBNF grammars are not supported by the outlines backend, use xgrammar",
                          backend="outlines")
    key = (spec.key, tok.key, backend)
    with _cache_lock:
        future = _cache.get(key)
        if future is not None:
            _cache.move_to_end(key)
            _stats["hits"] += 1
        else:
            _stats["misses"] += 1
            future = Future()
            _cache[key] = future
            worker = threading.Thread(target=_run, args=(future, key, spec, tok, backend, timeout_s,
                                                         workers),
                                      name=f"compile-{backend}-{spec.key[:8]}", daemon=True)
            worker.start()
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        if workers is not None:  # its child is killed at this deadline: a retry starts anew
            with _cache_lock:
                if _cache.get(key) is future:
                    del _cache[key]
            raise stopped_error(spec, timeout_s, backend) from None
        raise SchemaError(f"compiling the {spec.kind} spec took longer than {timeout_s} s; simplify "
                          "the schema or raise timeout_s (the compile continues in the background "
                          "and a retry reuses it)", backend=backend) from None


def _run(future: Future, key: tuple, spec: SchemaSpec, tok: TokenizerData, backend: str,
         timeout_s: float | None, workers: CompileWorkers | None) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        if workers is not None:  # in a child process, stopped at the deadline
            obj, heard = workers.compile(spec, tok, backend, timeout_s)
        else:
            compile_ = _compile_xgrammar if backend == "xgrammar" else _compile_outlines
            obj, heard = compile_(spec, tok)
        compiled = CompiledSpec(spec, backend, tok, obj, heard)
        if workers is None:  # (a compile child checks its own)
            check_matcher(compiled)
        _account(key, future, compiled)  # before its callers see it: the bound holds for them
        future.set_result(compiled)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting caller
        with _cache_lock:
            if _cache.get(key) is future:
                del _cache[key]  # failures are not cached
                _sizes.pop(key, None)
        future.set_exception(as_schema_error(exc, spec, backend))


def as_schema_error(exc: BaseException, spec: SchemaSpec, backend: str) -> SchemaError:
    """``exc`` as the `SchemaError` a caller gets: itself, or the backend's failure."""
    if isinstance(exc, SchemaError):
        return exc
    return SchemaError(f"the {backend} backend cannot compile this {spec.kind} spec: "
                       f"{clean_backend_message(exc)}", backend=backend)


#: CPU seconds the probe's mask may take (`check_matcher`): a JSON schema's take milliseconds
PROBE_MASK_S = 0.1


def check_matcher(compiled: CompiledSpec) -> None:
    r"""Raise `SchemaError` when the compiled grammar matches no string (no first token and no
    empty output: ``root ::= a``, ``a ::= b``, ``b ::= a``; every generation would fail at its
    first step), or when its matcher, after one of the tokens it allows first (the longest of
    at most 2, 4, 8, 16 bytes, and the longest), takes more than `PROBE_MASK_S` of CPU for the
    next mask: an ambiguous grammar (``(\w{1,20} ?){1,50}``: 0.7 s for the mask after "hello"),
    which would hold the engine that long at every token.
    Run where the compile runs (its thread or its child process), not on the engine."""
    import numpy as np
    import torch

    tok = compiled.tok
    matcher = compiled.new_matcher()
    mask = torch.zeros((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    what = "grammar" if compiled.spec.kind == "grammar" else f"{compiled.spec.kind} spec"
    if not bool(mask.any()) and not matcher.is_completed():
        raise SchemaError(f"the {what} matches no string: no token can start it (a rule that "
                          "only refers to rules that never end, such as 'a ::= b' with "
                          "'b ::= a'?)", backend=compiled.backend)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: tok.vocab_size]
    allowed = [i for i in np.flatnonzero(bits).tolist() if i not in tok.eos_token_ids]
    # tokens of growing length, up to the longest: the work grows with the characters a token
    # adds, so the first past the limit costs a few times the limit, not the longest's seconds
    probes: list[int] = []
    for most in (2, 4, 8, 16, 1 << 30):
        fitting = [i for i in allowed if len(tok.decoded[i]) <= most]
        if fitting:
            best = max(fitting, key=lambda i: len(tok.decoded[i]))
            if best not in probes:
                probes.append(best)
    for probe in probes:
        spent = _mask_cpu_after(matcher, probe, mask)
        if spent <= PROBE_MASK_S:
            continue
        text = tok.decoded[probe].decode("utf-8", "replace")
        raise SchemaError(f"the {what} is too ambiguous for its matcher: after the token "
                          f"{text!r:.40} the next mask took {spent:.2f} s of CPU (the limit is "
                          f"{PROBE_MASK_S} s; a JSON schema's take milliseconds), and it would "
                          "cost about that at every token (repetitions that can split a text "
                          "many ways, such as '(\\w{1,20} ?){1,50}'); write it so that each "
                          "text has one reading", backend=compiled.backend)


def _mask_cpu_after(matcher: Matcher, token: int, mask: Any) -> float:
    """CPU seconds the mask after ``token`` takes on a fork of ``matcher`` (0 if refused)."""
    fork = matcher.fork()
    if not fork.accept(token):
        return 0.0
    started = time.thread_time()
    fork.fill_bitmask(mask, 0)
    return time.thread_time() - started


def _account(key: tuple, future: Future, compiled: CompiledSpec) -> None:
    """Count a finished compile's bytes; the least recently used go past the bound
    (``CONSTRAINED_SPEC_COMPILE_CACHE_MB``). Pending compiles count nothing yet."""
    size = _size_of(compiled.backend_object)
    limit = settings().compile_cache_mb << 20
    with _cache_lock:
        if _cache.get(key) is not future:
            return  # cleared meanwhile
        _sizes[key] = size
        total = sum(_sizes.values())
        for old in list(_cache):
            if total <= limit:
                break
            if old in _sizes and old != key:
                total -= _sizes.pop(old)
                del _cache[old]
        if total > limit:  # this one alone is past the bound: used by its caller, not kept
            _sizes.pop(key)
            del _cache[key]


def _size_of(backend_object: Any) -> int:
    """The bytes a compiled grammar holds: xgrammar's own count; for outlines-core, its
    index serialized (its per-state masks grow later, bounded apart by `_OutlinesTables`)."""
    size = getattr(backend_object, "memory_size_bytes", None)
    if size is not None:
        return int(size)
    import pickle

    return len(pickle.dumps(backend_object.index))


def _xgrammar_compiler(tok: TokenizerData) -> Any:
    import xgrammar

    # Our cache sits above; xgrammar's own would hold a second copy of every grammar.
    return tok.derived("xgrammar_compiler", lambda: xgrammar.GrammarCompiler(
        tok.xgr_info, max_threads=8, cache_enabled=False))


def _compile_xgrammar(spec: SchemaSpec, tok: TokenizerData) -> tuple[Any, tuple[BackendMessage, ...]]:
    import xgrammar

    if spec.kind == "json_schema":
        converted = conversion(spec, "xgrammar")
        grammar, source, heard = converted.result, converted.source, list(converted.heard)
    else:
        if spec.kind == "choice":
            source = "root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choices)
        elif spec.kind == "regex":
            # Python's "." (no newline unless (?s)), not xgrammar's (any character)
            source = python_regex(spec.regex or "")
        else:
            source = spec.ebnf or ""
        with hear_conversion("xgrammar", source) as heard:
            if spec.kind == "regex":
                grammar = xgrammar.Grammar.from_regex(source)
            else:
                grammar = xgrammar.Grammar.from_ebnf(
                    source, root_rule_name="root" if spec.kind == "choice" else spec.root)
    with hear_compile("xgrammar", source) as compiling:
        compiled = _xgrammar_compiler(tok).compile_grammar(grammar)
    return compiled, _merge_heard(spec, heard, compiling)


def _merge_heard(spec: SchemaSpec, converting: list[BackendMessage],
                 compiling: list[BackendMessage]) -> tuple[BackendMessage, ...]:
    """The conversion's messages, then the compile's new ones (a compile repeats a regex's
    warnings), which are logged: the pre-flight report only has the conversion's."""
    seen = {m.text for m in converting}
    new = [m for m in compiling if m.text not in seen]
    for m in new:
        if m.level in ("warning", "error"):
            _log.warning("compiling the %s spec %s: %s", spec.kind, spec.key[:12], m.format())
    return (*converting, *new)


_EBNF_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _ebnf_literal(text: str) -> str:
    if text == "":
        return '""'
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # \x would swallow following hex digits
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _compile_outlines(spec: SchemaSpec, tok: TokenizerData) -> tuple[_OutlinesTables, tuple[BackendMessage, ...]]:
    import outlines_core

    heard: list[BackendMessage] = []
    if spec.kind == "json_schema":
        converted = conversion(spec, "outlines")
        regex, heard = converted.result, list(converted.heard)
    elif spec.kind == "regex":
        regex = strip_edge_anchors(python_regex(spec.regex or ""))  # Python's "." (see above)
    else:  # choices: escaped literals, no "." to translate
        regex = strip_edge_anchors(spec.regex or "")
    with hear_compile("outlines", regex) as compiling:
        index = outlines_core.Index(regex, tok.outlines_vocabulary())
    return _OutlinesTables(index, tok), _merge_heard(spec, heard, compiling)


def clear_compile_cache() -> None:
    """Forget every compiled spec (pending compiles finish unobserved)."""
    with _cache_lock:
        _cache.clear()
        _sizes.clear()
        _stats.update(hits=0, misses=0)


def compile_cache_info() -> dict[str, int]:
    """hits / misses since the last clear, the number of cached entries and their bytes."""
    with _cache_lock:
        return {**_stats, "size": len(_cache), "bytes": sum(_sizes.values())}
