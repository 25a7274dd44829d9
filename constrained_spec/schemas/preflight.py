"""Pre-flight report: which parts of a schema a backend will not enforce, before generating.

This is the library's honesty mechanism. A grammar backend that silently drops a keyword lets
the model emit instances the user's schema forbids; the final validation would then fail after
the tokens were paid for. The report lists, with a JSON pointer into the user's schema:

* ``"unsupported"``: the backend rejects the keyword or cannot compile it;
* ``"ignored"``: the backend compiles but does not enforce it (invalid instances possible).

Per backend a walker mirrors that backend's converter: which keyword of a node wins (xgrammar:
``$ref`` > ``const`` > ``enum`` > ``anyOf`` > ``oneOf`` > ``allOf`` > type keywords; outlines:
``properties`` > ``allOf`` > ``anyOf`` > ``oneOf`` > ``prefixItems`` > ``enum`` > ``const`` >
``$ref`` > ``type``), which siblings the winner drops, and the per-type rules of ``support.py``.
Then the backend's converter itself is run (cheap, no tokenizer) so that anything else it
rejects is reported too, and what it logs meanwhile (xgrammar writes a warning to stderr for a
oneOf it falls back to anyOf on, a look-ahead it ignores, ...; `backend_log`) becomes an
"ignored" issue at the keyword it is about (`backend_issues`), unless the walker said it
already: "every keyword is enforced" is never printed over a backend warning. The conversion
is cached with what was heard, so a second pre-flight of the same schema reports the same.
Annotation keywords (title, description, default, ...) and unknown keywords restrict nothing
and are never reported.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from constrained_spec.errors import SchemaError

from .backend_issues import explain, locate
from .backend_log import BackendMessage, hear_conversion
from .backends import (
    FORMAT_PATTERNS,
    INT64_MAX,
    INT64_MIN,
    all_of_values,
    constrains_nothing,
    conversion,
    declarable_required,
    extra_bypass,
)
from .disjoint import deref, one_of_disjoint
from .disjoint import types_of as _types
from .disjoint import value_type as _value_type
from .patterns import (
    REGEX_FEATURES,
    pattern_admits_escaped,
    python_regex,
    regex_features,
    scan_regex,
)
from .pointers import resolve_local_ref
from .refs import check_refs
from .regex_overlap import key_patterns_overlap
from .spec import SchemaSpec, to_pointer
from .support import (
    ANNOTATIONS,
    KEYWORD_SUPPORT,
    OUTLINES_FORMATS,
    OUTLINES_LOOSE_FORMATS,
    PASSIVE,
    REGEX_SUPPORT,
    TYPE_KEYWORDS,
    XGRAMMAR_FORMATS,
    XGRAMMAR_INT_MULTIPLE_OF_MAX,
    XGRAMMAR_INT_MULTIPLE_OF_RANGE_MAX,
)

__all__ = ["PreflightIssue", "PreflightReport", "SchemaWarning", "preflight", "check_schema"]

Level = Literal["unsupported", "ignored", "narrowed"]


class SchemaWarning(UserWarning):
    """A schema keyword the backend will not enforce (see the pre-flight report)."""


@dataclass
class PreflightIssue:
    """One keyword a backend does not enforce: what, where (JSON pointer) and why.

    ``level``: "unsupported" (refused or mis-compiled), "ignored" (instances the schema forbids
    can be generated) or "narrowed" (some instances the schema allows cannot be generated;
    nothing it forbids can). ``construct``: for a pattern, the regex construct at fault
    (`patterns.REGEX_FEATURES`), or "json-escape" (the pattern allows a character JSON writes
    only as an escape, which xgrammar's patterns never write).
    """

    keyword: str
    pointer: str
    level: Level
    backend: str
    message: str
    construct: str | None = None

    def format(self) -> str:
        return f"{self.level}: {self.keyword} at {self.pointer or '/'} ({self.backend}): {self.message}"


@dataclass
class PreflightReport:
    """Everything one backend would not enforce in one schema."""

    backend: str
    issues: list[PreflightIssue] = field(default_factory=list)
    # keywords the grammar adds on request (max_string_length / max_items): `bounds.AddedBound`
    added_bounds: list[Any] = field(default_factory=list)

    @property
    def unsupported(self) -> list[PreflightIssue]:
        return [i for i in self.issues if i.level == "unsupported"]

    @property
    def ignored(self) -> list[PreflightIssue]:
        return [i for i in self.issues if i.level == "ignored"]

    @property
    def narrowed(self) -> list[PreflightIssue]:
        return [i for i in self.issues if i.level == "narrowed"]

    @property
    def ok(self) -> bool:
        """True when the backend enforces the whole schema (it may narrow it: every generated
        instance is still valid)."""
        return not (self.unsupported or self.ignored)

    def format(self) -> str:
        """Human-readable: one line per issue (or one line saying all is enforced)."""
        lines = [issue.format() for issue in self.issues] or [
            f"{self.backend}: every keyword is enforced"]
        return "\n".join(lines + [b.format() for b in self.added_bounds])


# --------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------

def preflight(spec: SchemaSpec, backend: Literal["xgrammar", "outlines"] = "xgrammar") -> PreflightReport:
    """Report what `backend` would not enforce in `spec` (see the module docstring).

    Raises `SchemaError` for an unknown backend, and for a reference that does not resolve
    inside the schema (`refs.check_refs`; `normalize_schema` has already refused those).
    """
    if backend not in ("xgrammar", "outlines"):
        raise SchemaError(f"unknown backend {backend!r}; use 'xgrammar' or 'outlines'")
    report = PreflightReport(backend=backend)
    if spec.kind == "grammar":
        if backend == "outlines":
            report.issues.append(PreflightIssue(
                "grammar", "", "unsupported", backend,
                "EBNF grammars are not supported by the outlines backend; use xgrammar"))
        else:
            _try_xgrammar_text("grammar", spec.ebnf or "", report, root=spec.root)
        return report
    if spec.kind in ("regex", "choice"):
        if spec.kind == "regex":
            report.issues.extend(_regex_issues(spec.regex or "", "", "regex", backend, context="regex"))
            if backend == "xgrammar":
                _try_xgrammar_text("regex", spec.regex or "", report)
        return report
    # a spec built by hand skipped normalisation: its walkers' jsonschema checks must not meet
    # a reference outside the document either (refs.py)
    check_refs(spec.json_schema or {})
    walker = _XGrammarWalker if backend == "xgrammar" else _OutlinesWalker
    report.issues.extend(walker(spec.json_schema or {}).run())
    # converted even when something is unsupported: lenient mode compiles it anyway, and what
    # the backend logs while converting belongs in the report either way
    try:
        converted = conversion(spec, backend)
    except SchemaError as exc:
        if not report.unsupported:
            report.issues.append(PreflightIssue("", "", "unsupported", backend, str(exc)))
    else:
        _add_heard(report, converted.heard, spec.json_schema or {})
    return report


def check_schema(spec: SchemaSpec, backend: Literal["xgrammar", "outlines"] = "xgrammar",
                 mode: Literal["default", "strict", "lenient"] = "default") -> PreflightReport:
    """Run `preflight` and act on it.

    ``default``: raise `SchemaError` for an unsupported keyword, warn (`SchemaWarning`) for an
    ignored one. ``strict``: raise for both. ``lenient``: warn for both. Returns the report.
    """
    if mode not in ("default", "strict", "lenient"):
        raise SchemaError(f"check_schema mode must be 'default', 'strict' or 'lenient', got {mode!r}")
    report = preflight(spec, backend)
    raising = {"default": ("unsupported",), "strict": ("unsupported", "ignored"), "lenient": ()}[mode]
    fatal = [i for i in report.issues if i.level in raising]
    if fatal:
        first = fatal[0]
        more = (f" (and {len(fatal) - 1} more: {'; '.join(i.format() for i in fatal[1:])})"
                if len(fatal) > 1 else "")
        hint = (" Simplify the schema, try the other backend, or pass mode='lenient' to generate "
                "anyway (the output is still validated)." if first.level == "ignored" else "")
        raise SchemaError(f"{first.message}{more}.{hint}", keyword=first.keyword or None,
                          pointer=first.pointer, backend=backend)
    for issue in report.issues:
        if issue.level != "narrowed":  # nothing invalid is generated: the report says it
            warnings.warn(SchemaWarning(issue.format()), stacklevel=2)
    return report


# --------------------------------------------------------------------------------------------
# regex features
# --------------------------------------------------------------------------------------------

#: Where a pattern sits (support.REGEX_CONTEXTS), as a report names it.
_CONTEXT_NAMES = {"regex": "a Regex", "pattern": "a string 'pattern'",
                  "propertyNames": "a 'propertyNames' pattern",
                  "patternProperties": "a 'patternProperties' key"}


#: What to do instead of a construct, where there is something better than leaving it out.
_REGEX_FIXES = {
    "non-digit": "write [^0-9] if only ASCII digits are to be excluded (the same in every backend)",
    "non-word": "write [^A-Za-z0-9_] if only ASCII letters and digits are to be excluded",
    "non-space": "write [^ \\t\\n\\r\\f\\v] if only ASCII spaces are to be excluded",
    "lookahead": "spell the condition out without look-around (alternatives, or an 'enum')",
    "negative-lookahead": "spell the exclusion out without look-around (alternatives, or a "
                          "'not' the final validation checks)",
    "flag-i": "spell both cases out, e.g. [Aa]",
    "flag-x": "remove the whitespace and comments of the verbose pattern",
    "inner-anchor": "move ^ / $ to the start / end of the pattern or of a top-level alternative",
    "string-anchor": "write ^ and $",
    "possessive": "drop the extra '+' (a plain quantifier matches the same whole strings here "
                  "unless the pattern relies on it)",
}


def _regex_issues(pattern: str, pointer: str, keyword: str, backend: str, *,
                  context: str) -> list[PreflightIssue]:
    """The constructs of `pattern` `backend` does not handle as Python's re does in `context`
    (`support.REGEX_SUPPORT`, measured), one issue each, naming the construct."""
    issues: list[PreflightIssue] = []
    where = _CONTEXT_NAMES[context]
    other = "outlines" if backend == "xgrammar" else "xgrammar"
    for feature, text in regex_features(pattern).items():
        status = REGEX_SUPPORT[feature][backend].get(context, "enforced")
        if status == "enforced":
            continue
        name = f"{REGEX_FEATURES[feature]} {text!r}"
        elsewhere = (f"; backend {other!r} enforces it"
                     if REGEX_SUPPORT[feature][other].get(context) == "enforced" else "")
        fix = _REGEX_FIXES.get(feature, "rewrite the pattern without it") + elsewhere
        if status == "unsupported":
            level: Level = "unsupported"
            message = f"the {name} in {where} cannot be compiled by {backend}; {fix}"
        elif status == "wrong":
            level = "unsupported"
            message = (f"{backend} mis-compiles the {name} in {where}: it would generate strings "
                       f"the pattern excludes and refuse some it allows; {fix}")
        elif status == "ignored":
            level = "ignored"
            message = (f"{backend} does not enforce the {name} in {where}: strings the pattern "
                       f"excludes can be generated (final validation, with Python's re, rejects "
                       f"them); {fix}")
        else:
            level = "narrowed"
            message = (f"{backend} refuses some strings the {name} in {where} allows (never one "
                       f"it excludes){elsewhere}")
        issues.append(PreflightIssue(keyword, pointer, level, backend, message, construct=feature))
    if context != "regex" and backend == "outlines":
        pieces = scan_regex(pattern)
        risky = [text for kind, text in pieces
                 if (kind == "class" and text.startswith("[^"))
                 or (kind == "esc" and text in ("\\D", "\\W", "\\S", "\\s", "\\\\", '\\"', "\\n",
                                                 "\\t", "\\r", "\\f", "\\v"))
                 or (kind == "esc" and text[:2] in ("\\x", "\\u") and _is_control_escape(text))
                 or (kind == "char" and text in ('"', "\\"))]
        if risky:
            issues.append(PreflightIssue(
                keyword, pointer, "ignored", backend, "outlines matches patterns against the raw "
                f"JSON text: {', '.join(sorted(set(risky)))} can emit a raw quote, backslash or "
                "control character (an invalid JSON string)"))
    return issues


def _is_control_escape(text: str) -> bool:
    digits = text[2:].strip("{}")
    try:
        return int(digits[:4], 16) < 0x20 or int(digits[:4], 16) in (0x22, 0x5C)
    except ValueError:
        return False


def _try_xgrammar_text(kind: Literal["regex", "grammar"], text: str, report: PreflightReport,
                      root: str = "root") -> None:
    """Build the xgrammar grammar of a regex / EBNF spec as `compile_spec` does, hearing what
    xgrammar logs meanwhile: a failure is "unsupported" (unless something already is), each
    warning an issue at the root."""
    import xgrammar

    from .spec import clean_backend_message

    source = python_regex(text) if kind == "regex" else text  # what compile_spec hands it
    try:
        with hear_conversion("xgrammar", source) as heard:
            if kind == "regex":
                xgrammar.Grammar.from_regex(source)
            else:
                xgrammar.Grammar.from_ebnf(source, root_rule_name=root)
    except Exception as exc:
        if not report.unsupported:
            message = f"xgrammar cannot compile the {kind}: {clean_backend_message(exc)}"
            report.issues.append(PreflightIssue(kind, "", "unsupported", "xgrammar", message))
        return
    _add_heard(report, heard, None, keyword=kind)


def _add_heard(report: PreflightReport, heard: Iterable[BackendMessage], schema: Any,
               keyword: str = "") -> None:
    """Each warning the backend logged (`backend_log`) as an "ignored" issue at the keyword it
    is about (`backend_issues.locate`; the root when it cannot be placed), unless the report
    already has an unsupported / ignored issue there or at a keyword containing it. `schema`
    None: a regex / grammar spec, every warning at the root under `keyword`."""
    for message in heard:
        if message.level not in ("warning", "error"):
            continue
        places = locate(message, schema) if schema is not None else []
        for kw, pointer in places or [(keyword, "")]:
            if any(i.level in ("unsupported", "ignored") and (
                    i.pointer == pointer or i.pointer and pointer.startswith(i.pointer + "/"))
                   for i in report.issues):
                continue  # said already (there, or of a keyword containing it), in its own words
            report.issues.append(PreflightIssue(kw, pointer, "ignored", report.backend,
                                                explain(message, kw)))


# --------------------------------------------------------------------------------------------
# schema walkers
# --------------------------------------------------------------------------------------------

_ALWAYS_IGNORED = {
    "not": "'not' is not enforced",
    "if": "'if' / 'then' / 'else' are not enforced",
    "dependentRequired": "'dependentRequired' is not enforced",
    "dependentSchemas": "'dependentSchemas' is not enforced",
    "dependencies": "'dependencies' is not enforced",
    "contentEncoding": "'contentEncoding' is not enforced",
    "contentMediaType": "'contentMediaType' is not enforced",
    "contentSchema": "'contentSchema' is not enforced",
    "uniqueItems": "array items may repeat: 'uniqueItems' is not enforced",
    "contains": "'contains' is not enforced",
    "minContains": "'minContains' is not enforced",
    "maxContains": "'maxContains' is not enforced",
}
_TYPED_IGNORED = {
    **{k: {"array"} for k in ("uniqueItems", "contains", "minContains", "maxContains")},
    **{k: {"string"} for k in ("contentEncoding", "contentMediaType", "contentSchema")},
    **{k: {"object"} for k in ("dependentRequired", "dependentSchemas", "dependencies")},
}
_UNSUPPORTED_ALWAYS = {
    "$dynamicRef": "'$dynamicRef' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported",
}


def _constraint_keys(node: dict) -> list[str]:
    """Keywords of `node` that restrict instances (known, not annotations)."""
    return [k for k in node if k in KEYWORD_SUPPORT and k not in ANNOTATIONS and k not in PASSIVE
            and not (k == "uniqueItems" and node[k] is False)]


class _Walker:
    backend = ""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.issues: list[PreflightIssue] = []
        self._seen: set[tuple[str, str | None]] = set()
        self._validator: Any = None

    # ---- helpers ------------------------------------------------------------------------
    def add(self, keyword: str, pointer: str, level: Level, message: str,
            construct: str | None = None) -> None:
        issue = PreflightIssue(keyword, pointer, level, self.backend, message, construct)
        if all((i.keyword, i.pointer, i.level, i.construct) != (keyword, pointer, level, construct)
               for i in self.issues):
            self.issues.append(issue)

    def add_all(self, issues: Iterable[PreflightIssue]) -> None:
        for i in issues:
            self.add(i.keyword, i.pointer, i.level, i.message, i.construct)

    def run(self) -> list[PreflightIssue]:
        self.walk(self.root, [], ())
        return self.issues

    def resolve(self, ref: Any) -> tuple[Any, list[Any]] | None:
        """Target and path of a local ref ("#", "#/a/b"); None if not local / not found."""
        return resolve_local_ref(self.root, ref)

    def deref(self, node: Any, depth: int = 8) -> Any:
        return deref(node, self.root, depth)

    def validator(self, schema: Any) -> Any:
        from .refs import validator

        if self._validator is None:
            self._validator = validator(self.root)  # never fetches a reference (refs.py)
        return self._validator.evolve(schema=schema)

    def check_values(self, node: dict, path: list[Any], values: list[Any], winner: str) -> None:
        """const / enum win over their siblings: flag a sibling some allowed value violates."""
        rest = {k: v for k, v in node.items() if k != winner}
        if not _constraint_keys(rest):
            return
        for value in values:
            for error in self.validator(rest).iter_errors(value):
                kw = str(error.schema_path[0]) if error.schema_path else str(error.validator)
                self.add(kw, to_pointer(path + [kw]), "ignored",
                         f"{winner} value {json.dumps(value)[:40]} violates {kw!r}, which "
                         f"{self.backend} does not check next to {winner!r}")

    def implied(self, keyword: str, value: Any, branches: Iterable[Any]) -> bool:
        """Does every branch already state this sibling constraint (so dropping it is harmless)?"""
        branches = [self.deref(b) for b in branches]
        if not branches:
            return False
        for b in branches:
            if not isinstance(b, dict):
                return False
            if keyword == "type":
                wanted = {value} if isinstance(value, str) else set(value)
                have = _types(b)
                if have is None:
                    vals = [b["const"]] if "const" in b else b.get("enum")
                    if not isinstance(vals, list):
                        return False
                    have = [_value_type(v) for v in vals]
                if not all(t in wanted or (t == "integer" and "number" in wanted) for t in have):
                    return False
            elif b.get(keyword, object()) != value:
                return False
        return True

    def drop_siblings(self, node: dict, path: list[Any], winner: str, consumed: Iterable[str] = (),
                      branches: Iterable[Any] = ()) -> None:
        branches = list(branches)
        for k in _constraint_keys(node):
            if k == winner or k in consumed:
                continue
            if k in _UNSUPPORTED_ALWAYS:
                self.add(k, to_pointer(path + [k]), "unsupported", _UNSUPPORTED_ALWAYS[k])
            elif not self.implied(k, node[k], branches):
                self.add(k, to_pointer(path + [k]), "ignored",
                         f"{self.backend} uses {winner!r} here and drops its sibling {k!r}; move "
                         f"{k!r} into the {winner!r} branches")

    def always(self, node: dict, path: list[Any]) -> None:
        types = _types(node)
        for k in _constraint_keys(node):
            if types is not None and k in _TYPED_IGNORED and not (set(types) & _TYPED_IGNORED[k]):
                continue  # e.g. uniqueItems on a node that can only be an object: no effect
            if k in _ALWAYS_IGNORED:
                self.add(k, to_pointer(path + [k]), "ignored", _ALWAYS_IGNORED[k])
            elif k in _UNSUPPORTED_ALWAYS:
                self.add(k, to_pointer(path + [k]), "unsupported", _UNSUPPORTED_ALWAYS[k])

    def walk_ref(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        ref = node["$ref"]
        target = self.resolve(ref)
        if target is None:
            local = isinstance(ref, str) and ref.startswith("#")
            self.add("$ref", to_pointer(path + ["$ref"]), "unsupported",
                     f"$ref {ref!r} " + ("points nowhere in this schema" if local and ref.startswith("#/")
                                         else "is not a local JSON pointer ('#/...'); remote refs and "
                                         "anchors are not supported; inline the referenced schema"))
            return
        if ref in stack:
            self.recursive_ref(path, ref)
            return
        key = (ref, None)
        if key in self._seen:
            return
        self._seen.add(key)
        self.walk(target[0], target[1], stack + (ref,))

    def recursive_ref(self, path: list[Any], ref: str) -> None:
        """A $ref back into its own ancestors; xgrammar handles recursion natively."""

    def oneof(self, node: dict, path: list[Any]) -> None:
        if not self.disjoint(node["oneOf"]):
            self.add("oneOf", to_pointer(path + ["oneOf"]), "ignored",
                     "oneOf is generated as anyOf: an instance matching several branches (which "
                     "oneOf forbids) is possible; make the branches disjoint, e.g. with a const "
                     "discriminator property required in every branch")

    def disjoint(self, branches: list[Any]) -> bool:
        return one_of_disjoint(branches, self.root)

    def walk_map(self, node: dict, key: str, path: list[Any], stack: tuple[str, ...],
                 default_type: str | None = None) -> None:
        for name, sub in (node.get(key) or {}).items():
            if sub is False and key == "properties":
                continue  # dropped before conversion: an undeclared property is never generated
            self.walk(sub, path + [key, name], stack, default_type)

    def walk_list(self, node: dict, key: str, path: list[Any], stack: tuple[str, ...]) -> None:
        for i, sub in enumerate(node.get(key) or []):
            self.walk(sub, path + [key, i], stack)

    ORDER: tuple[str, ...] = ()

    def walk(self, node: Any, path: list[Any], stack: tuple[str, ...],
             default_type: str | None = None) -> None:
        """Check ``node`` at ``path``: a ``false`` schema is reported, anything but a schema
        object skipped, and an object goes to `walk_keyword` with the first of the backend's
        ``ORDER`` keywords it has (the one that decides how the backend reads it)."""
        if node is False:
            self.false_schema(path)
            return
        if not isinstance(node, dict):
            return
        winner = next((k for k in self.ORDER if k in node), None)
        self.walk_keyword(node, path, stack, winner, default_type)

    def walk_keyword(self, node: dict, path: list[Any], stack: tuple[str, ...],
                     winner: str | None, default_type: str | None) -> None:
        raise NotImplementedError

    def false_schema(self, path: list[Any]) -> None:
        # the keyword holding the `false`: /properties/x -> properties, /items -> items
        containers = ("properties", "prefixItems", "anyOf", "oneOf", "allOf", "patternProperties")
        if len(path) >= 2 and path[-2] in containers:
            kw = str(path[-2])
        else:
            kw = str(path[-1]) if path else "false"
        self.add(kw, to_pointer(path), "unsupported",
                 "a 'false' subschema is not supported here; remove the property / branch instead")

    def required_undeclared(self, node: dict, path: list[Any]) -> None:
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        missing = [r for r in node.get("required") or [] if r not in props]
        if missing:
            self.add("required", to_pointer(path + ["required"]), "ignored",
                     f"required {', '.join(map(repr, missing))} not declared in 'properties' is never "
                     "generated; declare it under 'properties'")


class _XGrammarWalker(_Walker):
    backend = "xgrammar"
    ORDER = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")

    def walk_keyword(self, node: dict, path: list[Any], stack: tuple[str, ...],
                     winner: str | None, default_type: str | None) -> None:
        if winner == "$ref":
            self.drop_siblings(node, path, "$ref", branches=[node])
            self.walk_ref(node, path, stack)
        elif winner in ("const", "enum"):
            values = [node["const"]] if winner == "const" else list(node["enum"])
            self.check_values(node, path, values, winner)
        elif winner in ("anyOf", "oneOf", "allOf"):
            branches = node[winner]
            if winner == "allOf" and len(branches) > 1:
                if all_of_values(node, self.root) is not None:
                    return  # a member fixes the values: generated as their exact enum
                self.add("allOf", to_pointer(path + ["allOf"]), "ignored",
                         "xgrammar generates any JSON value for allOf with several subschemas; "
                         "merge them into one schema")
                self.drop_siblings(node, path, "allOf")
                return
            self.drop_siblings(node, path, winner, branches=branches)
            if winner == "oneOf":
                self.oneof(node, path)
            self.walk_list(node, winner, path, stack)
        else:
            self.typed(node, path, stack, default_type)

    def typed(self, node: dict, path: list[Any], stack: tuple[str, ...], default_type: str | None) -> None:
        self.always(node, path)
        if isinstance(node.get("type"), list) and not all(isinstance(t, str) for t in node["type"]):
            self.add("type", to_pointer(path + ["type"]), "unsupported",
                     "a schema inside a 'type' list (draft 3 union types) is not supported by "
                     "xgrammar; write the alternatives as 'anyOf'")
        types = _types(node)
        if types is None:
            if any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
                types = ["object"]
                self.untyped(path, "object")
            elif any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
                types = ["array"]
                self.untyped(path, "array")
            elif default_type:
                types = [default_type]
            else:
                for k in _constraint_keys(node):
                    if any(k in kws for kws in TYPE_KEYWORDS.values()) and k not in _ALWAYS_IGNORED:
                        self.add(k, to_pointer(path + [k]), "ignored",
                                 f"no 'type' here, so xgrammar generates any JSON value and ignores "
                                 f"{k!r}; add a 'type'")
                return
        for t in types:
            getattr(self, f"t_{t}", lambda *a: None)(node, path, stack)

    def untyped(self, path: list[Any], generated: str) -> None:
        # JSON Schema applies object (array) keywords to objects (arrays) only: without a 'type'
        # any other value is valid too. xgrammar generates the type the keywords describe, which
        # is what an LM asked for this schema should write; the report says it.
        self.add("type", to_pointer(path), "narrowed",
                 f"no 'type' here: xgrammar generates an {generated}, as the {generated} keywords "
                 f"describe, although the schema also allows any value that is not an {generated}; "
                 f"add a 'type' listing the others if they are wanted")

    def t_string(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        fmt = node.get("format")
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        if isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS:
            for k in (["pattern"] if "pattern" in node else []) + lengths:
                self.add(k, to_pointer(path + [k]), "ignored",
                         f"xgrammar enforces format {fmt!r} and drops {k!r} next to it")
            if fmt in FORMAT_PATTERNS and "pattern" in node:
                self.add("format", to_pointer(path + ["format"]), "ignored",
                         f"next to 'pattern', format {fmt!r} is checked for its syntax only "
                         "(Feb 30, an ipv4 octet with a leading zero or a 64-character hostname "
                         "label is possible); drop the pattern")
            return
        if fmt is not None:
            self.add("format", to_pointer(path + ["format"]), "ignored",
                     f"xgrammar does not know format {fmt!r}; any string is generated")
        if isinstance(node.get("pattern"), str):
            for k in lengths:
                self.add(k, to_pointer(path + [k]), "ignored",
                         f"xgrammar enforces 'pattern' and drops {k!r} next to it; put the length "
                         "into the pattern, e.g. ^[a-z]{3,8}$")
            context = "propertyNames" if path and path[-1] == "propertyNames" else "pattern"
            self.add_all(_regex_issues(node["pattern"], to_pointer(path + ["pattern"]), "pattern",
                                       "xgrammar", context=context))
            if pattern_admits_escaped(node["pattern"]):
                self.add("pattern", to_pointer(path + ["pattern"]), "narrowed",
                         "xgrammar writes no escape inside a string with a 'pattern': values "
                         "holding a quote, a backslash or a control character (a newline), which "
                         "this pattern allows, are not generated", construct="json-escape")

    def required_undeclared(self, node: dict, path: list[Any]) -> None:
        # the rewrite declares a required name with the schema that applies to it
        # (`backends.declarable_required`): only the others are never generated
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        declared = declarable_required(node)
        missing = [r for r in node.get("required") or [] if r not in props and r not in declared]
        if missing:
            self.add("required", to_pointer(path + ["required"]), "ignored",
                     f"required {', '.join(map(repr, missing))} is never generated: not declared "
                     "in 'properties', and forbidden by additionalProperties: false or matched "
                     "by several patternProperties; declare it under 'properties'")

    def pattern_bypass(self, node: dict, path: list[Any]) -> None:
        """xgrammar lets a declared property's name through a patternProperties key pattern too
        (its value then follows the pattern's schema, or the key comes twice)."""
        props, patterns = node.get("properties"), node.get("patternProperties")
        if not isinstance(props, dict) or not isinstance(patterns, dict):
            return
        for name, sub in props.items():
            for pattern, psub in patterns.items():
                try:
                    hit = re.search(pattern, name) is not None  # searched, as JSON Schema does
                except re.error:
                    hit = True
                if hit and sub is not False and psub != sub:
                    self.add("patternProperties", to_pointer(path + ["properties", name]), "ignored",
                             f"xgrammar also accepts the key {name!r} through patternProperties "
                             f"{pattern!r}, so its value may follow that schema instead (or the "
                             "key may appear twice); make the pattern exclude declared names")
                    break

    def pattern_overlap(self, node: dict, path: list[Any]) -> None:
        """A name matching two patternProperties keys must follow both schemas; xgrammar writes
        it with either one's value (`regex_overlap`)."""
        patterns = node.get("patternProperties")
        if not isinstance(patterns, dict):
            return
        keys = list(patterns)
        for i, first in enumerate(keys):
            for second in keys[i + 1:]:
                if patterns[first] == patterns[second] or not key_patterns_overlap(first, second):
                    continue
                for this, other in ((first, second), (second, first)):  # either may be broken
                    self.add("patternProperties", to_pointer(path + ["patternProperties", this]),
                             "ignored", f"a key matching both {this!r} and {other!r} must follow "
                             "both schemas, but xgrammar writes it with the value of either one; "
                             "make the patterns exclude each other or merge their schemas")

    def extra_bypass(self, node: dict, path: list[Any]) -> None:
        """Next to properties and patternProperties / propertyNames, xgrammar writes the extra
        keys of additionalProperties (unevaluatedProperties) as any string: a declared name or a
        pattern key can come through them with the extra-keys schema's value. The xgrammar
        rewrite drops an extra-keys schema that admits anything (`backends.extra_bypass`);
        one with constraints of its own is reported at each key it can stand in for."""
        key = extra_bypass(node)
        if key is None or constrains_nothing(node[key]):
            return
        extra = node[key]
        names = node.get("propertyNames") if not node.get("patternProperties") else None
        for name, sub in node["properties"].items():
            if sub is False or sub == extra or (
                    isinstance(names, dict) and not self.validator(names).is_valid(name)):
                continue  # the same schema, or a name the extra keys cannot have
            self.add(key, to_pointer(path + ["properties", name]), "ignored",
                     f"xgrammar also writes the key {name!r} as one of the extra keys of "
                     f"{key!r}, with a value of that schema instead of this one (or twice); "
                     f"set {key!r} to true (no extra keys are then generated) or false")
        for pattern, sub in (node.get("patternProperties") or {}).items():
            if sub != extra:
                self.add(key, to_pointer(path + ["patternProperties", pattern]), "ignored",
                         f"xgrammar also writes keys matching {pattern!r} as extra keys of "
                         f"{key!r}, with a value of that schema instead of this one; set "
                         f"{key!r} to true (no extra keys are then generated) or false")

    def t_integer(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        for k, beyond in (("minimum", INT64_MAX), ("exclusiveMinimum", INT64_MAX),
                          ("maximum", INT64_MIN), ("exclusiveMaximum", INT64_MIN)):
            v = node.get(k)
            if (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and (v > beyond if k.endswith("inimum") else v < beyond)):
                self.add(k, to_pointer(path + [k]), "unsupported",
                         f"integer {k} {v!r} is outside the 64-bit range (-2**63 .. 2**63 - 1) "
                         "that xgrammar's integer grammar works in; use backend 'outlines' (the "
                         "bound is then checked after generating), or a string with a 'pattern'")
        for k, beyond in (("minimum", INT64_MIN), ("exclusiveMinimum", INT64_MIN),
                          ("maximum", INT64_MAX), ("exclusiveMaximum", INT64_MAX)):
            v = node.get(k)
            if (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and (v < beyond if k.endswith("inimum") else v > beyond)):
                self.add(k, to_pointer(path + [k]), "narrowed",
                         f"integer {k} {v!r} is past the 64-bit range xgrammar's integer grammar "
                         "works in: the bound is clamped to it, so integers beyond 64 bits are not "
                         "generated; use backend 'outlines' if they are needed")
        m = node.get("multipleOf")
        if m is None:
            return
        bounds = [node.get(k) for k in ("minimum", "exclusiveMinimum")], [
            node.get(k) for k in ("maximum", "exclusiveMaximum")]
        lo = [b for b in bounds[0] if isinstance(b, (int, float))]
        hi = [b for b in bounds[1] if isinstance(b, (int, float))]
        ok = float(m).is_integer() and 0 < m <= XGRAMMAR_INT_MULTIPLE_OF_MAX
        if ok and (lo or hi):
            ok = bool(lo and hi) and (min(hi) - max(lo)) < XGRAMMAR_INT_MULTIPLE_OF_RANGE_MAX
        if not ok:
            self.add("multipleOf", to_pointer(path + ["multipleOf"]), "ignored",
                     "xgrammar enforces integer multipleOf only for whole numbers up to "
                     f"{XGRAMMAR_INT_MULTIPLE_OF_MAX}, unbounded or with both bounds less than "
                     f"{XGRAMMAR_INT_MULTIPLE_OF_RANGE_MAX} apart")

    def t_number(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        if "integer" not in (_types(node) or []):
            for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
                v = node.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > 2 ** 53:
                    # bounds are doubles in xgrammar; measured: [0, 1e30] refuses
                    # 9223372036854775807, [2**70, 1e30] admits only numbers near 2**70;
                    # nothing outside the range was seen accepted
                    self.add(k, to_pointer(path + [k]), "narrowed",
                             f"number {k} {v!r} is past 2**53 (exact doubles): xgrammar's range grammar then "
                             "admits only part of the range (e.g. not 9223372036854775807 under "
                             "maximum 1e30); use backend 'outlines' if the whole range is needed")
        if "multipleOf" in node and "integer" not in (_types(node) or []):
            self.add("multipleOf", to_pointer(path + ["multipleOf"]), "ignored",
                     "xgrammar does not enforce multipleOf for type 'number'")

    def t_array(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        self.walk_list(node, "prefixItems", path, stack)
        items = node.get("items")
        if isinstance(items, dict):
            self.walk(items, path + ["items"], stack)
        elif "items" not in node and isinstance(node.get("unevaluatedItems"), dict):
            self.walk(node["unevaluatedItems"], path + ["unevaluatedItems"], stack)

    def t_object(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        self.walk_map(node, "properties", path, stack)
        self.walk_map(node, "patternProperties", path, stack)
        for key in node.get("patternProperties") or {}:
            self.add_all(_regex_issues(key, to_pointer(path + ["patternProperties", key]),
                                       "patternProperties", "xgrammar", context="patternProperties"))
        self.pattern_bypass(node, path)
        self.pattern_overlap(node, path)
        self.extra_bypass(node, path)
        self.required_undeclared(node, path)
        if isinstance(node.get("additionalProperties"), dict):
            self.walk(node["additionalProperties"], path + ["additionalProperties"], stack)
        elif "additionalProperties" not in node and isinstance(node.get("unevaluatedProperties"), dict):
            self.walk(node["unevaluatedProperties"], path + ["unevaluatedProperties"], stack)
        if isinstance(node.get("propertyNames"), dict):
            self.walk(node["propertyNames"], path + ["propertyNames"], stack, default_type="string")


class _OutlinesWalker(_Walker):
    backend = "outlines"
    ORDER = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref")

    def recursive_ref(self, path: list[Any], ref: str) -> None:
        self.add("$ref", to_pointer(path + ["$ref"]), "ignored",
                 f"recursive $ref {ref!r}: outlines unrolls recursion 3 levels deep and silently "
                 "drops deeper properties, even required ones; use xgrammar")

    def walk_keyword(self, node: dict, path: list[Any], stack: tuple[str, ...],
                     winner: str | None, default_type: str | None) -> None:
        if winner == "properties":
            self.always(node, path)
            self.t_properties(node, path, stack)
        elif winner in ("allOf", "anyOf", "oneOf"):
            branches = node[winner]
            if winner == "allOf" and len(branches) > 1:
                self.add("allOf", to_pointer(path + ["allOf"]), "unsupported",
                         "outlines concatenates the subschemas of allOf (not JSON); merge them into "
                         "one schema or use xgrammar")
                return
            self.drop_siblings(node, path, winner, branches=branches)
            if winner == "oneOf":
                self.oneof(node, path)
            self.walk_list(node, winner, path, stack)
        elif winner == "prefixItems":
            self.always(node, path)
            n = len(node["prefixItems"])
            if isinstance(node.get("minItems"), int) and node["minItems"] > n:
                self.add("minItems", to_pointer(path + ["minItems"]), "ignored",
                         "outlines generates exactly the prefixItems tuple, never more items")
            if isinstance(node.get("maxItems"), int) and node["maxItems"] < n:
                self.add("maxItems", to_pointer(path + ["maxItems"]), "ignored",
                         "outlines generates the whole prefixItems tuple, longer than maxItems")
            consumed = ("type", "items", "unevaluatedItems", "minItems", "maxItems") + tuple(_ALWAYS_IGNORED)
            self.drop_siblings(node, path, "prefixItems", consumed=consumed, branches=[])
            self.walk_list(node, "prefixItems", path, stack)
        elif winner in ("enum", "const"):
            values = [node["const"]] if winner == "const" else list(node["enum"])
            # The other of const / enum comes after in outlines' order; both value-checked.
            self.check_values(node, path, values, winner)
        elif winner == "$ref":
            self.drop_siblings(node, path, "$ref", branches=[node])
            self.walk_ref(node, path, stack)
        elif "type" in node:
            self.always(node, path)
            for t in _types(node) or []:
                getattr(self, f"t_{t}", lambda *a: None)(node, path, stack)
        else:
            keys = _constraint_keys(node)
            if keys and default_type is None:
                self.add(keys[0], to_pointer(path + [keys[0]]), "unsupported",
                         "outlines needs a 'type' (or properties / enum / const / $ref / anyOf) "
                         "in this schema")

    def t_properties(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        props = node["properties"]
        required = [r for r in node.get("required") or [] if r in props]
        self.required_undeclared(node, path)
        mn, mx = node.get("minProperties"), node.get("maxProperties")
        if isinstance(mn, int) and mn > len(required):
            self.add("minProperties", to_pointer(path + ["minProperties"]), "ignored",
                     "outlines ignores minProperties next to 'properties'; make more properties required")
        if isinstance(mx, int) and mx < len(props):
            self.add("maxProperties", to_pointer(path + ["maxProperties"]), "ignored",
                     "outlines ignores maxProperties next to 'properties'")
        names = node.get("propertyNames")
        if isinstance(names, dict):
            bad = [p for p in props if not self.validator(names).is_valid(p)]
            if bad:
                self.add("propertyNames", to_pointer(path + ["propertyNames"]), "ignored",
                         f"declared properties {bad} violate propertyNames, which outlines does not check")
        consumed: tuple[str, ...] = (
            "type", "required", "additionalProperties", "unevaluatedProperties",
            "patternProperties", "propertyNames", "minProperties", "maxProperties")
        consumed += tuple(_ALWAYS_IGNORED) + tuple(k for t, kws in TYPE_KEYWORDS.items()
                                                   if t != "object" for k in kws)
        self.drop_siblings(node, path, "properties", consumed=consumed)
        self.walk_map(node, "properties", path, stack)

    def t_string(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        pattern = node.get("pattern")
        fmt = node.get("format")
        if lengths:
            for k in ("pattern", "format"):
                if k in node:
                    self.add(k, to_pointer(path + [k]), "ignored",
                             f"outlines enforces {' / '.join(lengths)} and drops {k!r} next to it")
            return
        if isinstance(pattern, str):
            if fmt is not None:
                self.add("format", to_pointer(path + ["format"]), "ignored",
                         "outlines enforces 'pattern' and drops 'format' next to it")
            self.add_all(_regex_issues(pattern, to_pointer(path + ["pattern"]), "pattern", "outlines",
                                       context="pattern"))
            return
        if fmt is not None:
            if fmt not in OUTLINES_FORMATS:
                self.add("format", to_pointer(path + ["format"]), "unsupported",
                         f"outlines does not support format {fmt!r} (it knows "
                         f"{', '.join(sorted(OUTLINES_FORMATS))}); use xgrammar or a pattern")
            elif fmt in OUTLINES_LOOSE_FORMATS:
                self.add("format", to_pointer(path + ["format"]), "ignored",
                         f"outlines' {fmt!r} regex {OUTLINES_LOOSE_FORMATS[fmt]}")

    def t_number(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if k in node:
                self.add(k, to_pointer(path + [k]), "ignored", f"outlines does not enforce {k!r}")

    t_integer = t_number

    def t_array(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        items = node.get("items")
        if items is False:
            if not (isinstance(node.get("maxItems"), int) and node["maxItems"] == 0):
                self.add("items", to_pointer(path + ["items"]), "unsupported",
                         "outlines does not support items: false; use maxItems: 0")
        elif isinstance(items, dict):
            self.walk(items, path + ["items"], stack)
        elif "unevaluatedItems" in node and node["unevaluatedItems"] is not True:
            self.add("unevaluatedItems", to_pointer(path + ["unevaluatedItems"]), "ignored",
                     "outlines ignores unevaluatedItems; use items")

    def t_object(self, node: dict, path: list[Any], stack: tuple[str, ...]) -> None:
        addl = node.get("additionalProperties")
        closed = addl is False
        if isinstance(addl, dict):
            self.walk(addl, path + ["additionalProperties"], stack)
        mn, mx = node.get("minProperties"), node.get("maxProperties")
        if isinstance(mn, int) and mn > 1:
            self.add("minProperties", to_pointer(path + ["minProperties"]), "ignored",
                     "outlines only enforces minProperties 0 or 1 on objects without 'properties'")
        if isinstance(mx, int) and mx > 0 and not closed:
            self.add("maxProperties", to_pointer(path + ["maxProperties"]), "ignored",
                     "outlines only enforces maxProperties 0 on objects without 'properties'")
        for k in ("patternProperties", "propertyNames"):
            if k in node and not (closed and "patternProperties" not in node and "propertyNames" not in node):
                self.add(k, to_pointer(path + [k]), "ignored", f"outlines ignores {k!r}")
        if "unevaluatedProperties" in node and addl is None and node["unevaluatedProperties"] is not True:
            self.add("unevaluatedProperties", to_pointer(path + ["unevaluatedProperties"]), "ignored",
                     "outlines ignores unevaluatedProperties; use additionalProperties")
        if node.get("required"):
            self.required_undeclared(node, path)
