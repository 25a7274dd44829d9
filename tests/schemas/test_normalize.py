"""normalize_schema: every input kind becomes one SchemaSpec; every mistake a SchemaError."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from constrained_spec.errors import SchemaError
from constrained_spec.schemas import Grammar, JsonLayout, Regex, SchemaSpec, normalize_schema


class Person(BaseModel):
    name: str
    age: int = Field(ge=0)


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def test_pydantic_model_becomes_json_schema_with_model_target():
    spec = normalize_schema(Person)
    assert spec.kind == "json_schema"
    assert spec.json_schema["properties"]["age"]["minimum"] == 0
    assert spec.target is Person


def test_dict_and_json_text_give_the_same_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    a = normalize_schema(schema)
    b = normalize_schema(json.dumps(schema))
    assert a.kind == b.kind == "json_schema" and a.target is None
    assert a.key == b.key and a == b and hash(a) == hash(b)


def test_dict_is_copied_not_aliased():
    schema = {"type": "string"}
    spec = normalize_schema(schema)
    schema["type"] = "integer"
    assert spec.json_schema["type"] == "string"


def test_key_is_stable_and_depends_on_content_order_and_layout():
    s = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    swapped = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert normalize_schema(s).key == normalize_schema(dict(s)).key
    assert normalize_schema(s).key != normalize_schema(swapped).key  # property order is generated
    compact = JsonLayout(separators=(",", ":"))
    assert normalize_schema(s).key != normalize_schema(s, layout=compact).key
    assert len(normalize_schema(s).key) == 64


def test_key_ignores_target_identity():
    a = normalize_schema(Person)
    b = normalize_schema(a.json_schema)
    assert a.key == b.key and a.target is Person and b.target is None


def test_regex_kind():
    spec = normalize_schema(Regex(r"[a-z]+@[a-z]+\.com"))
    assert spec.kind == "regex" and spec.regex == r"[a-z]+@[a-z]+\.com"


def test_choice_kinds_keep_exact_texts_and_targets():
    lst = normalize_schema(["yes", "no", 3, None])
    assert lst.kind == "choice" and lst.choices == ("yes", "no", "3", "null")
    assert lst.target == ("yes", "no", 3, None)
    lit = normalize_schema(Literal["a b", "c.d"])
    assert lit.choices == ("a b", "c.d")
    en = normalize_schema(Color)
    assert en.choices == ("red", "green") and en.target is Color


def test_choice_regex_escapes_metacharacters():
    import re

    spec = normalize_schema(["a.b", "(x)|y", "1+1"])
    assert re.fullmatch(spec.regex, "a.b") and not re.fullmatch(spec.regex, "axb")
    assert re.fullmatch(spec.regex, "(x)|y") and not re.fullmatch(spec.regex, "y")


def test_grammar_kind():
    spec = normalize_schema(Grammar('start ::= "a" start | "b"', root="start"))
    assert spec.kind == "grammar" and spec.root == "start" and "start ::=" in spec.ebnf


def test_type_adapter_types_are_accepted():
    spec = normalize_schema(list[int])
    assert spec.kind == "json_schema" and spec.json_schema["type"] == "array"


def test_existing_spec_passes_through_and_takes_a_new_layout():
    spec = normalize_schema(Person)
    assert normalize_schema(spec) is spec
    pretty = normalize_schema(spec, layout=JsonLayout(indent=2))
    assert pretty.layout.indent == 2 and pretty.key != spec.key and pretty.target is Person


@pytest.mark.parametrize("bad, needle", [
    ("[a-z]+", "Regex("),                      # a bare regex string
    ('{"type": "string",}', "malformed JSON"),  # malformed JSON text
    ("[1, 2]", "not a JSON Schema object"),      # JSON, but a list
    ("42", "not a JSON Schema object"),          # JSON, but a number
    (Regex("[a-z"), "invalid regular expression"),
    ([], "at least one choice"),
    (["a", "a"], "both are written"),
    (["a", ""], "empty string"),
    (Grammar("root ::= "), "invalid EBNF"),
    (object(), "unsupported schema input"),
])
def test_bad_inputs_raise_schema_error(bad, needle):
    with pytest.raises(SchemaError, match=needle.replace("(", r"\(")):
        normalize_schema(bad)


def test_metaschema_violation_names_keyword_and_pointer():
    with pytest.raises(SchemaError) as info:
        normalize_schema({"type": "object", "properties": {"tags": {"type": "array", "minItems": -1}}})
    assert info.value.pointer == "/properties/tags/minItems"
    assert info.value.keyword == "minItems"


def test_metaschema_unknown_type_is_rejected():
    with pytest.raises(SchemaError) as info:
        normalize_schema({"type": "strnig"})
    assert info.value.pointer == "/type"


def test_layout_validates_separators():
    with pytest.raises(SchemaError):
        JsonLayout(separators=(";", ":"))
    assert JsonLayout(indent=2).dumps({"a": [1]}) == '{\n  "a": [\n    1\n  ]\n}'


def test_spec_is_frozen():
    spec = normalize_schema(["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        # misc: a frozen field; unused where mypy reads the package-dir import as Any
        spec.kind = "regex"  # type: ignore[misc, unused-ignore]
    assert isinstance(spec, SchemaSpec)


def test_layout_allows_only_plain_separators():
    for seps in [(" ,", ":"), (",", " : "), (",\n", ":")]:
        with pytest.raises(SchemaError):
            JsonLayout(separators=seps)
