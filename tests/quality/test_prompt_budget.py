"""The default system message fits a token budget (``prompts.py``, ``SCHEMA_PROMPT_SHARE``).

Small schemas get exactly today's prompt (the whole JSON Schema); a large Kubernetes-like schema
(built here; the largest JSONSchemaBench schemas too when ``../shared/bench`` is present) is
described within the budget at an 8k context with max_tokens 512, by an outline that names its
fields, and is never refused for its prompt length; a prompt that is too long by itself still is.
"""

from __future__ import annotations

import gzip
import json

import pytest
from cs_testlib import JSONSCHEMABENCH_SAMPLE, byte_level_bpe

from constrained_spec import Generator, PromptTooLongError
from constrained_spec.frontend.prompts import (
    SCHEMA_PROMPT_SHARE,
    build_messages,
    describe_schema,
    encode_prompt,
)
from constrained_spec.schemas import normalize_schema

CONTEXT = 8192
RESERVED = 512 + 1  # max_tokens + the pending token (the speculative lookahead takes no room)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "description": "full name"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def kubernetes_like(kinds: int = 40) -> dict:
    """A schema shaped like the Kubernetes API's: many definitions reached through $ref, long
    descriptions, nested objects and arrays, a recursive reference, enums, patterns."""
    desc = ("Standard object's metadata. More info: https://git.k8s.io/community/contributors/"
            "devel/sig-architecture/api-conventions.md#metadata, kept for every object kind")
    defs: dict = {
        "ObjectMeta": {"type": "object", "description": desc, "properties": {
            "name": {"type": "string", "description": "Name must be unique within a namespace."},
            "namespace": {"type": "string", "pattern": "^[a-z0-9-]+$"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "ownerReferences": {"type": "array", "items": {"$ref": "#/definitions/ObjectMeta"}}}},
        "Quantity": {"type": "string", "pattern": "^[0-9]+(m|Mi|Gi)?$"},
    }
    for i in range(kinds):
        defs[f"Spec{i}"] = {"type": "object", "description": f"Spec {i}: " + desc, "properties": {
            f"field{j}": {"type": "string", "description": f"Field {j} of spec {i}. " + desc,
                          "minLength": 1, "maxLength": 253} for j in range(12)} | {
            "resources": {"type": "object", "properties": {
                "limits": {"$ref": "#/definitions/Quantity"},
                "requests": {"$ref": "#/definitions/Quantity"}}},
            "policy": {"type": "string", "enum": ["Always", "OnFailure", "Never"]},
            "containers": {"type": "array", "items": {"type": "object", "properties": {
                "image": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}}},
                "required": ["image"]}}}, "required": ["field0"]}
    return {"type": "object", "definitions": defs, "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string", "enum": ["Deployment", "Pod"]},
        "metadata": {"$ref": "#/definitions/ObjectMeta"},
        **{f"spec{i}": {"$ref": f"#/definitions/Spec{i}"} for i in range(kinds)}},
        "required": ["apiVersion", "kind", "metadata"]}


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


def system_tokens(tok, ids: list[int]) -> int:
    """Tokens of the system message inside the encoded prompt (byte-level: no chat template)."""
    text = tok.decode(ids)
    return len(tok.encode(text.split("\n\n")[0], add_special_tokens=False))


@pytest.mark.parametrize("schema", [PERSON, {"type": "array", "items": {"type": "integer"}},
                                    {"type": "string", "enum": ["a", "b"]}])
def test_small_schemas_get_exactly_todays_prompt(tok, schema):
    spec = normalize_schema(schema)
    today = encode_prompt(tok, "Ada, 36", spec)
    assert encode_prompt(tok, "Ada, 36", spec, context=CONTEXT, reserved=RESERVED) == today
    assert "JSON Schema: " + json.dumps(spec.json_schema) in tok.decode(today)


