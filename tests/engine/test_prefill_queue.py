"""Prompts read a chunk per step beside the decode rows (generation/prefill.py): the same
outputs as a prompt prefilled at admission, and running requests keep committing meanwhile."""

from __future__ import annotations

import itertools

import pytest
from test_engine_tiny import EOS, PROMPTS, SCHEMAS
from test_exact_rows import runner_for

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters.ngram import NgramDrafter
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.prefill import PrefillQueue
from constrained_spec.grammar import compile_spec
from constrained_spec.schemas import normalize_schema

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def engine(model, *, chunked: bool, chunk: int = 7, batch: int = 3) -> Engine:
    runner = runner_for(model, "bf16")
    eng = Engine(runner, speculative=SPEC, drafter=NgramDrafter(4, 1), max_batch_size=batch)
    assert eng.prefills is not None  # a row-invariant runner reads prompts a chunk per step
    eng.prefills = PrefillQueue(runner, chunk) if chunked else None
    return eng


def requests(tok) -> list[Request]:
    compiled = [compile_spec(normalize_schema(s), tok) for s in SCHEMAS]
    prompts = [p * 6 for p in PROMPTS]  # 24-48 tokens: several chunks each
    return [Request(list(p), c.new_matcher(), SamplingParams(max_tokens=20), EOS)
            for p, c in itertools.product(prompts, compiled)]


@pytest.mark.parametrize("chunk,batch", [(7, 3), (64, 12), (1, 2)])
def test_outputs_are_the_same_read_a_chunk_per_step_or_prefilled_at_once(tiny_model, tiny_tok, chunk, batch):
    at_once, chunked = requests(tiny_tok), requests(tiny_tok)
    engine(tiny_model, chunked=False, batch=batch).run(at_once)
    eng = engine(tiny_model, chunked=True, chunk=chunk, batch=batch)
    eng.run(chunked)
    assert [(r.output_ids, r.finish_reason) for r in chunked] == [(r.output_ids, r.finish_reason) for r in at_once]
    assert len(eng.prefills) == 0 and eng.runner.slots_in_use == 0


def test_running_requests_commit_while_a_new_prompt_is_read(tiny_model, tiny_tok):
    eng = engine(tiny_model, chunked=True, chunk=4, batch=2)
    compiled = compile_spec(normalize_schema(SCHEMAS[1]), tiny_tok)
    first = Request(list(PROMPTS[0]), compiled.new_matcher(), SamplingParams(max_tokens=40), EOS)
    eng.admit([first])
    while eng.prefills.holds(first):
        eng.step()
    late = Request(list(PROMPTS[2]) * 8, compiled.new_matcher(), SamplingParams(max_tokens=40), EOS)
    eng.admit([late])
    steps_reading, committed = 0, len(first.output_ids)
    while eng.prefills.holds(late) and not first.finished:
        eng.step()
        steps_reading += 1
    assert steps_reading >= 3  # 63 prompt rows, 4 a step (the running request does not wait)
    assert len(first.output_ids) > committed  # ... and it committed tokens meanwhile


def test_a_cancelled_request_leaves_the_queue_and_its_slot_is_freed(tiny_model, tiny_tok):
    eng = engine(tiny_model, chunked=True, chunk=2, batch=2)
    compiled = compile_spec(normalize_schema(SCHEMAS[0]), tiny_tok)
    r = Request(list(PROMPTS[1]) * 5, compiled.new_matcher(), SamplingParams(max_tokens=10), EOS)
    eng.admit([r])
    eng.step()
    r.cancelled = True
    eng.step()
    eng.reap()
    assert r.finish_reason == "cancelled" and len(eng.prefills) == 0 and eng.runner.slots_in_use == 0


def test_a_prompt_longer_than_the_context_fails_alone_at_admission(tiny_model, tiny_tok):
    eng = engine(tiny_model, chunked=True)
    compiled = compile_spec(normalize_schema(SCHEMAS[0]), tiny_tok)
    ok = Request(list(PROMPTS[0]), compiled.new_matcher(), SamplingParams(max_tokens=5), EOS)
    too_long = Request([3] * (eng.runner.max_context + 1), compiled.new_matcher(), SamplingParams(max_tokens=5), EOS)
    refused = eng.admit([ok, too_long])
    assert refused == [too_long] and too_long.finish_reason == "error" and "context" in str(too_long.error)
    eng.run([])
    assert ok.finished and ok.finish_reason != "error"
