"""The concise schema language (``llm``'s): fields, types, descriptions, errors, --schema-multi."""

from __future__ import annotations

import jsonschema
import pytest

from constrained_spec import SchemaError
from constrained_spec.frontend.dsl import dsl_to_schema, wrap_multi


def test_comma_separated_fields_default_to_required_strings():
    schema = dsl_to_schema("name, age int, bio: a short bio")
    assert schema == {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "bio": {"type": "string", "description": "a short bio"},
        },
        "required": ["name", "age", "bio"],
    }


def test_every_type_maps_to_its_json_schema_type():
    schema = dsl_to_schema("a int, b float, c bool, d str")
    assert [p["type"] for p in schema["properties"].values()] == ["integer", "number", "boolean", "string"]


def test_newlines_separate_fields_so_descriptions_may_hold_commas():
    schema = dsl_to_schema("""
        name: the full name, as written
        age int: in years, at the time
    """)
    assert schema["properties"] == {
        "name": {"type": "string", "description": "the full name, as written"},
        "age": {"type": "integer", "description": "in years, at the time"},
    }
    assert schema["required"] == ["name", "age"]


def test_description_keeps_later_colons():
    schema = dsl_to_schema("time str: as HH:MM")
    assert schema["properties"]["time"]["description"] == "as HH:MM"


def test_field_order_is_kept():
    assert list(dsl_to_schema("z, a, m")["properties"]) == ["z", "a", "m"]


def test_output_is_a_valid_json_schema_that_accepts_a_matching_object():
    schema = dsl_to_schema("name, age int, score float, ok bool")
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate({"name": "Ada", "age": 36, "score": 1.5, "ok": True}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "Ada", "age": "36", "score": 1.5, "ok": True}, schema)


def test_unknown_type_is_a_schema_error_naming_the_field():
    with pytest.raises(SchemaError, match=r"field 'age' has unknown type 'integer'.*int, float, bool, str"):
        dsl_to_schema("name, age integer")


def test_field_names_with_spaces_are_refused():
    with pytest.raises(SchemaError, match="first name str"):
        dsl_to_schema("first name str")


def test_duplicate_field_is_refused():
    with pytest.raises(SchemaError, match="'name' is given twice"):
        dsl_to_schema("name, age int, name")


@pytest.mark.parametrize("text", ["", "  ", ", ,", "\n\n"])
def test_no_fields_is_refused(text):
    with pytest.raises(SchemaError, match="no fields"):
        dsl_to_schema(text)


def test_field_without_a_name_is_refused():
    with pytest.raises(SchemaError, match="no name"):
        dsl_to_schema("name, : just a description")


def test_wrap_multi_makes_an_items_array_as_llm_does():
    item = dsl_to_schema("name, age int")
    assert wrap_multi(item) == {"type": "object",
                                "properties": {"items": {"type": "array", "items": item}},
                                "required": ["items"]}


def test_wrap_multi_hoists_defs_so_references_still_resolve():
    person = {"type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"],
              "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}},
                                "required": ["kind"]}}}
    wrapped = wrap_multi(person)
    assert "$defs" not in wrapped["properties"]["items"]["items"]
    jsonschema.validate({"items": [{"pet": {"kind": "cat"}}]}, wrapped)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"items": [{"pet": {"kind": 3}}]}, wrapped)
    assert "$defs" in person  # the input is not modified
