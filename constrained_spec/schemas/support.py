"""What each backend enforces, keyword by keyword: the knowledge behind the pre-flight report.

Established for xgrammar 0.2.9 (``Grammar.from_json_schema(strict_mode=True,
any_whitespace=False)``) and outlines-core 0.2.14 (``build_regex_from_schema`` + ``Index``) by
reading their converters (xgrammar ``cpp/json_schema_converter.cc``; outlines-core
``src/json_schema/parsing.rs`` and ``types.rs``) and by experiment: each keyword was compiled
into a grammar and a *valid* and an *invalid* instance were fed to the matcher (xgrammar: string
acceptance; outlines: a byte-level vocabulary walked through the Index). "enforced" = the valid
instance is accepted and the invalid one rejected; "ignored" = the invalid one is accepted
(generation could emit it); "unsupported" = the converter raises or the regex cannot be built;
"narrowed" = some valid instances are rejected but nothing invalid is accepted (not reported:
outputs still validate, e.g. property order fixed, patterns matched as whole strings).

The table is the summary; the walkers in ``preflight.py`` apply the context rules spelled out in
the comments (which keyword of a node "wins", format vs pattern vs length, ...).
"""

from __future__ import annotations

from typing import Literal

Support = Literal["enforced", "ignored", "unsupported", "narrowed", "partial"]

