"""Regex surgery shared by the backends, the pre-flight report and the grammar compiler.

A leaf module (it imports nothing from the package): `scan_regex` splits a pattern into just
enough structure to find top-level alternatives, anchors, dots, groups and escapes; the rewrites
built on it give a backend Python's meaning of a pattern (`python_dots`, `python_regex`),
JSON Schema's search semantics as a whole-string match (`search_pattern`), xgrammar's spelling
of optional groups (`xgrammar_pattern`) and outlines' anchor-free form (`strip_edge_anchors`).
`regex_escape` writes a literal every targeted dialect reads the same way. `regex_features`
names the constructs whose meaning differs between Python's ``re`` (the reference: final
validation uses it) and the backends; `support.REGEX_SUPPORT` says what each backend does with
them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ANY_CHAR", "LINE_CHAR", "REGEX_FEATURES", "python_dots", "python_regex",
           "regex_escape", "regex_features", "scan_regex", "search_pattern", "strip_edge_anchors",
           "top_level_alternatives", "xgrammar_pattern"]

# single-character tokens of the scanner (anything else is a literal "char")
_SINGLE = {")": "close", "|": "alt", "^": "bol", "$": "eol", ".": "dot"}


def scan_regex(pattern: str) -> list[tuple[str, str]]:
    """Split a regex into (kind, text) pieces: esc, class, dot, open, flags, close, alt, bol, eol,
    char.

    Just enough structure to find top-level alternatives, anchors and dots; not a full parser.
    """
    out: list[tuple[str, str]] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            j = min(i + 2, n)
            if j <= n and pattern[i + 1:i + 2] in ("p", "P", "x", "u", "k") and j < n and pattern[j] in "{<":
                close = pattern.find("}" if pattern[j] == "{" else ">", j)
                j = n if close < 0 else close + 1
            out.append(("esc", pattern[i:j]))
            i = j
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(("class", pattern[i:j + 1]))
            i = j + 1
        elif c == "(":
            j = i + 1
            if pattern[j:j + 1] == "?":  # (?:  (?=  (?P<name>  (?i) ...
                k = j + 1
                while k < n and pattern[k] not in ":)=!<>" and not pattern[k].isalpha():
                    k += 1
                if pattern[k:k + 2] in ("<=", "<!"):
                    k += 2
                elif pattern[k:k + 2] == "P<" or pattern[k:k + 1] == "<":
                    close = pattern.find(">", k)
                    k = n if close < 0 else close + 1
                else:
                    while k < n and (pattern[k].isalpha() or pattern[k] == "-"):
                        k += 1
                    if k < n and pattern[k] == ")":  # inline flags such as (?i)
                        out.append(("flags", pattern[i:k + 1]))
                        i = k + 1
                        continue
                    if k < n and pattern[k] in ":=!>":
                        k += 1
                j = k
            out.append(("open", pattern[i:j]))
            i = j
        else:  # one character: a metacharacter's kind, else a literal
            out.append((_SINGLE.get(c, "char"), c))
            i += 1
    return out


def top_level_alternatives(pieces: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    alts: list[list[tuple[str, str]]] = [[]]
    depth = 0
    for kind, text in pieces:
        if kind == "open":
            depth += 1
        elif kind == "close":
            depth -= 1
        if kind == "alt" and depth == 0:
            alts.append([])
        else:
            alts[-1].append((kind, text))
    return alts


#: What Python's ``.`` matches, spelled out for a backend (whose own ``.`` may differ: xgrammar's
#: matches a newline, Rust's regex, under outlines-core, does not): without the DOTALL flag
#: any character but a newline, with it (``(?s)``) any character.
LINE_CHAR = r"[^\n]"
ANY_CHAR = r"[\s\S]"
_FLAG_GROUP = re.compile(r"\(\?([aiLmsux]*)(?:-([aiLmsux]*))?([:)])")


def _without_dotall(text: str) -> str:
    """A flag group (``(?si)``, ``(?s-i:``) without the ``s`` flag; ``""`` for a bare ``(?s)``."""
    m = _FLAG_GROUP.fullmatch(text)
    if m is None:
        return text
    on, off, end = m.group(1).replace("s", ""), (m.group(2) or "").replace("s", ""), m.group(3)
    if end == ")" and not on and not off:
        return ""
    return "(?" + on + (f"-{off}" if off else "") + end


def python_dots(pieces: list[tuple[str, str]], *, dot: str = LINE_CHAR,
                dot_all: str = ANY_CHAR) -> list[tuple[str, str]]:
    """`scan_regex` pieces with every ``.`` outside a character class replaced by what Python's
    ``re`` matches there: `dot` (no newline) or, where the DOTALL flag is on, `dot_all`.

    The ``s`` flag is taken out of inline flag groups: global (``(?s)``, ``(?si)``) and scoped
    (``(?s:...)`` turns it on inside, ``(?-s:...)`` off), so the backend never sees it (xgrammar
    cannot parse flag groups). Escaped dots and dots in classes are literal and left alone; a
    class's leading ``]`` (literal in Python) is escaped, as xgrammar would end the class there.
    """
    def flags(text: str) -> tuple[str, str]:
        m = _FLAG_GROUP.fullmatch(text)
        return (m.group(1), m.group(2) or "") if m else ("", "")

    dotall = any(kind == "flags" and "s" in flags(text)[0] for kind, text in pieces)
    stack: list[bool] = []
    out: list[tuple[str, str]] = []
    for kind, text in pieces:
        if kind == "flags":  # global flags: Python allows them only at the start
            text = _without_dotall(text)
            if text:
                out.append((kind, text))
            continue
        if kind == "open":
            stack.append(dotall)
            on, off = flags(text)
            if "s" in on or "s" in off:
                dotall = "s" in on
                text = _without_dotall(text)
        elif kind == "close" and stack:
            dotall = stack.pop()
        elif kind == "dot":
            text = dot_all if dotall else dot
        elif kind == "class" and text.startswith(("[]", "[^]")):
            # Python reads a "]" first in a class as a literal; xgrammar ends the class there
            text = text.replace("]", "\\]", 1)
        out.append((kind, text))
    return out


def python_regex(pattern: str) -> str:
    """A whole-output `Regex` pattern with Python's ``.`` semantics spelled out (`python_dots`):
    what a backend is given, so it matches the strings ``re.fullmatch(pattern, s)`` matches."""
    return "".join(text for _, text in python_dots(scan_regex(pattern)))


def search_pattern(pattern: str, *, any_text: str, dot: str = LINE_CHAR,
                   dot_all: str = ANY_CHAR) -> str | None:
    """`pattern` (JSON Schema: search anywhere) as an equivalent whole-string regex.

    `any_text` is the regex for "any string content" put on unanchored sides; `dot` / `dot_all`
    replace ``.`` outside character classes (`python_dots`: jsonschema checks patterns with
    Python's ``re``). None if an anchor sits anywhere but at the start / end of a top-level
    alternative (then no such rewrite exists).
    """
    pieces = python_dots(scan_regex(pattern), dot=dot, dot_all=dot_all)
    leading_flags = ""
    if pieces and pieces[0][0] == "flags":
        leading_flags = pieces.pop(0)[1]  # a global flag group such as (?i) stays in front
    out = []
    for alt in top_level_alternatives(pieces):
        start = bool(alt) and alt[0][0] == "bol"
        body = alt[1:] if start else alt
        end = bool(body) and body[-1][0] == "eol"
        body = body[:-1] if end else body
        if _inner_anchor(body):
            return None
        core = "".join(text for _, text in body)
        out.append(("" if start else any_text) + (f"(?:{core})" if core else "") + ("" if end else any_text))
    joined = out[0] if len(out) == 1 else "(?:" + "|".join(f"(?:{a})" for a in out) + ")"
    return leading_flags + joined


def xgrammar_pattern(pattern: str) -> str:
    """`pattern` with every group's ``?`` quantifier written ``{0,1}`` and raw control characters
    written as escapes.

    xgrammar 0.2.9 mis-compiles an optional group inside a JSON string pattern: ``x(-[a-z]+)?``
    accepts "xa" (the group's first character is skipped) and ``(-[a-z]+)?`` accepts any word;
    ``{0,1}`` is compiled correctly (``Grammar.from_regex`` is not affected). Its regex lexer
    refuses a raw newline in a character class (SchemaStore's github-workflows writes
    ``(.|[<CR><LF>])*`` with real CR / LF characters in the JSON string); ``\\n`` means the same.
    """
    pieces = scan_regex(pattern)
    out = []
    for i, (kind, text) in enumerate(pieces):
        if kind == "char" and text == "?" and i and pieces[i - 1][0] == "close":
            out.append("{0,1}")
        else:
            out.append(text)
    return _escape_controls("".join(out))


def _escape_controls(pattern: str) -> str:
    r"""Raw control characters of a regex written as escapes (one after a backslash loses the
    backslash: ``\`` + LF is the same literal LF as ``\n``)."""
    if not any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in pattern):
        return pattern
    names = {"\n": r"\n", "\t": r"\t", "\r": r"\r"}
    out: list[str] = []
    escaped = False
    for ch in pattern:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            if escaped:
                out.pop()  # the backslash before it
            out.append(names.get(ch, f"\\x{ord(ch):02x}"))
            escaped = False
            continue
        out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


# Characters every regex dialect we target (Python re, xgrammar, Rust regex) reads as syntax.
_REGEX_META = set("\\.+*?()|[]{}^$-&~#")


def regex_escape(text: str) -> str:
    """Escape `text` as a literal for Python `re`, xgrammar and Rust `regex` alike.

    (`re.escape` also escapes spaces, which Rust's regex rejects outside verbose mode.)
    """
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def strip_edge_anchors(pattern: str) -> str:
    """A whole-string regex without the ``^`` / ``$`` at the edges of its top-level
    alternatives (no-ops under full matching, but outlines-core's DFA cannot start on ``^``)."""
    pieces = scan_regex(pattern)
    flags = pieces.pop(0)[1] if pieces and pieces[0][0] == "flags" else ""
    alts = []
    for alt in top_level_alternatives(pieces):
        if alt and alt[0][0] == "bol":
            alt = alt[1:]
        if alt and alt[-1][0] == "eol":
            alt = alt[:-1]
        alts.append("".join(text for _, text in alt))
    return flags + (alts[0] if len(alts) == 1 else "|".join(alts))


# --------------------------------------------------------------------------------------------
# constructs whose support differs between Python's re and the backends
# --------------------------------------------------------------------------------------------

#: feature -> how a report names it. Keys of `support.REGEX_SUPPORT`.
REGEX_FEATURES: dict[str, str] = {
    "lookahead": "look-ahead",
    "negative-lookahead": "negative look-ahead",
    "lookbehind": "look-behind",
    "negative-lookbehind": "negative look-behind",
    "backreference": "backreference",
    "conditional": "conditional group",
    "word-boundary": "word boundary",
    "non-word-boundary": "non-word boundary",
    "digit": "digit class (in Python any Unicode decimal digit, e.g. '\u0663')",
    "non-digit": "non-digit class (in Python it excludes every Unicode digit)",
    "word": "word class (in Python any Unicode letter or digit, e.g. '\u00e9')",
    "non-word": "non-word class (in Python it excludes every Unicode letter and digit)",
    "space": "space class (in Python any Unicode space, e.g. U+00A0)",
    "non-space": "non-space class (in Python it excludes every Unicode space)",
    "flag-i": "case-insensitive flag",
    "flag-m": "multi-line flag",
    "flag-s": "dot-all flag",
    "flag-x": "verbose flag",
    "flag-a": "ASCII flag",
    "atomic-group": "atomic group",
    "possessive": "possessive quantifier",
    "inner-anchor": "anchor inside the pattern (not at the start / end of an alternative)",
    "string-anchor": "\\A / \\Z anchor",
}
_LOOKAROUND = {"(?=": "lookahead", "(?!": "negative-lookahead", "(?<=": "lookbehind",
               "(?<!": "negative-lookbehind"}
_CLASS_ESCAPES = {"d": "digit", "D": "non-digit", "w": "word", "W": "non-word", "s": "space",
                  "S": "non-space"}
_NEGATED = {"digit": "non-digit", "non-digit": "digit", "word": "non-word", "non-word": "word",
            "space": "non-space", "non-space": "space"}
_QUANTIFIER_BRACES = re.compile(r"\{[0-9]*(?:,[0-9]*)?\}")


def _inner_anchor(pieces: list[tuple[str, str]]) -> bool:
    """A ``^`` / ``$`` among `pieces` (an alternative without its edge anchors), not counting
    those inside a look-around: an assertion is dropped or refused whole, and reported as such."""
    stack: list[bool] = []
    for kind, text in pieces:
        if kind == "open":
            stack.append(text in _LOOKAROUND or (bool(stack) and stack[-1]))
        elif kind == "close" and stack:
            stack.pop()
        elif kind in ("bol", "eol") and not (stack and stack[-1]):
            return True
    return False


def _flag_letters(kind: str, text: str) -> str:
    if kind not in ("flags", "open"):
        return ""
    m = _FLAG_GROUP.fullmatch(text)
    return (m.group(1) + (m.group(2) or "")) if m else ""


def regex_features(pattern: str) -> dict[str, str]:
    """The `REGEX_FEATURES` used in `pattern`: feature -> the text that uses it, first occurrence.

    Anchors count as inner when no whole-string rewrite exists (`search_pattern` returns None);
    under the ASCII flag ``(?a)`` the class escapes mean what every backend means by them and
    are not listed.
    """
    pieces = scan_regex(pattern)
    found: dict[str, str] = {}

    def add(feature: str, text: str) -> None:
        found.setdefault(feature, text)

    for i, (kind, text) in enumerate(pieces):
        if kind == "open":
            if text in _LOOKAROUND:
                add(_LOOKAROUND[text], _group_text(pieces, i))
            elif text == "(?>":
                add("atomic-group", _group_text(pieces, i))
            elif text == "(?P=":
                add("backreference", _group_text(pieces, i))
        elif kind == "flags" and text.startswith("(?("):
            add("conditional", text)
        elif kind == "esc":
            if text[1:2].isdigit() and text[1:2] != "0":
                add("backreference", text)
            elif text == "\\b":
                add("word-boundary", text)
            elif text == "\\B":
                add("non-word-boundary", text)
            elif text in ("\\A", "\\Z"):
                add("string-anchor", text)
            elif text[1:2] in _CLASS_ESCAPES:
                add(_CLASS_ESCAPES[text[1:2]], text)
        elif kind == "class":
            negated = text.startswith("[^")
            for esc in re.findall(r"\\(.)", text):
                if esc in _CLASS_ESCAPES:
                    feature = _CLASS_ESCAPES[esc]
                    add(_NEGATED[feature] if negated else feature, text)
        elif kind == "char" and text == "+" and i and _is_quantifier(pieces, i - 1):
            add("possessive", pieces[i - 1][1] + "+")
        for letter in _flag_letters(kind, text):
            if letter in "imsxa":
                add(f"flag-{letter}", text)
    if "flag-a" in found:
        for feature in _NEGATED:
            found.pop(feature, None)
    if search_pattern(pattern, any_text="") is None:
        add("inner-anchor", next((t for k, t in pieces if k in ("bol", "eol")), ""))
    return found


def _group_text(pieces: list[tuple[str, str]], start: int, limit: int = 48) -> str:
    """The group opened at pieces[start], as written (shortened past `limit` characters)."""
    depth, out = 0, []
    for kind, text in pieces[start:]:
        out.append(text)
        depth += kind == "open"
        depth -= kind == "close"
        if depth == 0:
            break
    text = "".join(out)
    return text if len(text) <= limit else text[:limit - 4] + "...)"


def _is_quantifier(pieces: list[tuple[str, str]], i: int) -> bool:
    """Is pieces[i] the end of a quantifier (``*``, ``+``, ``?``, ``{m,n}``)?"""
    kind, text = pieces[i]
    if kind != "char":
        return False
    if text in "*+?":
        # "a++": the first "+" quantifies; in "a+++" the third follows a possessive "++"
        return i > 0 and not (pieces[i - 1][0] == "char" and pieces[i - 1][1] in "*+?"
                              and _is_quantifier(pieces, i - 1))
    if text == "}":
        j = i
        while j > 0 and pieces[j][0] == "char" and pieces[j][1] != "{":
            j -= 1
        return _QUANTIFIER_BRACES.fullmatch("".join(t for _, t in pieces[j:i + 1])) is not None
    return False


# What a JSON string can only hold escaped: the quote, the backslash, control characters.
_ESCAPED_ONLY = frozenset(['"', "\\"] + [chr(c) for c in range(0x20)])


def pattern_admits_escaped(pattern: str) -> bool:
    """Whether a string `pattern` matches can hold a character JSON writes only as an escape
    (``"``, ``\\``, a control character): some character the pattern can write is one of them.
    xgrammar's JSON-string patterns never write an escape, so such values are not generated.
    Conservative: look-around contents are not counted, a pattern Python cannot parse is."""
    try:
        from re import _parser as sre_parse  # type: ignore[attr-defined]
    except ImportError:  # Python 3.10
        import sre_parse
    try:
        tree = sre_parse.parse(pattern)
    except Exception:
        return True
    codes = {ord(c) for c in _ESCAPED_ONLY}
    in_class = {"CATEGORY_SPACE": {9, 10, 11, 12, 13}, "CATEGORY_NOT_SPACE": codes - {9, 10, 11, 12, 13},
                "CATEGORY_DIGIT": set(), "CATEGORY_NOT_DIGIT": codes, "CATEGORY_WORD": set(),
                "CATEGORY_NOT_WORD": codes}

    def class_admits(items: list) -> bool:
        hit: set[int] = set()
        negate = False
        for op, arg in items:
            name = str(op)
            if name == "NEGATE":
                negate = True
            elif name == "LITERAL":
                hit |= {arg} & codes
            elif name == "RANGE":
                hit |= {c for c in codes if arg[0] <= c <= arg[1]}
            elif name == "CATEGORY":
                hit |= in_class.get(str(arg), codes)
        return bool(codes - hit) if negate else bool(hit)

    def admits(seq: Any) -> bool:
        for op, arg in seq:
            name = str(op)
            if name == "LITERAL" and arg in codes:
                return True
            if name in ("NOT_LITERAL", "ANY"):
                return True
            if name == "IN" and class_admits(arg):
                return True
            if name == "BRANCH" and any(admits(b) for b in arg[1]):
                return True
            if name == "SUBPATTERN" and admits(arg[-1]):
                return True
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and arg[1] > 0 \
                    and admits(arg[2]):
                return True
            if name == "ATOMIC_GROUP" and admits(arg):
                return True
        return False

    return admits(tree)
