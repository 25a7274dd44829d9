"""Logprobs of the emitted tokens (generation/logprobs.py): read from the verifier's own logits,
so they are exact under speculation; ``masked`` is the grammar's renormalized distribution,
``raw`` the model's. Properties on a tiny random model (against an independent forward of the
whole sequence), the shared tasks on the embedded model (speculation on = off)."""

from __future__ import annotations

import math

import pytest
import torch
from cs_testlib import load_tasks

from constrained_spec import Generator, Regex, generate
from constrained_spec.errors import ConfigError

DIGITS = Regex(r"[0-9]{3}-[a-z]{2}")


def _reference_logprobs(loaded, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's own logits at every output position, one forward of the
    whole sequence through transformers (float32): [len(output), V]."""
    model = loaded.model
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("speculative", [False, None])
def test_raw_logprobs_are_the_models_own_at_each_position(tiny_loaded, speculative):
    gen = Generator(tiny_loaded, schema=DIGITS, speculative=speculative, max_retries=0)
    res = gen("numbers please", return_result=True, logprobs=3, logprobs_mode="raw")
    prompt_ids = gen.make_request("numbers please")[0].prompt_ids
    ref = _reference_logprobs(tiny_loaded, prompt_ids, res.token_ids)
    assert len(res.logprobs) == len(res.token_ids) > 0
    for j, (tok, e) in enumerate(zip(res.token_ids, res.logprobs)):
        assert e.token_id == tok
        assert abs(e.logprob - float(ref[j, tok])) < 1e-3
        top = torch.topk(ref[j], 3)
        assert [t for t, _ in e.top] == top.indices.tolist()  # the model's, grammar or not


def test_masked_logprobs_are_the_grammars_renormalized_distribution(tiny_loaded):
    gen = Generator(tiny_loaded, schema=DIGITS, max_retries=0)
    raw = gen("numbers please", return_result=True, logprobs=5, logprobs_mode="raw")
    masked = gen("numbers please", return_result=True, logprobs=5)
    assert masked.token_ids == raw.token_ids
    stops = set(tiny_loaded.tokenizer_data.eos_token_ids)
    for r, m in zip(raw.logprobs, masked.logprobs):
        assert m.logprob >= r.logprob - 1e-6  # renormalized over fewer tokens: never less likely
        assert sum(math.exp(lp) for _, lp in m.top) <= 1 + 1e-5
        assert len(m.top) <= len(r.top) and not stops & {t for t, _ in m.top[1:]}
    # a single choice: the grammar forces every token, each has probability 1 under the mask
    forced = generate(tiny_loaded, "x", schema=["hello world"], return_result=True, logprobs=2)
    assert forced.logprobs and all(e.logprob == pytest.approx(0.0, abs=1e-6) for e in forced.logprobs)
    assert all(len(e.top) == 1 for e in forced.logprobs)  # nothing else was allowed


def test_logprobs_are_off_unless_asked_and_checked(tiny_loaded):
    assert generate(tiny_loaded, "x", schema=DIGITS, return_result=True).logprobs is None
    res = generate(tiny_loaded, "x", schema=DIGITS, return_result=True, logprobs=0)
    assert all(e.top == () for e in res.logprobs) and len(res.logprobs) == len(res.token_ids)
    for bad, option in (({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                        ({"logprobs": 1, "logprobs_mode": "processed"}, "logprobs_mode")):
        with pytest.raises(ConfigError) as err:
            generate(tiny_loaded, "x", schema=DIGITS, **bad)
        assert err.value.option == option


@pytest.mark.model
def test_logprobs_on_the_shared_tasks_are_the_same_with_speculation_on_and_off(embedded):
    # the values of a forward without speculation (the decode rows are row-invariant, so both
    # sides run batched: mixed schemas, grouped by max_tokens as the task file sets it)
    from test_tasks_embedded import run_all

    off, on = (run_all(embedded, spec, batch=True, logprobs=2) for spec in (False, None))
    compared = 0
    for task, plain, drafted in zip(load_tasks(), off, on):
        assert getattr(plain, "token_ids", None) == getattr(drafted, "token_ids", None), task["id"]
        a, b = getattr(plain, "logprobs", None), getattr(drafted, "logprobs", None)
        if a is None:  # an incomplete output (no result): its tokens compared above
            continue
        assert b is not None and len(a) == len(b) == len(plain.token_ids)
        for x, y in zip(a, b):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4, task["id"]
            assert [t for t, _ in x.top] == [t for t, _ in y.top], task["id"]
        compared += 1
    assert compared >= 18  # 19 of 24 complete greedily with the defaults' prompt
