"""The scoring of benchmarks/activations.py on small values, in milliseconds: leaves as JSON
pointers, the verbatim share of string leaves, leaf agreement over both sides' paths, identical
values, and the independent validity check of a task's output."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks import activations

    return activations


def test_leaves_are_json_pointers_and_empty_containers_are_leaves(bench):
    value = {"a": 1, "b": {"c": ["x", "y"]}, "d": [], "e": {}}
    assert dict(bench.leaves(value)) == {"/a": 1, "/b/c/0": "x", "/b/c/1": "y", "/d": [], "/e": {}}
    assert dict(bench.leaves("yes")) == {"": "yes"}


def test_a_string_leaf_is_verbatim_only_when_the_prompt_holds_it_case_sensitively(bench):
    prompt = "Ada Lovelace lives in London."
    value = {"name": "Ada Lovelace", "city": "london", "age": 36, "tags": ["London"]}
    assert bench.verbatim(value, prompt) == (2, 3)  # numbers are not string leaves
    assert bench.verbatim(None, prompt) == (0, 0)


def test_leaf_agreement_counts_a_path_missing_on_one_side_and_a_changed_json_type_as_differing(bench):
    a = {"x": 1, "y": "s", "z": [1, 2]}
    b = {"x": 1.0, "y": "s", "z": [1]}
    assert bench.leaf_agreement(a, b) == (2, 4)  # /y and /z/0 equal; /x changed type; /z/1 gone
    assert bench.leaf_agreement(a, a) == (4, 4)
    assert bench.leaf_agreement(None, None) == (1, 1)  # two failures agree


def test_identical_values_ignore_key_order_but_not_json_types(bench):
    assert bench.same_value({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert not bench.same_value({"a": 1}, {"a": True})
    assert not bench.same_value({"a": 1}, None)


def test_validity_is_checked_per_task_kind(bench):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert bench.validates({"kind": "json_schema", "schema": schema}, {"n": 3})
    assert not bench.validates({"kind": "json_schema", "schema": schema}, {"n": "3"})
    assert bench.validates({"kind": "regex", "regex": r"\d{4}"}, "1969")
    assert not bench.validates({"kind": "regex", "regex": r"\d{4}"}, "1969-07")
    assert bench.validates({"kind": "choice", "choices": ["yes", "no"]}, "yes")
    assert not bench.validates({"kind": "choice", "choices": ["yes", "no"]}, "maybe")
