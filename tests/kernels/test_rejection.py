"""rejection_sample: edge cases, agreement of the implementations, and losslessness.

The vectorised torch path and the Triton kernels (CPU interpreter) must give the reference's
outputs exactly for the same uniform / exp_noise draws; the dispatcher picks among them. A
chi-square test on an 8-token vocabulary checks that the emitted tokens follow the masked
target p~, with sampled drafts, point-mass drafts and a grammar mask.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: kernels run on CPU

import pytest
import torch
from scipy import stats

from constrained_spec.kernels import (
    RejectionOutput,
    rejection_sample,
    rejection_sample_reference,
    rejection_sample_triton,
)
from constrained_spec.kernels._backend import triton_available
from constrained_spec.kernels.rejection import _rejection_sample_torch

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install triton); the Triton "
    "kernels are tested on CPU under TRITON_INTERPRET=1 when it is")
FAST = ["vectorised", pytest.param("triton", marks=needs_triton)]
ALL_IMPLEMENTATIONS = ["reference", *FAST]
IMPLEMENTATIONS = {"reference": rejection_sample_reference,
                   "vectorised": _rejection_sample_torch, "triton": rejection_sample_triton}
FIELDS = ("output_tokens", "num_accepted", "recovered", "bonus")
NEG_INF = float("-inf")


def run(impl: str, *args, **kwargs) -> RejectionOutput:
    return IMPLEMENTATIONS[impl](*args, **kwargs)


def assert_same(a: RejectionOutput, b: RejectionOutput) -> None:
    for field in FIELDS:
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def cu_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.long)


def random_batch(num_requests: int, vocab: int, max_k: int, *, seed: int,
                 sampled_q: bool, dtype: torch.dtype = torch.float32,
                 dead_rows: float = 0.0, padding: float = 0.0) -> dict:
    """A batch where drafts are often (not always) accepted, as `rejection_sample` kwargs."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_k + 1, (num_requests,), generator=gen)
    counts[0] = max_k
    cu = cu_of(counts.tolist())
    num_drafts = int(cu[-1])
    num_rows = num_drafts + num_requests
    logits = torch.randn(num_rows, vocab, generator=gen) * 3.0
    logits[torch.rand(num_rows, vocab, generator=gen) < 0.3] = NEG_INF   # the grammar mask
    logits[torch.rand(num_rows, generator=gen) < dead_rows] = NEG_INF    # nothing allowed
    logits = logits.to(dtype)
    draft_rows = torch.arange(num_drafts) + torch.repeat_interleave(
        torch.arange(num_requests), counts)
    p = torch.softmax(logits[draft_rows].float(), -1).nan_to_num(1.0 / vocab)
    draft_probs = None
    if sampled_q:  # a draft model that roughly agrees with the target
        q_logits = logits[draft_rows].float().clamp(min=-30.0) + torch.randn(
            num_drafts, vocab, generator=gen)
        draft_probs = torch.softmax(q_logits, -1)
        drafts = torch.multinomial(draft_probs, 1, generator=gen).flatten()
    else:          # point masses: the target's argmax, a target sample, or a random id
        pick = torch.rand(num_drafts, generator=gen)
        drafts = torch.where(pick < 0.5, p.argmax(-1),
                             torch.where(pick < 0.8,
                                         torch.multinomial(p, 1, generator=gen).flatten(),
                                         torch.randint(0, vocab, (num_drafts,), generator=gen)))
    drafts[torch.rand(num_drafts, generator=gen) < padding] = -1
    return dict(target_logits=logits, draft_tokens=drafts, cu_num_drafts=cu,
                draft_probs=draft_probs,
                greedy=torch.rand(num_requests, generator=gen) < 0.3,
                uniform=torch.rand(num_drafts, generator=gen),
                exp_noise=torch.empty(num_rows, vocab).exponential_(generator=gen))


# -- agreement of the implementations ---------------------------------------------------------

