"""constrained_spec.schemas: every schema input becomes one `SchemaSpec`.

* `normalize_schema`: Pydantic model, JSON Schema (dict / text), `Regex`, choices (list /
  Literal / Enum), `Grammar` (EBNF) or a TypeAdapter-able type -> `SchemaSpec`.
* `preflight` / `check_schema`: what a backend (xgrammar, outlines) would not enforce, with
  JSON pointers; `support.KEYWORD_SUPPORT` is the keyword table behind it.
* `bound_schema`: opt-in ``maxLength`` / ``maxItems`` where the schema sets none (what the
  grammar is compiled from; final validation stays against the user's schema).
* `StructuralTag`: free text with tagged, schema-constrained segments (`structural.py`).
* `parse_output`: final validation of a completed output (jsonschema + Pydantic).
"""

from .backends import backend_schema, convert_json_schema
from .bounds import AddedBound, bound_schema
from .preflight import PreflightIssue, PreflightReport, SchemaWarning, check_schema, preflight
from .spec import Grammar, JsonLayout, Regex, SchemaSpec, normalize_schema
from .structural import StructuralTag, Tag, TaggedSegment, TaggedText
from .support import KEYWORD_SUPPORT
from .validate import parse_output

__all__ = [
    "AddedBound",
    "Grammar",
    "JsonLayout",
    "KEYWORD_SUPPORT",
    "PreflightIssue",
    "PreflightReport",
    "Regex",
    "SchemaSpec",
    "SchemaWarning",
    "StructuralTag",
    "Tag",
    "TaggedSegment",
    "TaggedText",
    "backend_schema",
    "bound_schema",
    "check_schema",
    "convert_json_schema",
    "normalize_schema",
    "parse_output",
    "preflight",
]
