"""Speculation sized to the load (generation/budget.py): the cut rule, and outputs it never changes."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_engine_tiny import EOS, PROMPTS, SCHEMAS, make_engine

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.errors import ConfigError
from constrained_spec.generation.budget import (
    MIN_STEPS,
    Acceptance,
    CostCurve,
    DraftBudget,
    chain_gains,
    plan_cuts,
    run_index,
)
from constrained_spec.generation.engine import Request
from constrained_spec.grammar import compile_spec
from constrained_spec.schemas import normalize_schema


def test_forced_drafts_are_always_kept_whatever_a_row_costs():
    # rows cost 100x the fixed part: no model draft pays, every leading forced one is kept
    assert plan_cuts([[1.0, 1.0, 0.9, 0.8], [0.95]], fixed=0.001, per_row=0.1) == [2, 0]


def test_cheap_rows_keep_every_likely_draft_and_dear_rows_only_the_best():
    gains = [[0.9, 0.8, 0.7, 0.1], [0.6, 0.3]]
    # one row costs a twentieth of the fixed part (batch 1 on a memory-bound CPU): all but the
    # unlikely last draft pay
    assert plan_cuts(gains, fixed=0.010, per_row=0.0005) == [3, 2]
    # a tenth: the 0.3 draft no longer pays (5.3 tokens in 17 ms < 5.0 in 16 ms)
    assert plan_cuts(gains, fixed=0.010, per_row=0.001) == [3, 1]
    # a row costs as much as the fixed part (a compute-bound batch): only gains above the
    # step's tokens per row pay
    assert plan_cuts(gains, fixed=0.010, per_row=0.010) == [2, 0]


def test_a_kept_draft_raises_the_expected_tokens_per_second_and_the_next_would_not():
    gains = [[0.9, 0.8, 0.7, 0.6, 0.5], [0.7, 0.6]]
    fixed, per_row = 0.004, 0.0013

    def rate(keep):
        tokens = len(gains) + sum(sum(g[:k]) for g, k in zip(gains, keep))
        return tokens / (fixed + per_row * (len(gains) + sum(keep)))

    keep = plan_cuts(gains, fixed, per_row)
    best = max(itertools.product(*(range(len(g) + 1) for g in gains)), key=rate)
    assert rate(keep) == pytest.approx(rate(best))


def test_run_positions_restart_after_each_forced_token():
    assert run_index([True, False, False, True, False]) == [-1, 0, 1, -1, 0]


def test_a_request_with_few_verdicts_leans_on_the_engine_wide_rate():
    engine = Acceptance()
    for _ in range(50):
        engine.record([False], 1)  # position 0 always accepted
    mine = Acceptance()
    mine.record([False], 0)  # one refusal of its own
    assert 0.5 < mine.rate(0, engine) < 1.0
    assert chain_gains([True, False, False], mine, engine)[0] == 1.0
    g = chain_gains([True, False, False], mine, engine)
    assert g[0] >= g[1] >= g[2]


def test_the_cost_line_is_read_only_from_steps_that_differ_in_rows():
    curve = CostCurve()
    for _ in range(MIN_STEPS * 2):
        curve.observe(7, 0.012)
    assert curve.fit() is None  # one row count: no slope
    for rows in range(1, MIN_STEPS + 1):
        curve.observe(rows, 0.004 + 0.0015 * rows)
    fixed, per_row = curve.fit()
    assert per_row > 0 and fixed >= 0


class _DearRows(CostCurve):
    """A cost line known from the start: rows as dear as a compute-bound batch makes them."""

    def fit(self):
        return 0.004, 0.004


@pytest.mark.parametrize("mode", ["forced+ngram", "ngram"])
def test_greedy_outputs_are_the_same_with_drafts_cut_to_the_load(tiny_model, tiny_tok, mode):
    params = SamplingParams(max_tokens=30)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, forced=mode == "forced+ngram")
    compiled = [compile_spec(normalize_schema(s), tiny_tok) for s in SCHEMAS]

    def run(adaptive: bool) -> tuple[list[Request], DraftBudget | None]:
        eng = make_engine(tiny_model, SpeculativeConfig(**{**spec.__dict__, "adaptive": adaptive}),
                          dtype=torch.bfloat16)
        if eng.budget is not None:
            eng.budget.cost = _DearRows()
        reqs = [Request(p, c.new_matcher(), params, EOS) for p, c in itertools.product(PROMPTS, compiled)]
        eng.run(reqs)
        return reqs, eng.budget

    full, _ = run(False)
    cut, budget = run(True)
    assert budget is not None and budget.cut_rows > 0  # it did cut drafts
    assert [r.output_ids for r in cut] == [r.output_ids for r in full]
    assert [r.finish_reason for r in cut] == [r.finish_reason for r in full]
    drafted = sum(r.stats.drafted_tokens for r in cut)
    assert drafted < sum(r.stats.drafted_tokens for r in full)


def test_adaptive_is_a_yes_or_no():
    with pytest.raises(ConfigError, match="adaptive"):
        SpeculativeConfig(adaptive="yes")
