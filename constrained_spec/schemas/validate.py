"""Final validation of a completed output: the last word on whether it matches the schema.

Grammar-constrained decoding narrows what the model can write, but the pre-flight report lists
keywords a backend does not enforce; this is where they are checked. json_schema outputs go
through ``json.loads`` (numbers must be finite float64s: ``1e999`` is refused, not returned as
``inf``), jsonschema (the schema's ``$schema`` draft, default 2020-12, with format
checking; `formats.py` fills in the formats jsonschema leaves to optional packages) and, for a
Pydantic target, ``model_validate_json``.
"""

from __future__ import annotations

import enum
import json
import math
import re
import threading
from typing import Any

from constrained_spec.errors import OutputValidationError, SchemaError

from .backend_log import hear_compile
from .pointers import to_pointer
from .spec import OutputReader, SchemaSpec
from .validator import json_validator

__all__ = ["parse_output"]

_VALIDATORS: dict[str, Any] = {}
_GRAMMARS: dict[str, Any] = {}
_LOCK = threading.Lock()


def parse_output(spec: SchemaSpec, text: str) -> Any:
    """Validate a completed output and convert it to the user's type.

    Returns a Pydantic instance (model / TypeAdapter target), the parsed JSON value (JSON
    Schema), the text (regex, grammar), or the chosen value (choice: the Enum member, the
    Literal / list value).

    Raises
    ------
    OutputValidationError
        The text does not match; ``errors`` lists what failed (with JSON pointers for JSON).
    """
    if spec.kind == "json_schema":
        return _parse_json(spec, text)
    if spec.kind == "regex":
        # exactly re.fullmatch's semantics, which the Regex API promises ("." matches no
        # newline unless the pattern says (?s)); the backends were given the same meaning
        if re.fullmatch(spec.regex or "", text) is None:
            raise OutputValidationError(f"output does not match the regex {spec.regex!r}", text=text,
                                        errors=[f"no full match for {spec.regex!r}"])
        return text
    if spec.kind == "choice":
        try:
            index = spec.choices.index(text)
        except ValueError:
            raise OutputValidationError(
                f"output {text[:60]!r} is none of the {len(spec.choices)} choices", text=text,
                errors=[f"expected one of {list(spec.choices)[:10]}"]) from None
        target = spec.target
        if isinstance(target, type) and issubclass(target, enum.Enum):
            return list(target)[index]
        if isinstance(target, (tuple, list)):
            return target[index]
        return text
    if spec.kind == "grammar":
        if not _grammar_accepts(spec, text):
            raise OutputValidationError("output is not in the language of the EBNF grammar", text=text,
                                        errors=["grammar does not accept the text"])
        if isinstance(spec.target, OutputReader):  # a structural tag: each segment validated
            return spec.target.read_output(text)
        return text
    raise SchemaError(f"unknown spec kind {spec.kind!r}")


def _parse_json(spec: SchemaSpec, text: str) -> Any:
    from referencing.exceptions import Unresolvable

    try:
        value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
        errors = sorted(_validator(spec).iter_errors(value), key=lambda e: list(e.absolute_path))
    except _NonFinite as exc:
        raise OutputValidationError(
            f"output has the number {exc.literal[:40]}, which is not finite as a float64 (it "
            "would be inf / nan in Python, and not JSON once written back); generate again, or "
            "bound the number with minimum / maximum", text=text, errors=[str(exc)]) from None
    except Unresolvable as exc:
        # normalize_schema's check_refs refuses these up front; a spec built by hand can still
        # carry one, and it is the schema's fault, not the output's
        raise SchemaError(f"a reference of the schema cannot be resolved inside it: {exc}; "
                          "nothing outside the schema is fetched", keyword="$ref") from None
    except json.JSONDecodeError as exc:
        raise OutputValidationError(f"output is not valid JSON: {exc.msg} at line {exc.lineno} "
                                    f"column {exc.colno}", text=text, errors=[str(exc)]) from exc
    except ValueError as exc:  # an integer past Python's int-from-string digit limit
        raise OutputValidationError(f"output cannot be read as JSON values: {exc}", text=text,
                                    errors=[str(exc)]) from None
    except RecursionError:
        # a recursive schema lets the model nest values until max_tokens; past Python's
        # recursion limit neither json nor jsonschema can check the output
        raise OutputValidationError(
            "output nests too deeply to be validated (Python's recursion limit); lower "
            "max_tokens or bound the recursion in the schema", text=text,
            errors=["nesting too deep to validate"]) from None
    if errors:
        listed = [f"{to_pointer(e.absolute_path) or '/'}: {e.message}" for e in errors]
        raise OutputValidationError(f"output does not match the JSON Schema: {listed[0]}"
                                    + (f" (+{len(listed) - 1} more)" if len(listed) > 1 else ""),
                                    text=text, errors=listed)
    target = spec.target
    if target is None:
        return value
    from pydantic import BaseModel, TypeAdapter, ValidationError

    try:
        if isinstance(target, type) and issubclass(target, BaseModel):
            return target.model_validate_json(text)
        if isinstance(target, TypeAdapter):
            return target.validate_json(text)
    except ValidationError as exc:
        raise OutputValidationError(f"output fails pydantic validation: {exc.errors()[0].get('msg')}",
                                    text=text, errors=exc.errors()) from exc
    return value


class _NonFinite(Exception):
    """A JSON number that overflows a float64 (``1e999``) or a NaN / Infinity constant."""

    def __init__(self, literal: str) -> None:
        super().__init__(f"{literal[:40]} is not a finite float64")
        self.literal = literal


def _finite_float(literal: str) -> float:
    # the grammars allow any JSON number, and JSON numbers have no range: 1e999 parses to inf,
    # which jsonschema accepts and json.dumps(allow_nan=False) then refuses
    value = float(literal)
    if not math.isfinite(value):
        raise _NonFinite(literal)
    return value


def _no_constant(literal: str) -> Any:
    raise _NonFinite(literal)  # NaN / Infinity / -Infinity: not JSON (no grammar writes them)


def _validator(spec: SchemaSpec) -> Any:
    with _LOCK:
        v = _VALIDATORS.get(spec.key)
    if v is None:
        v = json_validator(spec.json_schema or {})
        with _LOCK:
            if len(_VALIDATORS) > 256:
                _VALIDATORS.clear()
            _VALIDATORS[spec.key] = v
    return v



def _grammar_accepts(spec: SchemaSpec, text: str) -> bool:
    import xgrammar

    with _LOCK:
        compiled = _GRAMMARS.get(spec.key)
    if compiled is None:
        # An empty vocabulary: the matcher then works on strings only, which is all we need.
        compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False)
        # what xgrammar logs here, the pre-flight has reported already: heard, not leaked
        with hear_compile("xgrammar", spec.ebnf or ""):
            compiled = compiler.compile_grammar(xgrammar.Grammar.from_ebnf(
                spec.ebnf or "", root_rule_name=spec.root))
        with _LOCK:
            if len(_GRAMMARS) > 64:
                _GRAMMARS.clear()
            _GRAMMARS[spec.key] = compiled
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and matcher.is_terminated()