# keyword -> {backend: status}. "partial" = enforced in some contexts only; the comment says which.
KEYWORD_SUPPORT: dict[str, dict[str, Support]] = {
    # --- any type -------------------------------------------------------------------------
    "type":        {"xgrammar": "enforced", "outlines": "enforced"},   # incl. type arrays
    "enum":        {"xgrammar": "enforced", "outlines": "enforced"},   # siblings ignored (values checked)
    "const":       {"xgrammar": "enforced", "outlines": "enforced"},   # siblings ignored (value checked)
    # $ref: local "#/..." enforced. xgrammar turns non-"#/" refs into "any" (warning) ->
    # reported unsupported; outlines raises. Siblings of $ref are ignored by both.
    # Recursion: xgrammar native; outlines cuts at depth 3 and drops the property -> ignored.
    "$ref":        {"xgrammar": "enforced", "outlines": "partial"},
    "$dynamicRef": {"xgrammar": "unsupported", "outlines": "unsupported"},
    "$recursiveRef": {"xgrammar": "unsupported", "outlines": "unsupported"},
    # --- combinators ----------------------------------------------------------------------
    # anyOf: enforced; any sibling constraint of anyOf/oneOf/allOf is ignored by both.
    "anyOf":       {"xgrammar": "enforced", "outlines": "enforced"},
    # oneOf: both generate anyOf; exclusivity holds only if the branches are disjoint
    # (xgrammar proves disjointness for type / const / discriminator arms, else warns and
    # falls back). Reported "ignored" unless we can prove the branches disjoint.
    "oneOf":       {"xgrammar": "partial", "outlines": "partial"},
    # allOf: one subschema fine. More: xgrammar generates "any" (ignored); outlines
    # concatenates the regexes (garbage, reported unsupported).
    "allOf":       {"xgrammar": "partial", "outlines": "partial"},
    "not":         {"xgrammar": "ignored", "outlines": "ignored"},
    "if":          {"xgrammar": "ignored", "outlines": "ignored"},     # with then / else
    "dependentRequired": {"xgrammar": "ignored", "outlines": "ignored"},
    "dependentSchemas":  {"xgrammar": "ignored", "outlines": "ignored"},
    "dependencies":      {"xgrammar": "ignored", "outlines": "ignored"},  # draft-07 spelling
    # --- strings ----------------------------------------------------------------------------
    # xgrammar precedence: known format > pattern > min/maxLength (the loser is ignored, with a
    # C++ warning). outlines precedence: min/maxLength > pattern > format.
    "minLength":   {"xgrammar": "partial", "outlines": "enforced"},
    "maxLength":   {"xgrammar": "partial", "outlines": "enforced"},
    # pattern: JSON Schema searches (unanchored); both backends full-match, so the pattern is
    # rewritten to search semantics before conversion (backends.py). xgrammar: look-ahead is
    # silently dropped (ignored); look-behind, backreferences, \b, \p{..}, atomic groups raise.
    # outlines: the Rust regex must build a DFA (no look-around, backreferences, \b); ".",
    # negated classes and \D \W \S \s match raw quotes / backslashes / control characters,
    # producing invalid JSON strings (reported ignored).
    "pattern":     {"xgrammar": "partial", "outlines": "partial"},
    # format: xgrammar enforces email, date, time, date-time, duration, ipv4, ipv6, hostname,
    # uuid, uri, uri-reference, uri-template, json-pointer, relative-json-pointer; any other
    # format is ignored. outlines knows date-time, date, time, uuid, uri, email and raises on
    # others; its date-time / time accept values without a UTC offset (not RFC 3339) and its
    # time fraction branch can emit a backslash escape -> reported ignored. Calendar validity
    # (Feb 31) is checked by neither (syntax only).
    "format":      {"xgrammar": "partial", "outlines": "partial"},
    "contentEncoding":  {"xgrammar": "ignored", "outlines": "ignored"},
    "contentMediaType": {"xgrammar": "ignored", "outlines": "ignored"},
    "contentSchema":    {"xgrammar": "ignored", "outlines": "ignored"},
    # --- numbers ----------------------------------------------------------------------------
    # xgrammar: integer bounds exact (non-integral bounds are rounded inward before conversion);
    # number bounds enforced, narrowed to <= 6 decimals and no exponent. outlines: ignored.
    "minimum":          {"xgrammar": "enforced", "outlines": "ignored"},
    "maximum":          {"xgrammar": "enforced", "outlines": "ignored"},
    "exclusiveMinimum": {"xgrammar": "enforced", "outlines": "ignored"},
    "exclusiveMaximum": {"xgrammar": "enforced", "outlines": "ignored"},
    # xgrammar: integer multipleOf that is a whole number <= 1024 and either no bounds or both
    # bounds spanning <= 10000 values; else ignored (warning). number multipleOf ignored.
    "multipleOf":       {"xgrammar": "partial", "outlines": "ignored"},
    # --- arrays -----------------------------------------------------------------------------
    "items":            {"xgrammar": "enforced", "outlines": "enforced"},
    # prefixItems: outlines generates exactly the tuple (narrowed; items / minItems dropped).
    "prefixItems":      {"xgrammar": "enforced", "outlines": "narrowed"},
    "minItems":         {"xgrammar": "enforced", "outlines": "enforced"},
    "maxItems":         {"xgrammar": "enforced", "outlines": "enforced"},
    "unevaluatedItems": {"xgrammar": "enforced", "outlines": "ignored"},
    "uniqueItems":      {"xgrammar": "ignored", "outlines": "ignored"},
    "contains":         {"xgrammar": "ignored", "outlines": "ignored"},
    "minContains":      {"xgrammar": "ignored", "outlines": "ignored"},
    "maxContains":      {"xgrammar": "ignored", "outlines": "ignored"},
    # --- objects ----------------------------------------------------------------------------
    # properties: generated in declared order (narrowed); strict mode (the library's default)
    # generates only declared keys where additionalProperties is absent, although JSON Schema
    # allows any others (narrowed: an LM asked for an object gets the fields the schema names;
    # write "additionalProperties": {} to allow more). Not reported per object: it is the
    # library's documented reading of every object schema. An object that declares nothing
    # (no properties / patternProperties / additionalProperties) allows any keys.
    "properties":       {"xgrammar": "enforced", "outlines": "enforced"},
    # required: xgrammar: a required name that is not a declared property is declared by the
    # rewrite with the schema that applies to it (backends.declarable_required), unless
    # additionalProperties: false forbids it or several key patterns match it (then never
    # generated: ignored). outlines: never generated (ignored); required without properties
    # is ignored too.
    "required":         {"xgrammar": "partial", "outlines": "partial"},
    # additionalProperties: false narrows. xgrammar: next to properties and patternProperties /
    # propertyNames it writes the extra keys as any string, so a declared name or a pattern key
    # can come through them (backends.extra_bypass): dropped when it admits anything (narrowed:
    # no extra keys), reported at each key otherwise (partial; the same for
    # unevaluatedProperties). outlines: a schema is enforced only without properties;
    # additionalProperties: false without properties raises (rewritten to maxProperties: 0
    # before conversion).
    "additionalProperties":  {"xgrammar": "partial", "outlines": "partial"},
    "unevaluatedProperties": {"xgrammar": "partial", "outlines": "narrowed"},
    # patternProperties: xgrammar matches key patterns as whole strings; they are rewritten to
    # JSON Schema's search semantics first (backends.py), as `pattern` is (a key pattern with an
    # inner anchor has no such rewrite: reported by its regex feature); a name two keys with
    # different schemas both match gets either one's value (reported unless the patterns are
    # disjoint, regex_overlap.py); outlines ignores them.
    "patternProperties": {"xgrammar": "enforced", "outlines": "ignored"},
    "propertyNames":     {"xgrammar": "enforced", "outlines": "ignored"},
    # outlines: without properties only "at least one" (minProperties >= 1) and "none"
    # (maxProperties 0) are enforced; with properties both are ignored.
    "minProperties":     {"xgrammar": "enforced", "outlines": "partial"},
    "maxProperties":     {"xgrammar": "enforced", "outlines": "partial"},
}