@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("sampled_q", [True, False], ids=["sampled_q", "point_mass"])
@pytest.mark.parametrize(("num_requests", "vocab", "max_k", "dtype"), [
    (60, 16, 5, torch.float32), (30, 1000, 4, torch.bfloat16), (2, 49153, 3, torch.float16),
    (2, 151936, 3, torch.float32),
])
def test_fast_paths_match_reference_on_random_batches(impl, sampled_q, num_requests, vocab,
                                                      max_k, dtype):
    batch = random_batch(num_requests, vocab, max_k, seed=vocab + num_requests,
                         sampled_q=sampled_q, dtype=dtype)
    expected = rejection_sample_reference(**batch)
    assert_same(run(impl, **batch), expected)
    if num_requests > 10:  # the batch exercises acceptance and rejection
        assert 0 < expected.num_accepted.sum() < int(batch["cu_num_drafts"][-1])


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("sampled_q", [True, False], ids=["sampled_q", "point_mass"])
def test_fast_paths_match_reference_with_dead_rows_and_padded_drafts(impl, sampled_q):
    batch = random_batch(50, 24, 4, seed=3, sampled_q=sampled_q, dead_rows=0.15, padding=0.2)
    expected = rejection_sample_reference(**batch)
    assert (expected.output_tokens == -1).any()
    assert_same(run(impl, **batch), expected)


