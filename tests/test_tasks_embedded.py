"""The benchmark tasks on the embedded model: validity and greedy losslessness.

- Every task returns an output that validates against its schema / regex / choices, or raises
  IncompleteOutputError: never an invalid output.
- Greedy (temperature 0) outputs are token-identical with speculation off (one request at a
  time) and on, for each drafter, with the tasks (mixed schemas) batched and (slow) one by
  one. Run in the default dtype and kernel plan: the exact runner computes every verify and
  batched row as a 1-row decode does (tests/engine/test_exact_rows.py), so no near-tie can
  flip. Single attempts (``max_retries=0``): a retry samples, and a sampled output keeps its
  distribution under speculation, not its tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from cs_testlib import load_tasks

from constrained_spec import Generator, IncompleteOutputError, Regex, SpeculativeConfig

pytestmark = pytest.mark.model


def task_schema(task: dict):
    if task["kind"] == "json_schema":
        return task["schema"]
    if task["kind"] == "regex":
        return Regex(task["regex"])
    return list(task["choices"])


def check_valid(task: dict, value) -> None:
    if task["kind"] == "json_schema":
        jsonschema.validate(value, task["schema"])
        json.dumps(value)
    elif task["kind"] == "regex":
        assert re.fullmatch(task["regex"], value), value
    else:
        assert value in task["choices"], value


def run_all(embedded, speculative, batch: bool, **options: Any):
    tasks = load_tasks()
    gen: Generator[Any] = Generator(embedded, speculative=speculative, max_retries=0, **options)
    if batch:
        # max_tokens differs per task: group by it, each group one batch of mixed schemas
        out = {}
        for mt in sorted({t["max_tokens"] for t in tasks}):
            group = [t for t in tasks if t["max_tokens"] == mt]
            res = gen.batch([t["prompt"] for t in group], schemas=[task_schema(t) for t in group],
                            return_result=True, max_tokens=mt)
            out.update({t["id"]: r for t, r in zip(group, res)})
        return [out[t["id"]] for t in tasks]
    return [gen.batch([t["prompt"]], schemas=[task_schema(t)], return_result=True,
                      max_tokens=t["max_tokens"])[0] for t in tasks]


@pytest.fixture(scope="module")
def baseline(embedded):
    return run_all(embedded, False, batch=False)


def test_every_task_validates_or_is_incomplete(baseline):
    tasks = load_tasks()
    completed = 0
    for task, res in zip(tasks, baseline):
        if isinstance(res, IncompleteOutputError):
            assert res.partial_text is not None
            continue
        assert not isinstance(res, BaseException), f"{task['id']}: {res!r}"
        check_valid(task, res.value)
        completed += 1
    assert completed > 0


@pytest.mark.parametrize("batch", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["batched", "alone"])
@pytest.mark.parametrize("mode", ["forced", "ngram", "forced+ngram", "eagle3+forced", "mtp+forced"])
def test_greedy_speculation_is_token_identical_on_tasks(embedded, baseline, mode, batch):
    """(eagle3 and mtp: the heads shipped for the embedded model.)"""
    assert getattr(embedded.runner, "exact", False)
    spec = {"forced": SpeculativeConfig(method=None),
            "ngram": SpeculativeConfig(method="ngram", forced=False),
            "forced+ngram": SpeculativeConfig(method="ngram"),
            "eagle3+forced": SpeculativeConfig(method="eagle3", num_speculative_tokens=3),
            "mtp+forced": SpeculativeConfig(method="mtp", num_speculative_tokens=3)}[mode]
    tasks = load_tasks()
    results = run_all(embedded, spec, batch=batch)
    forwards_off = forwards_on = 0
    for task, a, b in zip(tasks, baseline, results):
        ids_a = a.token_ids if not isinstance(a, BaseException) else a.token_ids
        ids_b = b.token_ids if not isinstance(b, BaseException) else b.token_ids
        assert ids_a == ids_b, f"{task['id']}: speculation ({mode}) changed the output"
        forwards_off += a.stats.target_forwards
        forwards_on += b.stats.target_forwards
    assert forwards_on < forwards_off
