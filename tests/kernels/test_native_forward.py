"""The one-call native decode / verify forward (`kernels.native_forward`, ``cs_forward``)
against the lean runner's torch layers, which stay the reference.

Every family of tests/engine/test_runner_families.py (tiny random models, weights made exactly
4-bit so every linear runs on the packed q4 kernel) decodes and verifies on both paths:

- the native path really runs (its call is counted), and its logits equal the torch path's
  within `TOLERANCE` of the logits' scale (measured on these models: equal to the bit);
- its verify rows, and the same rows batched with other requests of other lengths, have the
  bits of 1-row decodes (row invariance: greedy speculation on and off stays identical);
- the hidden states kept for feature drafters are the torch path's;
- a runner whose linears are not all packed (dense bf16) runs the torch layers;
- on the embedded model, greedy decodes of both paths agree within `EMBEDDED_TOLERANCE` and
  pick the same tokens, and its verify rows are 1-row decodes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# the family builders of tests/engine (as tests/app does for its engine helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_runner_families import FAMILIES, feature_layers, tiny_family  # noqa: E402
from test_runner_int4 import q4_1  # noqa: E402

from constrained_spec.kernels import native_forward  # noqa: E402
from constrained_spec.model.plan import KernelPlan  # noqa: E402
from constrained_spec.model.runner import LeanRunner, exact_4bit_groups  # noqa: E402
from constrained_spec.model.weights import Q8Groups  # noqa: E402

pytestmark = pytest.mark.skipif(not native_forward.available(),
                                reason="the native kernels do not build on this machine")
CPU = torch.device("cpu")
# |native - torch| <= TOLERANCE * max |torch logit| on the tiny models: both round to bf16 at
# the same points and only float32 sum orders differ (measured: 0 on both builds; one rounding
# point left out, e.g. RoPE's products kept in float32, moves them by ~1%) ...
TOLERANCE = 0.002
# ... and on the embedded model (30 layers of 576, where a norm's sum of squares in another order
# than torch's flipped bf16 roundings: 0.23 on logits of scale ~36 before the native norm took
# torch's order; measured now: 0)
EMBEDDED_TOLERANCE = 0.002


def four_bit(name: str):
    """A tiny model of family ``name`` whose linears (not the embeddings / LM head) are
    exactly 4-bit, as a Q4_1 file leaves them."""
    model = tiny_family(name)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in pname and "lm_head" not in pname:
                p.copy_(q4_1(p))
    return model


_MODELS: dict[str, object] = {}


def model_of(name: str):
    if name not in _MODELS:
        _MODELS[name] = four_bit(name)
    return _MODELS[name]


def runner(model, *, native: bool, groups: bool = True) -> LeanRunner:
    g = exact_4bit_groups(model) if groups else None
    if groups and g is None:
        pytest.skip("no CPU int4 kernel in this torch build (exact 4-bit groups need it)")
    r = LeanRunner(model, dtype=torch.bfloat16, device=CPU, groups=g)
    kernel = "q4" if groups else "bf16"
    r.set_plan(KernelPlan(prefill=kernel, decode=[(1 << 30, kernel)], lm_head="bf16"))
    r.native_forward = native
    return r


@pytest.fixture
def native_calls(monkeypatch) -> Iterator[list[int]]:
    """Rows of each native forward call made during the test."""
    calls: list[int] = []
    real = native_forward.NativeForward.__call__

    def counted(self, x, *args, **kwargs):
        calls.append(int(x.shape[0]))
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(native_forward.NativeForward, "__call__", counted)
    yield calls


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_and_verify(r: LeanRunner, prompt: list[int], drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of 1-row decodes of ``drafts`` after ``prompt``, and of one verify of them all."""
    s = r.new_slot()
    r.forward([s], [prompt], [0])
    decodes = torch.cat([r.forward([s], [[t]], [1]) for t in drafts])
    r.truncate(s, len(prompt))
    verify = r.forward([s], [drafts], [len(drafts)])
    r.free_slot(s)
    return decodes, verify


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_native_logits_match_the_torch_path(name, native_calls):
    model = model_of(name)
    V = model.config.vocab_size
    prompt, drafts = tokens(V, 20, 1), tokens(V, 6, 2)
    want, _ = decode_and_verify(runner(model, native=False), prompt, drafts)
    assert native_calls == []  # the torch path when asked for
    got, _ = decode_and_verify(runner(model, native=True), prompt, drafts)
    assert native_calls == [1] * 6 + [6]  # every decode / verify forward, one call each
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()


@pytest.mark.parametrize("name", FAMILIES)
def test_native_verify_and_batched_rows_equal_one_row_decodes(name, native_calls):
    model = model_of(name)
    V = model.config.vocab_size
    r = runner(model, native=True)
    # phi3's longrope switches factors at position 8: the prompt is past it
    prompt, drafts = tokens(V, 30, 3), tokens(V, 7, 4)
    decodes, verify = decode_and_verify(r, prompt, drafts)
    assert torch.equal(verify, decodes)
    # the same verify among a shorter and a longer request, each verifying fewer rows
    short, mine, long_ = r.new_slot(), r.new_slot(), r.new_slot()
    r.forward([short, mine, long_], [prompt[:9], prompt, prompt + tokens(V, 40, 5)], [0, 0, 0])
    logits = r.forward([short, mine, long_], [drafts[:1], drafts, drafts[:3]], [1, 7, 3])
    assert torch.equal(logits[1:8], decodes)
    assert native_calls[-1] == 1 + 7 + 3  # the real rows only (no padding), in one call