# Keywords that never restrict instances: neither reported nor looked at.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "$defs",
    "definitions", "discriminator", "nullable", "example", "x-order",
})
# ``then`` / ``else`` only act through ``if`` (reported there).
PASSIVE = frozenset({"then", "else"})

XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
OUTLINES_FORMATS = frozenset({"date-time", "date", "time", "uuid", "uri", "email"})
# Formats outlines accepts with values a format checker rejects.
OUTLINES_LOOSE_FORMATS = {
    "date-time": "accepts date-times without a UTC offset (not RFC 3339)",
    "time": "accepts times without a UTC offset and its fraction branch can emit a backslash",
}

XGRAMMAR_INT_MULTIPLE_OF_MAX = 1024
XGRAMMAR_INT_MULTIPLE_OF_RANGE_MAX = 10000

STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format", "contentEncoding",
                             "contentMediaType", "contentSchema"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "multipleOf"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems",
                            "uniqueItems", "contains", "minContains", "maxContains"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties",
                             "unevaluatedProperties", "patternProperties", "propertyNames",
                             "minProperties", "maxProperties", "dependentRequired",
                             "dependentSchemas", "dependencies"})
TYPE_KEYWORDS = {
    "string": STRING_KEYWORDS, "number": NUMBER_KEYWORDS, "integer": NUMBER_KEYWORDS,
    "array": ARRAY_KEYWORDS, "object": OBJECT_KEYWORDS, "boolean": frozenset(),
    "null": frozenset(),
}

# Backend defects found while establishing the table (they narrow, never widen, what is
# generated; final validation is unaffected). Worked around where noted.
#
# outlines-core 0.2.14
# * Index construction drops a token whose bytes lead from a state where the regex already
#   fully matches into a state where it does not (``a(bc)?`` over tokens a/b/c/bc: after "a"
#   only "bc" and eos are allowed, never "b"). Whole-JSON regexes only fully match after their
#   last byte, so JSON objects / arrays / strings are unaffected; top-level numbers ("1" then
#   ".") and optional regex tails are.
# * The DFA is leftmost-first: in ``(a|ab)`` the text "ab" never completes. Choices and enum
#   values are ordered longest first before conversion; user regexes are passed as written.
# * ``^`` / ``$`` in a regex given to the Index fail ("anchored universal start state doesn't
#   exist"); edge anchors are stripped (no-ops under full matching).
# * ``.`` does not match a newline, string values admit no ``\uXXXX`` escapes and no
#   U+007F-U+009F characters.
#
# xgrammar 0.2.9
# * Strings with minLength / maxLength cannot contain escapes (``\"``, ``\\``, ``\n``) and can
#   contain raw control characters other than CR / LF, which is not JSON (worked around:
#   `backends.length_string_escapes` rewrites the character rule; left out: ``\uD800``-
#   ``\uDFFF`` escapes, a surrogate pair counts one code point, so such characters are
#   written as themselves).
# * A node without ``type`` whose keywords are object (array) keywords is generated as an
#   object (array); JSON Schema also allows every other value there (reported "narrowed").
# * Patterns are matched against the decoded string: ``.`` matches any character including a
#   newline, but no escaped character.
# * With strict_mode, an array / object that declares no items / properties but has another
#   keyword admits only ``[]`` / ``{}`` (worked around: ``items: {}`` / ``additionalProperties:
#   {}`` are added before conversion).
# * C++ warnings about dropped keywords go to stderr; the pre-flight report is the structured
#   form of the same information.
# * A group's ``?`` inside a JSON string pattern (or a patternProperties key) is mis-compiled:
#   ``x(-[a-z]+)?`` accepts "xa", ``(-[a-z]+)?`` any word. ``{0,1}`` is right (worked around:
#   backends.xgrammar_pattern). ``Grammar.from_regex`` is not affected.
# * Object / array const and enum values are written compactly whatever the separators / indent
#   (worked around: spelled out as schemas). Scalar const numbers are re-printed (1.0 -> 1;
#   integers past 64 bits lose digits: 12345678901234567890 -> 1.2345678901234567e+19, which
#   final validation then rejects; denormals too: 5e-324 -> 4.94065645841247e-324).
# * format date / date-time check the syntax only (Feb 30, year 0000; worked around: a
#   calendar-exact pattern). Integer bounds past 64 bits and draft 4's boolean
#   exclusiveMinimum / exclusiveMaximum raise (worked around: clamped / converted).


