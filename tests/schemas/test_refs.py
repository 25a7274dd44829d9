"""References never leave the schema document: no ``$ref`` is fetched, in any schema mode or
code path (normalisation, pre-flight, final validation), and a reference that would need a
fetch, or that a nested ``$id`` resolves elsewhere than the grammar does, is a `SchemaError`
naming its JSON pointer, raised before anything is generated."""

from __future__ import annotations

import warnings

import pytest
from cs_testlib import recording_http_server
from referencing.exceptions import Unresolvable

from constrained_spec import Generator, SchemaError
from constrained_spec.schemas import check_schema, normalize_schema, parse_output, preflight
from constrained_spec.schemas.refs import check_refs, validator
from constrained_spec.schemas.spec import SchemaSpec
from constrained_spec.schemas.validate import json_validator

MODES = ("default", "strict", "lenient")
SECRET = "constrained-spec-secret-4f1c9a"


def remote_schemas(base: str) -> dict[str, tuple[dict, str]]:
    """Schemas that reach ``base`` in every place a reference can sit -> the pointer named."""
    return {
        "root $ref": ({"$ref": f"{base}/s.json"}, "/$ref"),
        "property $ref": ({"type": "object", "properties": {"a": {"$ref": f"{base}/s.json"}}},
                          "/properties/a/$ref"),
        "$ref in a keyword the grammar drops": (
            {"type": "string", "not": {"$ref": f"{base}/s.json"}}, "/not/$ref"),
        "$ref reached only through a local $ref": (
            {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": f"{base}/s.json"}}},
            "/definitions/a/$ref"),
        "relative $ref against the root $id": (
            {"$id": f"{base}/root.json", "type": "object",
             "properties": {"a": {"$ref": "other.json"}}}, "/properties/a/$ref"),
        "$dynamicRef": ({"$dynamicRef": f"{base}/s.json#meta"}, "/$dynamicRef"),
        "draft-07 $ref": ({"$schema": "http://json-schema.org/draft-07/schema#",
                           "items": {"$ref": f"{base}/s.json"}}, "/items/$ref"),
        "a bundled meta-schema": ({"$ref": "https://json-schema.org/draft/2020-12/schema"}, "/$ref"),
    }


@pytest.mark.parametrize("mode", MODES)
def test_http_refs_are_refused_naming_the_pointer_and_never_fetched(mode):
    with recording_http_server() as (base, paths):
        for name, (schema, pointer) in remote_schemas(base).items():
            with pytest.raises(SchemaError) as info:
                spec = normalize_schema(schema)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    check_schema(spec, "xgrammar", mode)
                parse_output(spec, '"x"')
            assert info.value.pointer == pointer, name
            assert "never fetched" in str(info.value) or "points nowhere" in str(info.value), name
        assert paths == []


@pytest.mark.parametrize("mode", MODES)
def test_the_generator_refuses_remote_refs_before_generating_in_every_mode(tiny_loaded, mode):
    with recording_http_server() as (base, paths):
        schema = {"type": "object", "properties": {"a": {"$ref": f"{base}/s.json"}}}
        with pytest.raises(SchemaError, match="never fetched"):
            Generator(tiny_loaded, schema=schema, schema_mode=mode, speculative=False)
        gen = Generator(tiny_loaded, schema_mode=mode, speculative=False)
        with pytest.raises(SchemaError, match="never fetched"):
            gen.make_request("hi", schema=schema)  # a per-request schema (the server's path)
        assert paths == []


def test_validators_never_retrieve_even_for_a_spec_built_by_hand():
    """Final validation and pre-flight do not depend on normalisation's check: jsonschema's own
    fallback (urlopen) is never reached."""
    with recording_http_server() as (base, paths):
        schema = {"type": "object", "properties": {"a": {"$ref": f"{base}/s.json"}},
                  "const": {"a": 1}}  # pre-flight value-checks const against the $ref sibling
        spec = SchemaSpec(kind="json_schema", json_schema=schema)
        with pytest.raises(SchemaError, match="cannot be resolved"):
            parse_output(spec, '{"a": "x"}')
        for backend in ("xgrammar", "outlines"):
            with pytest.raises(SchemaError, match="never fetched"):
                preflight(spec, backend)
        for make in (validator, json_validator):
            with pytest.raises(Unresolvable):
                make({"$ref": f"{base}/s.json"}).is_valid("x")
        assert paths == []


def test_a_file_ref_never_shows_the_file_content(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(f'{{"const": "{SECRET}"}}')
    for mode in MODES:
        schema = {"type": "object", "properties": {"a": {"$ref": secret.as_uri()}}}
        with pytest.raises(SchemaError) as info:
            Generator(None, schema=schema, schema_mode=mode)
        assert info.value.pointer == "/properties/a/$ref"
        assert SECRET not in str(info.value)
    spec = SchemaSpec(kind="json_schema", json_schema={"$ref": secret.as_uri()})
    with pytest.raises(SchemaError) as info:
        parse_output(spec, f'"{SECRET}"')
    assert SECRET not in str(info.value).replace(f'"{SECRET}"', "")  # the output, not the file


def test_a_root_id_on_a_live_host_is_only_a_base_uri():
    """A root ``$id`` naming a host is the document's own name: local refs resolve inside."""
    with recording_http_server() as (base, paths):
        schema = {"$id": f"{base}/root.json", "$defs": {"x": {"type": "integer"}},
                  "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"]}
        spec = normalize_schema(schema)
        check_schema(spec, "xgrammar", "strict")
        assert parse_output(spec, '{"a": 3}') == {"a": 3}
        with pytest.raises(Exception, match="not of type"):
            parse_output(spec, '{"a": "x"}')
        # a relative ref to an embedded resource resolves inside the document too (pre-flight
        # reports the grammar cannot follow it; lenient generates anyway)
        embedded = {"$id": f"{base}/root.json", "$defs": {"x": {"$id": "x.json", "type": "integer"}},
                    "$ref": "x.json"}
        spec = normalize_schema(embedded)
        assert parse_output(spec, "3") == 3
        assert paths == []


@pytest.mark.parametrize("schema", [
    # the nested $id rebases "#/$defs/x" to itself, where there is no $defs: a pointer to nowhere
    {"$defs": {"x": {"type": "integer"}}, "type": "object",
     "properties": {"a": {"$id": "http://example.invalid/a.json", "$ref": "#/$defs/x"}}},
    # ... or to a different schema than the root's $defs/x, which the grammar would use
    {"$defs": {"x": {"type": "integer"}}, "type": "object",
     "properties": {"a": {"$id": "http://example.invalid/a.json",
                          "$defs": {"x": {"type": "string"}},
                          "properties": {"b": {"$ref": "#/$defs/x"}}}}},
])
def test_a_nested_id_that_moves_a_local_ref_is_refused_before_generating(schema):
    with pytest.raises(SchemaError, match="nested \\$id") as info:
        normalize_schema(schema)
    assert info.value.pointer.endswith("/$ref")
    assert info.value.pointer.startswith("/properties/a")


def test_local_refs_and_recursion_pass_the_check():
    check_refs({"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"})
    check_refs({"type": "array", "items": {"$ref": "#"}})
    check_refs({"$defs": {"t": True}, "$ref": "#/$defs/t"})
    check_refs({"$defs": {"a": {"$anchor": "a", "type": "string"}}, "$ref": "#a"})
    with pytest.raises(SchemaError, match="points nowhere") as info:
        check_refs({"properties": {"a": {"$ref": "#/$defs/none"}}})
    assert info.value.pointer == "/properties/a/$ref"