@pytest.mark.parametrize("backend", ["auto", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("vocab", [100, 49153])  # below / above the CPU vectorised cut-off
def test_dispatcher_matches_reference_on_every_backend(backend, vocab):
    batch = random_batch(3, vocab, 2, seed=vocab, sampled_q=True, padding=0.1)
    assert_same(rejection_sample(**batch, backend=backend), rejection_sample_reference(**batch))


@pytest.mark.parametrize("impl", FAST)
def test_seeded_generator_gives_the_same_outputs_on_every_path(impl):
    batch = random_batch(40, 20, 3, seed=11, sampled_q=True)
    del batch["uniform"], batch["exp_noise"]
    expected = rejection_sample_reference(**batch, generator=torch.Generator().manual_seed(5))
    assert_same(run(impl, **batch, generator=torch.Generator().manual_seed(5)), expected)
    other = run(impl, **batch, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(other.output_tokens, expected.output_tokens)


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
def test_one_hot_draft_probs_act_exactly_like_point_masses(impl):
    batch = random_batch(40, 20, 4, seed=8, sampled_q=False)
    drafts = batch["draft_tokens"]
    one_hot = torch.nn.functional.one_hot(drafts, 20).float()
    assert_same(run(impl, **{**batch, "draft_probs": one_hot}), run(impl, **batch))


# -- the rules, on hand-built inputs ---------------------------------------------------------

@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
def test_greedy_accepts_while_draft_is_the_masked_argmax(impl):
    logits = torch.tensor([
        [0.0, 5.0, 1.0, NEG_INF],        # request 0, draft 1 == argmax: accepted
        [NEG_INF, 1.0, 0.5, NEG_INF],    # draft 1 == argmax: accepted
        [9.0, NEG_INF, 2.0, 3.0],        # draft 2, argmax 0: rejected, 0 emitted
        [1.0, 2.0, 3.0, 4.0],            # (bonus row, unused)
        [NEG_INF, NEG_INF, 7.0, 7.0],    # request 1, draft 2 == first of tied argmax
        [1.0, 1.0, NEG_INF, 0.0],        # bonus: first of the tied argmax, 0
    ])
    out = run(impl, logits, torch.tensor([1, 1, 2, 2]), cu_of([3, 1]), greedy=True)
    assert out.output_tokens.tolist() == [[1, 1, 0, -1], [2, 0, -1, -1]]
    assert out.num_accepted.tolist() == [2, 1]
    assert out.recovered.tolist() == [0, -1]
    assert out.bonus.tolist() == [-1, 0]


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
def test_greedy_speculation_emits_the_argmax_chain(impl):
    batch = random_batch(30, 50, 5, seed=2, sampled_q=True, padding=0.1)
    out = run(impl, **{**batch, "greedy": True})
    argmax = batch["target_logits"].argmax(-1)
    cu = batch["cu_num_drafts"]
    for i in range(30):
        n = int(out.num_accepted[i])
        rows = torch.arange(int(cu[i]) + i, int(cu[i]) + i + n + 1)
        assert torch.equal(out.output_tokens[i, : n + 1], argmax[rows])


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
@pytest.mark.parametrize("sampled_q", [True, False], ids=["sampled_q", "point_mass"])
def test_padding_draft_is_always_rejected_and_the_target_sampled(impl, sampled_q):
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0],  # drafts 1, -1
                           [0.0, 0.0, 4.0], [0.0, 0.0, 0.0]])                  # draft -1
    drafts = torch.tensor([1, -1, -1])
    q = torch.full((3, 3), 1.0 / 3) if sampled_q else None
    out = run(impl, logits, drafts, cu_of([2, 1]), q, greedy=torch.tensor([False, True]),
              uniform=torch.zeros(3),                           # accepts anything allowed
              exp_noise=torch.ones(5, 3))                       # sampling picks argmax p~
    assert out.num_accepted.tolist() == [1, 0]
    assert out.output_tokens.tolist() == [[1, 0, -1], [2, -1, -1]]
    assert out.recovered.tolist() == [0, 2] and out.bonus.tolist() == [-1, -1]


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
@pytest.mark.parametrize("greedy", [True, False])
def test_row_allowing_nothing_rejects_and_emits_minus_one_without_nan(impl, greedy):
    logits = torch.tensor([[0.0, 1.0, NEG_INF], [NEG_INF] * 3, [0.0, 0.0, 0.0],  # request 0
                           [NEG_INF] * 3, [0.0, 0.0, 0.0],                         # request 1
                           [NEG_INF] * 3])                                         # request 2
    drafts = torch.tensor([1, 0, 2])
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.0, 0.5]])
    for draft_probs in (None, q):
        out = run(impl, logits, drafts, cu_of([2, 1, 0]), draft_probs, greedy=greedy,
                  uniform=torch.zeros(3), exp_noise=torch.ones(6, 3))
        assert out.num_accepted.tolist() == [1, 0, 0]
        assert out.output_tokens.tolist() == [[1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
        assert out.recovered.tolist() == [-1, -1, -1] and out.bonus.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
def test_empty_residual_falls_back_to_sampling_the_target(impl):
    # p~ == q == [0.5, 0.5, 0, 0] exactly; uniform = 1.0 forces the (otherwise impossible)
    # rejection, leaving max(0, p~ - q) == 0 everywhere.
    logits = torch.tensor([[0.0, 0.0, NEG_INF, NEG_INF], [0.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    noise = torch.tensor([[1.0, 0.5, 0.1, 0.1], [1.0, 1.0, 1.0, 1.0]])
    out = run(impl, logits, torch.tensor([0]), cu_of([1]), q, greedy=False,
              uniform=torch.ones(1), exp_noise=noise)
    assert out.num_accepted.tolist() == [0]
    assert out.recovered.tolist() == [1]        # argmax(p~ / noise) = 0.5 / 0.5 at token 1


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
def test_draft_outside_the_support_of_q_is_rejected(impl):
    logits = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0]])              # the draft 1 cannot have come from q
    out = run(impl, logits, torch.tensor([1]), cu_of([1]), q, greedy=False,
              uniform=torch.zeros(1), exp_noise=torch.ones(2, 2))
    assert out.num_accepted.tolist() == [0]
    assert out.recovered.tolist() == [1]        # residual max(0, p~ - q) = [0, 0.5]


@pytest.mark.parametrize("impl", ALL_IMPLEMENTATIONS)
def test_output_layout_is_accepted_prefix_then_one_token_then_minus_one(impl):
    batch = random_batch(30, 12, 4, seed=4, sampled_q=True)
    out = run(impl, **batch)
    cu, drafts = batch["cu_num_drafts"], batch["draft_tokens"]
    assert out.output_tokens.shape == (30, 5)
    for i in range(30):
        n, k = int(out.num_accepted[i]), int(cu[i + 1] - cu[i])
        assert 0 <= n <= k
        assert out.output_tokens[i, :n].tolist() == drafts[cu[i]: cu[i] + n].tolist()
        emitted = int(out.recovered[i] if n < k else out.bonus[i])
        assert emitted >= 0 and int(out.output_tokens[i, n]) == emitted
        assert int((out.bonus if n < k else out.recovered)[i]) == -1
        assert (out.output_tokens[i, n + 1:] == -1).all()


def test_requests_without_drafts_emit_only_a_bonus_token():
    logits = torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [5.0, 0.0]])
    out = rejection_sample(logits, torch.tensor([1]), cu_of([0, 1, 0]), greedy=True)
    assert out.output_tokens.tolist() == [[1, -1], [1, 1], [0, -1]]
    assert out.num_accepted.tolist() == [0, 1, 0] and out.bonus.tolist() == [1, 1, 0]
    empty = rejection_sample(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long),
                             torch.zeros(1, dtype=torch.long), greedy=False)
    assert empty.output_tokens.shape == (0, 1)