# --------------------------------------------------------------------------------------------
# regex constructs (patterns.REGEX_FEATURES), measured by constrained_spec/grammar/regex_probe.py
# --------------------------------------------------------------------------------------------

#: "enforced": judged as Python's re judges it; "ignored": strings Python rejects get through;
#: "narrowed": strings Python accepts are refused (outputs stay valid); "wrong": both;
#: "unsupported": the backend refuses to compile it.
RegexSupport = Literal["enforced", "ignored", "narrowed", "wrong", "unsupported"]

#: Where a pattern sits, per backend (outlines ignores propertyNames and patternProperties).
REGEX_CONTEXTS: dict[str, tuple[str, ...]] = {
    "xgrammar": ("regex", "pattern", "propertyNames", "patternProperties"),
    "outlines": ("regex", "pattern"),
}

# Measured with xgrammar 0.2.9 and outlines-core 0.2.14 through this library's rewrites
# (constrained_spec/grammar/regex_probe.py; tests/schemas/test_regex_support.py measures again). Python's re is
# the reference. Notes: xgrammar's \d / \w are ASCII (so \D / \W let Unicode digits / letters
# through); its "narrowed" \s and (?s) in JSON strings come from its string patterns never
# matching an escaped character (\t, \n); inline flags other than s (applied by the rewrite)
# do not parse in xgrammar; its possessive quantifiers and inner / \A \Z anchors compile to
# something else. Python's re cannot compile \p{..}: normalize_schema refuses such a pattern.
_REGEX_TABLE = """
#                     |------------------ xgrammar ------------------| |------ outlines -------|
# feature           regex       pattern     propNames   patProps    regex       pattern
lookahead           unsupported ignored     ignored     ignored     unsupported unsupported
negative-lookahead  unsupported ignored     ignored     ignored     unsupported unsupported
lookbehind          unsupported unsupported unsupported unsupported unsupported unsupported
negative-lookbehind unsupported unsupported unsupported unsupported unsupported unsupported
backreference       unsupported unsupported unsupported unsupported unsupported unsupported
conditional         unsupported unsupported unsupported unsupported unsupported unsupported
word-boundary       unsupported unsupported unsupported unsupported unsupported unsupported
non-word-boundary   unsupported unsupported unsupported unsupported unsupported unsupported
digit               narrowed    narrowed    narrowed    narrowed    enforced    enforced
non-digit           ignored     ignored     ignored     ignored     enforced    enforced
word                narrowed    narrowed    narrowed    narrowed    enforced    enforced
non-word            ignored     ignored     ignored     ignored     enforced    enforced
space               enforced    narrowed    narrowed    narrowed    enforced    narrowed
non-space           enforced    enforced    enforced    enforced    enforced    enforced
flag-i              unsupported unsupported unsupported unsupported enforced    enforced
flag-m              unsupported unsupported unsupported unsupported enforced    narrowed
flag-s              enforced    narrowed    narrowed    narrowed    enforced    enforced
flag-x              unsupported unsupported unsupported unsupported enforced    enforced
flag-a              unsupported unsupported unsupported unsupported unsupported unsupported
atomic-group        unsupported unsupported unsupported unsupported unsupported unsupported
possessive          unsupported ignored     ignored     ignored     ignored     ignored
inner-anchor        ignored     wrong       wrong       wrong       unsupported unsupported
string-anchor       wrong       wrong       wrong       wrong       unsupported unsupported
"""
_COLUMNS = [(b, c) for b, contexts in REGEX_CONTEXTS.items() for c in contexts]


def _parse_regex_table(text: str) -> dict[str, dict[str, dict[str, RegexSupport]]]:
    table: dict[str, dict[str, dict[str, RegexSupport]]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            feature, *cells = line.split()
            row: dict[str, dict[str, RegexSupport]] = {b: {} for b in REGEX_CONTEXTS}
            for (backend, context), cell in zip(_COLUMNS, cells, strict=True):
                row[backend][context] = cell  # type: ignore[assignment]
            table[feature] = row
    return table


#: feature (patterns.REGEX_FEATURES) -> backend -> context -> RegexSupport
REGEX_SUPPORT = _parse_regex_table(_REGEX_TABLE)
