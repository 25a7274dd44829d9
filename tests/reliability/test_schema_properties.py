"""Property-based: random JSON Schemas and instances through our grammar layer (xgrammar
backend, default mode). Either the schema is refused with a SchemaError, or

* every valid instance, written in the library's layout, is accepted by the matcher, and
* every invalid instance the matcher accepts violates only keywords the pre-flight report
  declared as not enforced (the rule of benchmarks/coverage.py).

Schemas come from a recursive strategy over types / properties / required / items / enum /
const / anyOf and the usual bounds; valid instances from a generator that follows the schema;
invalid ones by mutating valid ones (checked invalid by jsonschema).
"""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from constrained_spec.errors import SchemaError

NAMES = st.sampled_from(["a", "b", "id", "name", "x_1", "Tag", "é", "k-2"])
PATTERNS = {  # pattern -> strings that match it (JSON Schema search semantics)
    "^[a-z]{2,4}$": ["ab", "xyz", "abcd"],
    "^[A-Z][a-z]*$": ["A", "Bob", "Zed"],
    "[0-9]": ["a1", "9", "x0y"],
    "^(ab)?c$": ["c", "abc"],
    "^x(-[a-z]+)?$": ["x", "x-ab"],
}
FORMATS = {"date": ["2024-02-29", "1999-12-31"], "email": ["a@b.co", "x.y@example.com"],
           "uuid": ["123e4567-e89b-12d3-a456-426614174000"], "ipv4": ["10.0.0.1", "255.255.255.255"]}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-50, 50),
                    st.text("abcé\"\\\n ", max_size=4))


def string_schema():
    base = st.fixed_dictionaries({"type": st.just("string")})
    lengths = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 3), "maxLength": st.integers(3, 8)})
    pattern = st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(sorted(PATTERNS)))
    fmt = st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(sorted(FORMATS)))
    return st.one_of(base, lengths, pattern, fmt)


def number_schema():
    def build(t, lo, span, excl, mult):
        s = {"type": t}
        if lo is not None:
            s["exclusiveMinimum" if excl else "minimum"] = lo
            s["maximum"] = lo + span
        if mult:
            s["multipleOf"] = mult
        return s
    return st.builds(build, st.sampled_from(["integer", "number"]),
                     st.none() | st.integers(-20, 20), st.integers(1, 40), st.booleans(),
                     st.none() | st.sampled_from([2, 3, 0.5]))


LEAVES = st.one_of(
    string_schema(), number_schema(),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda v: {"enum": v}, st.lists(SCALARS, min_size=1, max_size=4, unique_by=json.dumps)),
    st.builds(lambda v: {"const": v}, SCALARS | st.lists(st.integers(0, 3), max_size=2)),
)


def composite(children):
    def obj(props, data):
        names = list(props)
        required = data.draw(st.lists(st.sampled_from(names), unique=True)) if names else []
        s = {"type": "object", "properties": props}
        if required:
            s["required"] = required
        if data.draw(st.booleans()):
            s["additionalProperties"] = False
        return s
    objects = st.builds(obj, st.dictionaries(NAMES, children, max_size=3), st.data())
    arrays = st.builds(lambda items, lo, extra, unique: {
        "type": "array", "items": items, "minItems": lo, "maxItems": lo + extra,
        **({"uniqueItems": True} if unique else {})},
        children, st.integers(0, 2), st.integers(0, 2), st.booleans())
    any_of = st.builds(lambda bs: {"anyOf": bs}, st.lists(children, min_size=1, max_size=3))
    return st.one_of(objects, arrays, any_of)


SCHEMAS = st.recursive(LEAVES, composite, max_leaves=8)


