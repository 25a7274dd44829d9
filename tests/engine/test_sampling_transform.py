"""The sampling transform (temperature, top-k, top-p) always leaves a token to sample: a top_p
so small it underflows float32 keeps the most likely allowed token instead of dropping all."""

from __future__ import annotations

import pytest
import torch

from constrained_spec.generation.sampling import process_logits


@pytest.mark.parametrize("top_p", [1e-50, 1e-46, 1e-300, 5e-324, 1e-7])
def test_a_tiny_top_p_keeps_exactly_the_most_likely_allowed_token(top_p):
    logits = torch.tensor([[float("-inf"), 2.0, 5.0, float("-inf"), 1.0],
                           [0.3, float("-inf"), float("-inf"), 4.0, 4.5]])
    out = process_logits(logits, torch.tensor([1.0, 0.7]), torch.tensor([0, 0]),
                         torch.tensor([top_p, top_p], dtype=torch.float32))
    kept = torch.isfinite(out)
    assert kept.sum(dim=-1).tolist() == [1, 1]
    assert out.argmax(dim=-1).tolist() == [2, 4]
    assert not out.softmax(-1).isnan().any()


def test_top_p_with_top_k_and_a_single_allowed_token():
    logits = torch.tensor([[float("-inf"), float("-inf"), 3.0]])
    out = process_logits(logits, torch.tensor([2.0]), torch.tensor([1]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[False, False, True]]


def test_a_tiny_top_p_generates_instead_of_failing(tiny_loaded):
    """This was a GenerationError blaming the grammar: every token had been dropped."""
    from constrained_spec import Generator

    gen = Generator(tiny_loaded, schema=["red", "green", "blue"], speculative=False, max_tokens=8)
    for top_p in (1e-50, 1e-300):
        assert gen("Pick a colour.", temperature=1.0, top_p=top_p, seed=3) in ("red", "green", "blue")
    greedy = gen("Pick a colour.")
    assert gen("Pick a colour.", temperature=1.0, top_p=1e-300, seed=4) == greedy  # the argmax
