"""The pure helpers of benchmarks/grammar.py (percentiles, aggregation, the table), in
milliseconds: no compile, no tokenizer, no worker processes."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks import grammar

    return grammar


def _record(split, status, compile_ms=None, row_us=(), step_us=(), instances=0, rejected=0):
    result = {"status": status}
    if status == "compiled":
        result.update(compile_ms=compile_ms, compile_cpu_ms=compile_ms, row_us=list(row_us),
                      step_us=list(step_us), step_cpu_us=[t / 2 for t in step_us],
                      instances=instances, rejected=rejected, tokens=len(row_us))
    return {"split": split, "results": {"xgrammar": result}}


def test_percentiles_interpolate_linearly(bench):
    assert bench.percentiles(range(1, 101), (0, 50, 99, 100)) == pytest.approx([1, 50.5, 99.01, 100])
    assert bench.percentiles([7.0]) == [7.0, 7.0]


def test_percentiles_of_nothing_are_nan(bench):
    assert all(math.isnan(v) for v in bench.percentiles([], (50, 99)))


def test_failed_and_timed_out_schemas_stay_out_of_the_percentiles(bench):
    records = [_record("A", "compiled", 10.0, [1, 2, 3], [6], instances=1),
               _record("A", "timeout"),
               _record("B", "compiled", 30.0, [5], [], instances=2, rejected=1),
               _record("B", "error"), _record("B", "hang"), _record("B", "malformed")]
    table = bench.with_shares(bench.summarize(records, ("xgrammar",)), forward_ms=1.0)["xgrammar"]
    a, b, every = table["A"], table["B"], table["all"]
    assert (a["schemas"], a["compiled"], a["failed"], a["timeouts"]) == (2, 1, 0, 1)
    assert (b["schemas"], b["compiled"], b["failed"], b["timeouts"]) == (4, 1, 2, 1)
    assert every["compile_ms_p50"] == pytest.approx(20.0)
    assert every["token_us_p50"] == pytest.approx(2.5)  # rows pooled over schemas: 1, 2, 3, 5
    assert (every["instances"], every["rejected"], every["steps"]) == (3, 1, 1)
    assert every["step_us_p50"] == pytest.approx(6.0)
    assert every["share_p50"] == pytest.approx(3 / 1000)  # CPU time (here half the wall time)
    assert math.isnan(b["step_us_p50"])  # no full step in B


def test_table_has_a_row_per_split_in_order_then_all(bench):
    records = [_record("Zeta", "compiled", 1.0, [1], [1]), _record("Alpha", "compiled", 2.0, [2], [2])]
    text = bench.format_table(bench.summarize(records, ("xgrammar",)), k=3,
                              split_order=("Zeta", "Alpha"))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["split", "Zeta", "Alpha", "**all**"]
    assert "4 masks µs p50 / p99" in rows[0] and "share" not in rows[0]
    assert all(r.count("|") == rows[0].count("|") for r in rows)
    assert "–" not in text  # every row here has data
