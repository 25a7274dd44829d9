"""The repetition guard on the embedded model: greedy speculation on == off, token for token.

Float32 (see tests/test_tasks_embedded.py: bf16 batch shapes alone can flip a near-tie). A few
benchmark tasks, short outputs, one request at a time in both runs.
"""

from __future__ import annotations

import pytest
from cs_testlib import load_tasks

from constrained_spec import Generator, SpeculativeConfig

pytestmark = pytest.mark.model

TASKS = ("order_create", "log_parse")
GUARD = {"no_repeat_ngram_size": 4, "repetition_penalty": 1.3}


def test_greedy_speculation_is_token_identical_with_the_guard_on_tasks(embedded_fp32):
    tasks = [t for t in load_tasks() if t["id"] in TASKS]
    # single attempts: a retry samples, and sampling keeps the distribution, not the tokens
    single = {"max_tokens": 40, "max_retries": 0}
    off = Generator(embedded_fp32, speculative=False, **single, **GUARD)
    on = Generator(embedded_fp32, speculative=SpeculativeConfig(method="ngram"), **single, **GUARD)
    plain = Generator(embedded_fp32, speculative=False, **single)
    changed = 0
    for task in tasks:
        a, b, c = (g.batch([task["prompt"]], schemas=[task["schema"]], return_result=True)[0]
                   for g in (off, on, plain))
        assert a.token_ids == b.token_ids, task["id"]
        assert b.stats.target_forwards < a.stats.target_forwards
        changed += a.token_ids != c.token_ids
    assert changed > 0  # the guard acted on at least one task
