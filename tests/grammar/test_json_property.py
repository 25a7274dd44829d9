"""Property: for random simple JSON Schemas, every valid instance written in the spec's layout is
accepted by the compiled grammar (character vocabulary), on both backends."""

from __future__ import annotations

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained_spec.grammar import TokenizerData, compile_spec
from constrained_spec.schemas import JsonLayout, normalize_schema, preflight

CHAR_TOK = TokenizerData.from_tokens(["<eos>"] + [chr(c) for c in range(32, 127)] + ["\n"], 0)
# Text that survives both backends' string rules (outlines: no \u escapes, no C1 controls).
SAFE_TEXT = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=6)
KEYS = st.text(alphabet="abcdefgh_", min_size=1, max_size=5)


def leaf_schemas():
    integer = st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                        st.integers(-50, 50), st.integers(0, 200)) | st.just({"type": "integer"})
    string = st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
                       st.integers(0, 3), st.integers(0, 5)) | st.just({"type": "string"})
    enum = st.lists(st.one_of(SAFE_TEXT, st.integers(-9, 99), st.booleans(), st.none()),
                    min_size=1, max_size=4, unique_by=repr).map(lambda v: {"enum": v})
    return st.one_of(integer, string, enum, st.just({"type": "boolean"}), st.just({"type": "null"}),
                     st.just({"type": "number"}))


def schemas():
    def extend(children):
        obj = st.dictionaries(KEYS, children, min_size=1, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req}))
        arr = st.builds(lambda items, lo, extra: {"type": "array", "items": items,
                                                  "minItems": lo, "maxItems": lo + extra},
                        children, st.integers(0, 2), st.integers(0, 3))
        return obj | arr
    inner = st.recursive(leaf_schemas(), extend, max_leaves=8)
    # top level is an object: its text ends at "}", never part-way through a number
    return st.dictionaries(KEYS, inner, min_size=1, max_size=4).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})


def instances(schema):
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema["type"]
    if t == "integer":
        return st.integers(schema.get("minimum", -10**6), schema.get("maximum", 10**6))
    if t == "number":
        return st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3))
    if t == "string":
        # xgrammar's length-limited strings cannot contain escapes (a known narrowing)
        limited = "minLength" in schema or "maxLength" in schema
        alphabet = st.characters(min_codepoint=32, max_codepoint=126,
                                 exclude_characters='"\\' if limited else "")
        return st.text(alphabet=alphabet, min_size=schema.get("minLength", 0),
                       max_size=schema.get("maxLength", 8))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        return st.lists(instances(schema["items"]), min_size=schema["minItems"], max_size=schema["maxItems"])
    props = schema["properties"]
    # declared order, optional properties present or not
    return st.fixed_dictionaries({k: instances(v) for k, v in props.items() if k in schema["required"]},
                                 optional={k: instances(v) for k, v in props.items()
                                           if k not in schema["required"]}).map(
        lambda d: {k: d[k] for k in props if k in d})


LAYOUTS = [JsonLayout(), JsonLayout(separators=(",", ":")), JsonLayout(indent=2),
           JsonLayout(indent=2, separators=(",", ": "))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), schema=schemas(), layout=st.sampled_from(LAYOUTS))
def test_valid_instances_are_accepted_by_both_backends(data, schema, layout):
    instance = data.draw(instances(schema))
    jsonschema.validate(instance, schema)
    spec = normalize_schema(schema, layout=layout)
    text = layout.dumps(instance)
    assert compile_spec(spec, CHAR_TOK, backend="xgrammar").new_matcher().accepts_text(text), text
    assert preflight(spec, "xgrammar").ok
    m = compile_spec(spec, CHAR_TOK, backend="outlines").new_matcher()
    assert m.accepts_text(text), text
