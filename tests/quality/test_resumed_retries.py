"""Resumed retries (``retry_from="resume"``, generation/retry.py) keep what was good.

- an output that completes on its first attempt is token-identical with resumed retries,
  from-start retries and no retries;
- a resumed retry keeps the failed attempt's output up to the resume point, prefills the
  prompt once (the cache is reused) and gives back every cache slot it held;
- its continuation is what the model samples given the prompt and the kept prefix: the same
  tokens as a fresh request whose prompt ends with that prefix, same seed and temperature;
- the resume point: the value a loop began in, the string or array still open at
  ``max_tokens``, and the beginning once a resumed retry failed too;
- ``retry_from`` is checked like every option.
"""

from __future__ import annotations

import pytest
import test_default_retries
from test_default_retries import MIXED_SCHEMAS, STRING_SCHEMA

from constrained_spec import ConfigError, GenerationResult, Generator, IncompleteOutputError
from constrained_spec.config import SamplingParams
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.loops import Loop, LoopDetector
from constrained_spec.generation.retry import open_value_start, resume, resume_point

# the looping bigram model of the default retries' tests (a fixture): the same cases
looping = test_default_retries.looping


class PrefillSpy:
    """Counts the runner's prefill forwards (no logits wanted) while installed."""

    def __init__(self, runner, monkeypatch) -> None:
        self.prefills = 0
        forward = runner.forward

        def spy(slots, tokens, num_logits, **kw):
            if all(n == 0 for n in num_logits):
                self.prefills += len(slots)
            return forward(slots, tokens, num_logits, **kw)
        monkeypatch.setattr(runner, "forward", spy)


def test_first_attempt_outputs_are_identical_with_resume_start_and_no_retries(tiny_loaded):
    gen = Generator(tiny_loaded, max_tokens=16)
    prompts = [f"item {i}" for i in range(len(MIXED_SCHEMAS))]
    single = gen.batch(prompts, schemas=MIXED_SCHEMAS, return_result=True, max_retries=0)
    resumed = gen.batch(prompts, schemas=MIXED_SCHEMAS, return_result=True, retry_from="resume")
    start = gen.batch(prompts, schemas=MIXED_SCHEMAS, return_result=True, retry_from="start")
    completed = [i for i, r in enumerate(single) if isinstance(r, GenerationResult)]
    assert completed and len(completed) < len(prompts)  # some failed: retries ran
    for i in completed:
        assert resumed[i].token_ids == start[i].token_ids == single[i].token_ids
        assert resumed[i].attempts == 1


def test_a_resumed_retry_keeps_the_prefix_prefills_once_and_frees_its_slots(looping, monkeypatch):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=30, max_retries=2)
    before = looping.runner.slots_in_use
    spy = PrefillSpy(looping.runner, monkeypatch)
    res = gen("x", return_result=True, retry_from="resume")
    assert res.attempts >= 2
    assert spy.prefills == 1  # the retries continued on the first attempt's cache
    failed = res.failed_attempts[0]
    # max_tokens inside the string: everything before the string's opening token is kept
    assert failed.token_ids[:3] == res.token_ids[:3]
    assert looping.runner.slots_in_use == before
    spy.prefills = 0
    gen("x", return_result=True, retry_from="start")
    assert spy.prefills >= 2  # from the start: a prefill per attempt


def test_no_slot_is_held_when_every_resumed_attempt_fails(looping):
    gen = Generator(looping, schema=STRING_SCHEMA, max_tokens=8)  # too short to ever close
    before = looping.runner.slots_in_use
    with pytest.raises(IncompleteOutputError) as info:
        gen(["x", "y"], retry_from="resume")
    assert info.value.attempts == 3
    assert looping.runner.slots_in_use == before


