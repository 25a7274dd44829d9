"""Measure what each backend does with the regex constructs of `patterns.REGEX_FEATURES`.

Python's ``re`` is the reference: final validation checks JSON Schema patterns with it (through
jsonschema, search semantics) and `Regex` outputs with ``re.fullmatch``. For every construct a
few tiny patterns are compiled, through this library's own rewrites, into real grammars over a
one-character-per-token vocabulary, and strings Python accepts and rejects are fed to the
matcher. In each context a pattern can sit in:

* ``regex``: a `Regex` (the whole output);
* ``pattern``: a string schema's ``pattern``;
* ``propertyNames``: a ``propertyNames`` schema's ``pattern`` (xgrammar only: outlines ignores
  the keyword, which the pre-flight report already says);
* ``patternProperties``: a ``patternProperties`` key (xgrammar only, as above),

a construct is "enforced" (every probe string judged as Python judges it), "ignored" (strings
Python rejects are accepted, none it accepts is refused), "narrowed" (the reverse: outputs stay
valid), "wrong" (both) or "unsupported" (the backend refuses to compile it).

`support.REGEX_SUPPORT` is the table this measures; ``tests/schemas/test_regex_support.py``
measures again and fails when a backend's behaviour changes. ``python -m
constrained_spec.grammar.regex_probe`` prints the measured table.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from constrained_spec.errors import SchemaError
from constrained_spec.schemas import Regex, normalize_schema
from constrained_spec.schemas.support import REGEX_CONTEXTS, RegexSupport

from .compile import compile_spec
from .tokenizer import TokenizerData

__all__ = ["PROBES", "Probe", "measure_regex_support", "probe_tokenizer"]


@dataclass(frozen=True)
class Probe:
    """A pattern, strings Python accepts and strings it rejects (in the contexts listed)."""

    pattern: str
    accept: tuple[str, ...]
    reject: tuple[str, ...]
    # None: every context; "regex" is judged with re.fullmatch, the others with re.search
    contexts: tuple[str, ...] | None = None


_SEARCH = ("pattern", "propertyNames", "patternProperties")

#: feature -> its probes. Anchored with ^ / $ so that full and search matching agree, except
#: where the construct is about anchors (flag-m, inner-anchor), which get one probe per kind.
PROBES: dict[str, tuple[Probe, ...]] = {
    "lookahead": (Probe(r"^(?=ab)[a-z]+$", ("abc", "ab"), ("ba", "xyz")),),
    "negative-lookahead": (
        Probe(r"^(?!ab)[a-z]+$", ("ba", "xyz"), ("abc", "ab")),
        # SchemaStore's Python-identifier property names: keywords excluded by a look-ahead
        Probe(r"^(?!(False|class|def)$)[a-zA-Z_][\w]*$", ("klass", "x_1"), ("class", "def")),
    ),
    "lookbehind": (Probe(r"^[a-z]+(?<=c)$", ("abc",), ("abd",)),),
    "negative-lookbehind": (Probe(r"^[a-z]+(?<!c)$", ("abd",), ("abc",)),),
    "backreference": (Probe(r"^([a-z])x\1$", ("axa",), ("axb",)),
                      Probe(r"^(?P<c>[a-z])(?P=c)$", ("aa",), ("ab",))),
    "conditional": (Probe(r"^(a)?(?(1)b|c)$", ("ab", "c"), ("ac", "b")),),
    "word-boundary": (Probe(r"^a\b[a-z-]?$", ("a", "a-"), ("ab",)),),
    "non-word-boundary": (Probe(r"^a\B[a-z-]?$", ("ab",), ("a-", "a")),),
    "digit": (Probe(r"^\d+$", ("12", "\u0663"), ("a", "1a")),),
    "non-digit": (Probe(r"^\D$", ("a",), ("1", "\u0663")), Probe(r"^[^\d]$", ("a",), ("1", "\u0663"))),
    "word": (Probe(r"^\w+$", ("a_1", "\u00e9"), ("a-b", " ")),),
    "non-word": (Probe(r"^\W$", ("-",), ("a", "\u00e9")), Probe(r"^[^\w]$", ("-",), ("a", "\u00e9"))),
    "space": (Probe(r"^a\sb$", ("a b", "a\tb", "a\u00a0b"), ("ab", "a-b")),),
    "non-space": (Probe(r"^a\Sb$", ("a-b",), ("a b", "a\u00a0b")),),
    "flag-i": (Probe(r"(?i)^ab$", ("ab", "AB", "aB"), ("ac",)),
               Probe(r"^(?i:ab)c$", ("ABc",), ("ABC",))),
    "flag-m": (Probe(r"(?m)a$\nb", ("a\nb",), ("ab", "a\nc"), ("regex",)),
               Probe(r"(?m)^a$", ("a", "b\na", "a\nb"), ("ba", "ab"), _SEARCH)),
    "flag-s": (Probe(r"(?s)^a.b$", ("a\nb", "axb"), ("ab",)),),
    "flag-x": (Probe(r"(?x)^a b  c$", ("abc",), ("a b c",)),),
    "flag-a": (Probe(r"(?a)^\w+$", ("ab",), ("\u00e9",)),),
    "atomic-group": (Probe(r"^(?>a|ab)c$", ("ac",), ("abc",)),),
    "possessive": (Probe(r"^[ab]?+b$", ("ab",), ("b",)),),
    "inner-anchor": (Probe(r"(?:^a|b)c", ("ac", "bc"), ("c", "abc"), ("regex",)),
                     Probe(r"(?:^a|b)c$", ("ac", "bc", "xbc"), ("xac", "c"), _SEARCH),
                     Probe(r"a$b|^c$", ("c",), ("ab", "a", "a$b", "a\nb"))),  # a$b never matches
    "string-anchor": (Probe(r"\Aab\Z", ("ab",), ("abc", "xab", "AabZ")),),
}


def probe_tokenizer() -> TokenizerData:
    """One token per character: printable ASCII, tab, newline and the non-ASCII characters the
    probes use (so a backend's answer never depends on how text splits into tokens)."""
    chars = [chr(i) for i in range(32, 127)] + ["\t", "\n", "\u00e9", "\u0663", "\u00a0"]
    return TokenizerData.from_tokens(["<eos>"] + chars, eos_token_id=0)


def _python_accepts(pattern: str, text: str, context: str) -> bool:
    match = re.fullmatch if context == "regex" else re.search
    return match(pattern, text) is not None


def _spec_and_text(pattern: str, context: str, text: str) -> tuple[Any, str]:
    if context == "regex":
        return normalize_schema(Regex(pattern)), text
    if context == "pattern":
        schema: dict = {"type": "string", "pattern": pattern}
        instance: Any = text
    elif context == "propertyNames":
        schema, instance = {"type": "object", "propertyNames": {"pattern": pattern}}, {text: 0}
    else:
        schema = {"type": "object", "patternProperties": {pattern: {}}, "additionalProperties": False}
        instance = {text: 0}
    spec = normalize_schema(schema)
    return spec, spec.layout.dumps(instance)


def measure(feature: str, backend: str, context: str, tok: TokenizerData) -> RegexSupport:
    """What `backend` does with `feature` in `context` (see the module docstring)."""
    widened = narrowed = False
    for probe in PROBES[feature]:
        if probe.contexts is not None and context not in probe.contexts:
            continue
        for text, want in [(t, True) for t in probe.accept] + [(t, False) for t in probe.reject]:
            if _python_accepts(probe.pattern, text, context) is not want:  # a probe's own mistake
                raise AssertionError(f"probe {probe.pattern!r}: Python {'rejects' if want else 'accepts'} "
                                     f"{text!r} in context {context!r}")
            spec, written = _spec_and_text(probe.pattern, context, text)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    matcher = compile_spec(spec, tok, backend=backend).new_matcher()  # type: ignore[arg-type]
            except SchemaError:
                return "unsupported"
            got = matcher.accepts_text(written)
            widened |= got and not want
            narrowed |= want and not got
    return "wrong" if widened and narrowed else "ignored" if widened else (
        "narrowed" if narrowed else "enforced")


def measure_regex_support(tok: TokenizerData | None = None) -> dict[str, dict[str, dict[str, RegexSupport]]]:
    """feature -> backend -> context -> status, measured now (the shape of
    `support.REGEX_SUPPORT`)."""
    tok = tok or probe_tokenizer()
    return {feature: {backend: {context: measure(feature, backend, context, tok)
                                for context in contexts}
                      for backend, contexts in REGEX_CONTEXTS.items()}
            for feature in PROBES}


def main() -> None:
    table = measure_regex_support()
    columns = [(b, c) for b, contexts in REGEX_CONTEXTS.items() for c in contexts]
    print("| feature | " + " | ".join(f"{b} {c}" for b, c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for feature, row in table.items():
        print(f"| {feature} | " + " | ".join(row[b][c] for b, c in columns) + " |")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
