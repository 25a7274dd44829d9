"""Free text (no schema) cut at ``max_tokens`` is an answer, as every peer returns it.

- with ``return_result=True`` a :class:`GenerationResult` with ``finish_reason == "length"``,
  nothing raised, one attempt (free text is not retried by default);
- with ``return_result=False`` the text itself, with the default retries or ``max_retries=0``;
- free text is retried only when ``max_retries`` is set: then an output still cut after the
  last attempt raises :class:`IncompleteOutputError` (or comes back with ``finish_reason ==
  "length"`` when ``return_result=True``);
- a schema-constrained output cut at ``max_tokens`` still raises.
"""

from __future__ import annotations

import pytest

from constrained_spec import GenerationResult, Generator, IncompleteOutputError, generate

PROMPT = "x"  # the tiny random model writes free text past 12 tokens on it (no eos)


def test_free_text_at_max_tokens_is_a_result_with_finish_reason_length(tiny_loaded):
    res = generate(tiny_loaded, PROMPT, max_tokens=12, return_result=True)
    assert isinstance(res, GenerationResult)
    assert res.finish_reason == "length"
    assert len(res.token_ids) == 12 and res.attempts == 1 and res.failed_attempts == []
    assert res.text == res.value == tiny_loaded.tokenizer.decode(res.token_ids)


@pytest.mark.parametrize("retries", [{}, {"max_retries": 0}])
def test_free_text_at_max_tokens_returns_the_text_without_retries(tiny_loaded, retries):
    full = generate(tiny_loaded, PROMPT, max_tokens=12, return_result=True)
    text = generate(tiny_loaded, PROMPT, max_tokens=12, **retries)
    assert text == full.text


def test_free_text_is_retried_only_when_max_retries_is_set(tiny_loaded):
    gen = Generator(tiny_loaded, max_tokens=12, max_retries=2)
    with pytest.raises(IncompleteOutputError) as info:
        gen(PROMPT)
    assert info.value.attempts == 3
    res = gen(PROMPT, return_result=True)
    assert res.finish_reason == "length" and res.attempts == 3 and len(res.failed_attempts) == 2


def test_a_schema_output_cut_at_max_tokens_still_raises(tiny_loaded):
    with pytest.raises(IncompleteOutputError):
        generate(tiny_loaded, "item 0", schema={"type": "string"}, max_tokens=12, max_retries=0)