def test_a_request_batched_with_shorter_ones_keeps_the_features_it_keeps_alone(native_calls):
    model = model_of("llama3")
    V = model.config.vocab_size
    layers = feature_layers(model.config)
    r = runner(model, native=True)
    r.enable_features(layers)
    prompt, drafts = tokens(V, 12, 6), tokens(V, 5, 7)
    alone = r.new_slot()
    r.forward([alone], [prompt], [0])
    r.forward([alone], [drafts], [5])
    other, mine = r.new_slot(), r.new_slot()
    r.forward([other, mine], [prompt[:3], prompt], [0, 0])
    r.forward([other, mine], [drafts[:1], drafts], [1, 5])
    assert native_calls[-1] == 1 + 5
    assert torch.equal(r.features(mine, 12, 17, layers), r.features(alone, 12, 17, layers))


@pytest.mark.parametrize("name", ["llama3", "gemma2", "qwen3"])
def test_native_kept_features_equal_the_torch_paths(name, native_calls):
    model = model_of(name)
    V = model.config.vocab_size
    layers = feature_layers(model.config)
    got = []
    for native in (True, False):
        r = runner(model, native=native)
        r.enable_features(layers)
        s = r.new_slot()
        r.forward([s], [tokens(V, 12, 6)], [0])
        r.forward([s], [tokens(V, 4, 7)], [4])
        got.append(r.features(s, 12, 16, layers))
    assert native_calls == [4]
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_a_linear_in_8_bit_groups_of_16_runs_in_the_native_call(name, native_calls):
    """A Q6_K matrix (int8 values in -32..31, a float32 scale per 16 inputs, no min) beside the
    4-bit ones, as a Q4_K_M file's ffn_down: the native call takes it, equal to the torch
    path and row-invariant."""
    import copy

    model = copy.deepcopy(model_of(name))
    down = model.model.layers[0].mlp.down_proj.weight
    g = torch.Generator().manual_seed(9)
    q8 = Q8Groups(torch.randint(-32, 32, tuple(down.shape), generator=g).to(torch.int8),
                  torch.rand(down.shape[0], down.shape[1] // 16, generator=g) * 0.02 + 1e-3)
    with torch.no_grad():
        down.copy_(q8.dequantize())

    def make(native: bool) -> LeanRunner:
        groups = exact_4bit_groups(model)
        if groups is None:
            pytest.skip("no CPU int4 kernel in this torch build")
        r = LeanRunner(model, dtype=torch.bfloat16, device=CPU, groups={**groups, "0.down": q8})
        r.set_plan(KernelPlan(prefill="q4", decode=[(1 << 30, "q4")], lm_head="bf16"))
        r.native_forward = native
        return r

    V = model.config.vocab_size
    prompt, drafts = tokens(V, 20, 5), tokens(V, 6, 6)
    want, _ = decode_and_verify(make(False), prompt, drafts)
    r = make(True)
    got, verify = decode_and_verify(r, prompt, drafts)
    assert native_calls == [1] * 6 + [6]
    assert r.layers[0].down._pack("q8").group == 16
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
    assert torch.equal(verify, got)


def test_a_runner_with_dense_linears_runs_the_torch_layers(native_calls):
    model = model_of("llama3")
    r = runner(model, native=True, groups=False)
    decodes, verify = decode_and_verify(r, tokens(model.config.vocab_size, 10, 8), [5, 6, 7])
    assert native_calls == []
    assert torch.equal(decodes, verify)


def greedy_logits(r: LeanRunner, prompt: list[int], steps: int, *, native: bool,
                  follow: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``steps`` greedy 1-row decodes after ``prompt`` (the tokens chosen from
    ``follow``'s rows when given, so that both paths decode the same tokens)."""
    r.native_forward = native
    s = r.new_slot()
    try:
        r.forward([s], [prompt], [0])
        tok, rows = prompt[-1], []
        for k in range(steps):
            rows.append(r.forward([s], [[tok]], [1]))
            tok = int((rows[-1] if follow is None else follow[k]).argmax())
        return torch.cat(rows)
    finally:
        r.free_slot(s)
        r.native_forward = True


@pytest.mark.model
def test_the_embedded_model_native_logits_follow_the_torch_path(embedded, native_calls, monkeypatch):
    r = embedded.runner
    assert r.native_forward
    # the bf16 products, which the torch path computes too (int8 activations, the default,
    # are compared with these in test_int8_activations.py)
    monkeypatch.setattr(r, "int8_activations", False)
    for seed in range(4):  # (a norm summed in another order than torch's fails seed 0)
        prompt = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        got = greedy_logits(r, prompt, 12, native=True)
        want = greedy_logits(r, prompt, 12, native=False, follow=got)
        assert (got - want).abs().max() <= EMBEDDED_TOLERANCE * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert native_calls == [1] * 12 * 4
    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    decodes, verify = decode_and_verify(r, prompt, prompt[-7:])
    assert torch.equal(verify, decodes)