def test_bad_shapes_are_value_errors():
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(logits, torch.tensor([0, 1, 2]), cu_of([3]), greedy=True)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, torch.tensor([0]), cu_of([1, 0]), torch.zeros(1, 3),
                         greedy=True)
    with pytest.raises(ValueError, match="exp_noise"):
        rejection_sample(logits, torch.tensor([0]), cu_of([1, 0]), greedy=False,
                         exp_noise=torch.ones(1, 4))


# -- losslessness ---------------------------------------------------------------------------

ALPHA = 1e-3     # significance level of each chi-square test; the seeds are fixed
TRIALS = 20_000  # requests, each one independent trial, all in one batched call
VOCAB = 8


def target_of(p: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """p on its support, in float64 and summing to 1 (chisquare checks the totals)."""
    p = p[support].double()
    return p / p.sum()


@pytest.mark.parametrize("case", ["sampled_q", "point_mass", "sampled_q_masked",
                                  "point_mass_masked"])
def test_rejection_sample_preserves_the_target_distribution(case):
    gen = torch.Generator().manual_seed(2024)
    k = 2
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 1.5    # rows: draft 1, draft 2, bonus
    draft_logits = torch.randn(k, VOCAB, generator=gen) * 1.5
    if case.endswith("masked"):
        allowed = torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.bool)
        logits[:, ~allowed] = NEG_INF
        draft_logits[:, ~allowed] = NEG_INF                    # q masked and renormalised
    p = torch.softmax(logits, -1)                               # p~ per position
    q = torch.softmax(draft_logits, -1)
    drafts = torch.multinomial(q.repeat(TRIALS, 1), 1, generator=gen).view(TRIALS, k)
    if case.startswith("point_mass"):
        # a deterministic-looking proposer (q = 1 on its token) that is often wrong
        drafts = torch.where(torch.rand(TRIALS, k, generator=gen) < 0.5,
                             torch.randint(0, VOCAB, (TRIALS, k), generator=gen), drafts)
    out = rejection_sample(
        logits.repeat(TRIALS, 1), drafts.flatten(), torch.arange(0, TRIALS * k + 1, k),
        q.repeat(TRIALS, 1) if case.startswith("sampled_q") else None, greedy=False,
        generator=torch.Generator().manual_seed(7))

    first = torch.bincount(out.output_tokens[:, 0], minlength=VOCAB)
    # the second token, among requests whose first token was an accepted draft
    second = torch.bincount(out.output_tokens[out.num_accepted >= 1, 1], minlength=VOCAB)
    support = p[0] > 0
    assert first[~support].sum() == 0 and second[~support].sum() == 0
    for counts, target in ((first, p[0]), (second, p[1])):
        n = int(counts.sum())
        assert n > 1000
        result = stats.chisquare(counts[support].double(), n * target_of(target, support))
        assert result.pvalue > ALPHA, (case, counts.tolist(), (n * target).tolist())
    # the test has power: it tells the first drafts' own distribution apart from p~
    draft_counts = torch.bincount(drafts[:, 0], minlength=VOCAB)[support].double()
    assert stats.chisquare(draft_counts,
                           draft_counts.sum() * target_of(p[0], support)).pvalue < ALPHA
    assert 0.05 < out.num_accepted.float().mean() / k < 0.95   # both branches exercised
