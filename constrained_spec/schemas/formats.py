"""Format checks jsonschema only does with optional packages, so final validation always does them.

jsonschema checks ``date-time``, ``time``, ``uri``, ``uri-reference``, ``iri``,
``iri-reference``, ``hostname``, ``duration``, ``json-pointer``, ``relative-json-pointer`` and
``uri-template`` only when ``rfc3339-validator``, ``rfc3987``, ``fqdn``, ``isoduration``,
``jsonpointer``, ``uri-template`` are installed; without them any string passes, and an output
with ``"createdAt": "Invalid Date"`` would be returned as valid wherever the grammar backend does
not enforce the format. The checks here are the RFCs' grammars as regular expressions (plus the
calendar for dates), written to reject only what the RFC rejects; a format the installed
jsonschema already checks keeps jsonschema's check.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Callable

__all__ = ["FORMAT_CHECKS", "format_checker"]

_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_TIME = r"(\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(?:[Zz]|([+-])(\d{2}):(\d{2}))"
_DATE_TIME_RE = re.compile(rf"{_DATE}[Tt]{_TIME}", re.ASCII)
_TIME_RE = re.compile(_TIME, re.ASCII)


def _valid_time(h: str, m: str, s: str, oh: str | None, om: str | None) -> bool:
    # second 60 is a leap second (RFC 3339 5.7); offsets are hh:mm within a day
    return (int(h) < 24 and int(m) < 60 and int(s) <= 60
            and (oh is None or (int(oh) < 24 and int(om or 0) < 60)))


def is_date_time(value: str) -> bool:
    m = _DATE_TIME_RE.fullmatch(value)
    if not m:
        return False
    y, mo, d, h, mi, s, _, oh, om = m.groups()
    try:
        datetime.date(int(y), int(mo), int(d))
    except ValueError:
        return False
    return _valid_time(h, mi, s, oh, om)


def is_time(value: str) -> bool:
    m = _TIME_RE.fullmatch(value)
    return m is not None and _valid_time(m.group(1), m.group(2), m.group(3), m.group(5), m.group(6))


# RFC 3986 (URI) / RFC 3987 (IRI): characters, percent-escapes and the scheme; an IRI may
# also hold any non-ASCII character that is not a control or space character.
_URI_CHARS = r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2}"
_IRI_CHARS = _URI_CHARS + r"|[^\x00-\x7f\s\u0080-\u009f]"
_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*:"
_URI_RE = re.compile(rf"{_SCHEME}(?:{_URI_CHARS})*")
_URI_REF_RE = re.compile(rf"(?:{_URI_CHARS})*")
_IRI_RE = re.compile(rf"{_SCHEME}(?:{_IRI_CHARS})*")
_IRI_REF_RE = re.compile(rf"(?:{_IRI_CHARS})*")


def _uri_like(pattern: re.Pattern) -> Callable[[str], bool]:
    def check(value: str) -> bool:
        # "#" at most once (the fragment) and no "[" / "]" outside an IP-literal host
        if not pattern.fullmatch(value) or value.count("#") > 1:
            return False
        rest = value.split("#", 1)[0]
        return not re.search(r"[\[\]]", re.sub(r"^[A-Za-z][A-Za-z0-9+.\-]*://\[[0-9A-Fa-f:.vV]+\]", "", rest))
    return check


_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)


def is_hostname(value: str) -> bool:
    return len(value.rstrip(".")) <= 253 and bool(_HOSTNAME_RE.fullmatch(value))


# RFC 3339 appendix A (ISO 8601 durations)
_DURATION_RE = re.compile(
    r"P(?:(?:\d+Y(?:\d+M(?:\d+D)?)?|\d+M(?:\d+D)?|\d+D)(?:T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S))?"
    r"|T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)|\d+W)", re.ASCII)
_JSON_POINTER_RE = re.compile(r"(?:/(?:[^~/]|~[01])*)*")
_REL_JSON_POINTER_RE = re.compile(r"(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^~/]|~[01])*)*)", re.ASCII)
# RFC 6570: literals (no space, quote, <, >, \, ^, `, {, |, }) and {expressions}
_URI_TEMPLATE_RE = re.compile(
    r"(?:[^\x00-\x20\"'<>\\^`{|}]|\{[+#./;?&=,!@|]?"
    r"(?:[A-Za-z0-9_.]|%[0-9A-Fa-f]{2})+(?::[1-9][0-9]{0,3}|\*)?"
    r"(?:,(?:[A-Za-z0-9_.]|%[0-9A-Fa-f]{2})+(?::[1-9][0-9]{0,3}|\*)?)*\})*")

FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "date-time": is_date_time,
    "time": is_time,
    "uri": _uri_like(_URI_RE),
    "uri-reference": _uri_like(_URI_REF_RE),
    "iri": _uri_like(_IRI_RE),
    "iri-reference": _uri_like(_IRI_REF_RE),
    "hostname": is_hostname,
    "duration": lambda v: bool(_DURATION_RE.fullmatch(v)),
    "json-pointer": lambda v: bool(_JSON_POINTER_RE.fullmatch(v)),
    "relative-json-pointer": lambda v: bool(_REL_JSON_POINTER_RE.fullmatch(v)),
    "uri-template": lambda v: bool(_URI_TEMPLATE_RE.fullmatch(v)),
}


def format_checker(validator_cls: Any) -> Any:
    """`validator_cls.FORMAT_CHECKER` plus `FORMAT_CHECKS` for the formats it lacks, whatever
    the draft (the library asserts formats; non-strings pass, as in jsonschema's own checks)."""
    import jsonschema

    base = validator_cls.FORMAT_CHECKER
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    for name, check in FORMAT_CHECKS.items():
        if name not in checker.checkers:
            checker.checks(name)(lambda value, _check=check: not isinstance(value, str) or _check(value))
    return checker