def test_a_resumed_continuation_is_the_model_sampled_given_the_kept_prefix(tiny_loaded):
    """Resuming on the kept cache gives the tokens a fresh request gets whose prompt ends
    with the kept prefix (same seed and temperature): the cache reuse changes nothing."""
    gen = Generator(tiny_loaded, schema={"type": "string"}, max_tokens=12, speculative=False)
    first, _ = gen.make_request("item 0")
    first.keep_slot = True
    gen.new_engine().run([first])
    assert first.finish_reason == "length"  # the tiny model does not close this string in 12
    keep = 5
    params = dict(temperature=0.7, seed=3)
    resumed, _ = gen.make_request("item 0", **params)
    resume(resumed, first, keep)
    gen.new_engine().run([resumed])
    prefix = first.output_ids[:keep]
    fresh, _ = gen.make_request("item 0", **params)
    for tok in prefix:
        assert fresh.matcher.accept(tok)
    fresh.prompt_ids = fresh.prompt_ids + prefix
    fresh.params = SamplingParams(**{**fresh.params.__dict__, "max_tokens": 12 - keep})
    gen.new_engine().run([fresh])
    assert resumed.output_ids[:keep] == prefix
    assert resumed.output_ids[keep:] == fresh.output_ids
    assert tiny_loaded.runner.slots_in_use == 0


def _request(output: list[int], finish: str, loop: Loop | None = None) -> Request:
    req = Request([1], None, SamplingParams(max_tokens=100), (0,), output_ids=output)
    req.finish_reason = finish
    if loop is not None:
        req.loops = LoopDetector()
        req.loops.loop = loop
    return req


# token id -> bytes: a tiny JSON vocabulary
DECODED = [b"", b'{"a": ', b'"', b"x", b'", ', b"[", b"1", b", ", b'"k": ', b"]", b"}"]


def test_max_tokens_resumes_before_the_innermost_open_string_or_array():
    # {"a": [1, 1, "xxx   (an open string in an open array)
    out = [1, 5, 6, 7, 6, 7, 2, 3, 3, 3]
    assert open_value_start(out, DECODED) == 6
    assert resume_point(_request(out, "length"), DECODED) == 6
    # {"a": [1, 1, 1,   (the array is open, no string)
    out = [1, 5, 6, 7, 6, 7, 6, 7]
    assert resume_point(_request(out, "length"), DECODED) == 1
    # {"a": "x", "k":   (nothing open but the object): from the beginning
    assert resume_point(_request([1, 2, 3, 4, 8], "length"), DECODED) == 0
    # not JSON: from the beginning
    assert resume_point(_request(out, "length"), None) == 0


def test_a_loop_resumes_before_the_value_it_began_in():
    # {"a": "xxxxxxxx...   the loop starts inside the string opened at token 1
    out = [1, 2] + [3] * 20
    loop = Loop(period=1, start=4, length=18)
    assert resume_point(_request(out, "loop", loop), DECODED) == 1
    # outside JSON: at the loop's start
    assert resume_point(_request(out, "loop", loop), None) == 4


def test_a_resumed_retry_that_failed_again_starts_from_the_beginning():
    out = [1, 5, 6, 7, 6, 7]
    assert resume_point(_request(out, "length"), DECODED, resumed=True) == 0


def test_retry_from_is_checked(tiny_loaded):
    with pytest.raises(ConfigError) as info:
        Generator(tiny_loaded, retry_from="middle")
    assert info.value.option == "retry_from"
    with pytest.raises(ConfigError):
        Generator(tiny_loaded)("x", retry_from="middle")


def test_the_engine_frees_a_slot_unless_the_request_keeps_it_for_a_retry(tiny_loaded):
    gen = Generator(tiny_loaded, schema={"type": "string"}, max_tokens=6, speculative=False)
    kept, _ = gen.make_request("item 0")
    kept.keep_slot = True
    freed, _ = gen.make_request("x")
    Engine(tiny_loaded.runner, speculative=None).run([kept, freed])
    assert kept.finish_reason == freed.finish_reason == "length"
    assert tiny_loaded.runner.slots_in_use == 1  # the kept one's
    tiny_loaded.runner.free_slot(kept.slot)
    assert tiny_loaded.runner.slots_in_use == 0


def test_the_retry_from_flag_becomes_the_generator_option():
    from constrained_spec.api import DEFAULT_RETRY_FROM
    from constrained_spec.cli.args import generator_options_from_args
    from constrained_spec.cli.parser import build_parser

    def options(*argv: str) -> dict:
        return generator_options_from_args(build_parser().parse_args(["generate", "p", *argv]))

    assert options()["retry_from"] == DEFAULT_RETRY_FROM
    assert options("--retry-from", "start")["retry_from"] == "start"
    with pytest.raises(SystemExit):
        options("--retry-from", "middle")
