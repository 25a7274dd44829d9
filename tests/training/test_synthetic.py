"""Task-style synthetic prompts (constrained_spec.training.synthetic): pure Python, no model.

Checks determinism, uniqueness, the kind mix, that every schema is a valid JSON Schema the
library accepts, that every truth validates and is stated in its text, and that nothing is
copied from the benchmark's prompts.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from cs_testlib import load_tasks
from jsonschema import Draft202012Validator

from constrained_spec.errors import ConfigError
from constrained_spec.training.synthetic import DOMAINS, KINDS, task_prompts


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, Any]]:
    return task_prompts(3000, seed=0)


def _kind(row: dict[str, Any]) -> str:
    return row["id"].split("-")[1]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_deterministic_and_seeded():
    assert task_prompts(200, seed=3) == task_prompts(200, seed=3)
    assert task_prompts(200, seed=3) != task_prompts(200, seed=4)
    assert task_prompts(0) == []


def test_unique_ids_and_prompts(prompts):
    assert len(prompts) == 3000
    assert len({p["id"] for p in prompts}) == 3000
    assert len({p["prompt"] for p in prompts}) == 3000
    for p in prompts:
        assert set(p) == {"id", "prompt", "schema", "truth"}
        kind, domain = p["id"].split("-")[1:3]
        assert kind in dict(KINDS) and domain in DOMAINS


def test_many_without_repeats():
    rows = task_prompts(5000, seed=1)
    assert len({p["prompt"] for p in rows}) == len({p["id"] for p in rows}) == 5000


def test_kind_mix_and_domains(prompts):
    counts = Counter(_kind(p) for p in prompts)
    for kind, share in KINDS:
        assert abs(counts[kind] / len(prompts) - share) < 0.03, counts
    assert len(DOMAINS) >= 30
    assert len({p["id"].split("-")[2] for p in prompts}) == len(DOMAINS)
    for p in prompts:
        assert (p["truth"] is None) == (_kind(p) == "create")


def test_schemas_valid_and_accepted(prompts):
    from constrained_spec.schemas import normalize_schema, preflight

    for p in prompts:
        schema = p["schema"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert 1 <= len(schema["properties"]) <= 9
        assert set(schema["required"]) <= set(schema["properties"])
    # both checks take milliseconds per schema; schemas are assembled from a fixed set of
    # property schemas and keywords, so a sample covers every one of them
    for p in random.Random(0).sample(prompts, 300):
        Draft202012Validator.check_schema(p["schema"])
        assert not preflight(normalize_schema(p["schema"]), "xgrammar").unsupported, p["id"]


def test_truth_validates_and_is_stated(prompts):
    for p in prompts:
        if p["truth"] is None:
            continue
        errors = list(Draft202012Validator(p["schema"]).iter_errors(p["truth"]))
        assert not errors, (p["id"], errors[0].message)
        assert set(p["truth"]) == set(p["schema"]["properties"])
        if _kind(p) in ("extract", "call"):
            for s in _strings(p["truth"]):
                assert s in p["prompt"], (p["id"], s)
        else:  # classify: the label is inferred, the other values are stated
            label = next(iter(p["schema"]["properties"]))
            for name, value in p["truth"].items():
                if name != label:
                    assert all(s in p["prompt"] for s in _strings(value)), (p["id"], name)


def test_creation_counts_match_items(prompts):
    seen = 0
    for p in prompts:
        if _kind(p) != "create":
            continue
        for prop in p["schema"]["properties"].values():
            if "minItems" in prop and prop["minItems"] == prop.get("maxItems"):
                assert f"with {prop['minItems']} " in p["prompt"], p["id"]
                seen += 1
    assert seen > 100


def test_no_benchmark_prompts_copied(prompts):
    bench = [task["prompt"] for task in load_tasks()]
    heads = {b[:40] for b in bench}
    rows = prompts + task_prompts(2000, seed=7)
    assert not {p["prompt"] for p in rows} & set(bench)
    assert not [p["prompt"] for p in rows if p["prompt"][:40] in heads]


@pytest.mark.parametrize("bad", [-1, 2.0, "10", True, None])
def test_bad_n(bad):
    with pytest.raises(ConfigError) as exc:
        task_prompts(bad)
    assert exc.value.option == "n"