def test_a_kubernetes_like_schema_is_described_within_the_budget_at_8k(tok):
    schema = kubernetes_like(kinds=16)
    spec = normalize_schema(schema)
    full = encode_prompt(tok, "Make a deployment", spec)
    assert len(full) + RESERVED > CONTEXT  # today's prompt does not fit at all
    ids = encode_prompt(tok, "Make a deployment", spec, context=CONTEXT, reserved=RESERVED)
    assert system_tokens(tok, ids) <= SCHEMA_PROMPT_SHARE * CONTEXT
    assert len(ids) + RESERVED <= CONTEXT
    text = tok.decode(ids)
    # an outline: field paths with their types, required marks, enums; no pasted schema
    assert "JSON Schema:" not in text and "apiVersion*: string" in text
    assert 'kind*: one of "Deployment", "Pod"' in text and "metadata*: object" in text
    assert "pattern" not in text and "maxLength" not in text  # the grammar enforces those


def test_the_outline_falls_back_level_by_level_and_never_exceeds_the_budget(tok):
    spec = normalize_schema(kubernetes_like(kinds=12))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    texts = {}
    for budget in (50_000, 40_000, 8000, 3000, 1000, 300, 5):
        texts[budget] = describe_schema(spec, budget, count)
        assert count(texts[budget]) <= budget or budget == 5
    assert "JSON Schema:" in texts[50_000]  # a budget that holds it: the whole schema
    # the outline: nested paths (references followed, a recursive one once), with descriptions
    assert "metadata.labels.*: string" in texts[40_000]
    assert "metadata.ownerReferences: array of object" in texts[40_000]
    assert "- spec0.field0*: string - Field 0 of spec 0." in texts[40_000]
    # then without descriptions, then less deep, then the names alone, cut to fit
    assert "spec11.containers[].args: array of string" in texts[8000]
    assert " - Field" not in texts[8000]
    assert "- spec0: object - Spec 0:" in texts[3000] and "spec0.field0" not in texts[3000]
    assert "- spec11: object" in texts[1000] and " - Spec" not in texts[1000]
    assert texts[300].startswith("Answer with a JSON object, and nothing else. Its fields: "
                                 "apiVersion*, kind*, metadata*, spec0,")
    assert texts[300].endswith(" more)")
    assert texts[5] == "Answer with a JSON object, and nothing else."  # the last resort


def test_a_schema_is_never_refused_for_its_prompt_length(tiny_loaded):
    schema = kubernetes_like(kinds=4)
    gen = Generator(tiny_loaded, schema=schema, max_tokens=512)  # tiny model: 2048 context
    req, _ = gen.make_request("Make a deployment")
    assert len(req.prompt_ids) + 512 <= gen.model.runner.max_context
    with pytest.raises(PromptTooLongError):  # a prompt too long by itself still is
        gen.make_request("word " * 3000)


def test_a_users_own_system_message_is_left_alone(tok):
    spec = normalize_schema(kubernetes_like(kinds=4))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"}]
    assert encode_prompt(tok, msgs, spec, context=CONTEXT, reserved=RESERVED) == \
        encode_prompt(tok, msgs, spec)
    assert build_messages(msgs, spec)[0]["content"] == "Be brief."


def largest_bench_schemas(n: int) -> list[dict]:
    rows = []  # the sample kept in the repository (benchmarks/data/jsonschemabench)
    for path in sorted(JSONSCHEMABENCH_SAMPLE.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            rows += [json.loads(line)["schema"] for line in f]
    return sorted(rows, key=lambda s: -len(json.dumps(s)))[:n]


def test_the_largest_jsonschemabench_schemas_fit_at_8k(tok):
    for schema in largest_bench_schemas(2):
        spec = normalize_schema(schema)
        ids = encode_prompt(tok, "Generate a JSON object", spec, context=CONTEXT, reserved=RESERVED)
        assert len(ids) + RESERVED <= CONTEXT
        assert system_tokens(tok, ids) <= SCHEMA_PROMPT_SHARE * CONTEXT