def valid_instance(schema, draw):
    """A value `schema` accepts, built by following it (None when this draw cannot make one)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if "anyOf" in schema:
        return valid_instance(draw(st.sampled_from(schema["anyOf"])), draw)
    t = schema["type"]
    if t == "null":
        return None
    if t == "boolean":
        return draw(st.booleans())
    if t in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -100))
        hi = schema.get("maximum", 100)
        step = schema.get("multipleOf", 1 if t == "integer" else 0.25)
        first = -(-lo // step) * step
        candidates = [first + i * step for i in range(0, 40) if first + i * step <= hi]
        candidates = [c for c in candidates if not ("exclusiveMinimum" in schema and c <= lo)]
        if t == "integer":
            candidates = [int(c) for c in candidates if float(c).is_integer()]
        return draw(st.sampled_from(candidates)) if candidates else None
    if t == "string":
        if "pattern" in schema:
            return draw(st.sampled_from(PATTERNS[schema["pattern"]]))
        if "format" in schema:
            return draw(st.sampled_from(FORMATS[schema["format"]]))
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 6)
        alphabet = "abz09 -é" if ("minLength" in schema or "maxLength" in schema) else 'abé "\\\n/'
        return draw(st.text(alphabet, min_size=lo, max_size=max(lo, hi)))
    if t == "array":
        n = draw(st.integers(schema["minItems"], schema["maxItems"]))
        items = [valid_instance(schema["items"], draw) for _ in range(n)]
        return None if any(i is None for i in items) and n else items
    if t == "object":
        out = {}
        for name, sub in schema["properties"].items():
            if name in schema.get("required", []) or draw(st.booleans()):
                value = valid_instance(sub, draw)
                if value is None and sub.get("type") != "null" and "null" not in json.dumps(sub):
                    return None
                out[name] = value
        return out
    return None


def mutate(value, draw):
    """A nearby value: another type, a bound crossed, a key dropped or added, an item more."""
    kind = draw(st.sampled_from(["type", "number", "string", "drop", "add", "item"]))
    if isinstance(value, dict) and value and kind in ("drop", "type", "number", "string", "item"):
        key = draw(st.sampled_from(sorted(value)))
        if kind == "drop":
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: mutate(value[key], draw)}
    if isinstance(value, dict) and kind == "add":
        return {**value, "zz": draw(SCALARS)}
    if isinstance(value, list) and value and kind != "item":
        i = draw(st.integers(0, len(value) - 1))
        return value[:i] + [mutate(value[i], draw)] + value[i + 1:]
    if isinstance(value, list):
        return value + [draw(SCALARS) if not value else value[0]]
    if isinstance(value, bool) or value is None:
        return draw(st.sampled_from([0, "true", [], 1.5]))
    if isinstance(value, (int, float)):
        return draw(st.sampled_from([value + 1, value - 1, value + 0.5, -value - 100, str(value), None]))
    if isinstance(value, str):
        return draw(st.sampled_from([value + "x", value[:-1], "", "1999-02-30", 7, "A" * 9]))
    return None


@pytest.fixture(scope="module")
def tools(coverage_mod, ascii_tok):
    return coverage_mod, ascii_tok


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, data=st.data())
def test_valid_accepted_and_invalid_rejected_or_declared(tools, schema, data):
    cov, tok = tools
    from constrained_spec.grammar import compile_spec
    from constrained_spec.schemas import check_schema, normalize_schema, preflight

    try:
        spec = normalize_schema(schema)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_schema(spec, "xgrammar", "default")
        compiled = compile_spec(spec, tok, timeout_s=30)
    except SchemaError:
        return  # refused, with a typed error: allowed
    report = preflight(spec, "xgrammar")
    matcher = compiled.new_matcher()
    validator = cov.make_validator(schema)
    decl = cov.Declarations(schema, [i.pointer for i in report.issues])

    valid = valid_instance(schema, data.draw)
    assume(valid is not None or schema.get("type") == "null" or None in schema.get("enum", [None]))
    assume(validator.is_valid(valid))  # uniqueItems, multipleOf 0.5 on integers, ...
    text = cov.instance_text(schema, validator, valid)
    assert matcher.accepts_text(text), f"valid instance rejected: {text}"

    for _ in range(3):
        bad = mutate(valid, data.draw)
        errors = list(validator.iter_errors(bad))
        if not errors:
            continue
        bad_text = cov.instance_text(schema, validator, bad)
        if matcher.accepts_text(bad_text):
            undeclared = [e.message for e in errors if not decl.explains(e)]
            assert not undeclared, (f"invalid instance {bad_text} accepted; undeclared: "
                                    f"{undeclared}; report: {report.format()}")
