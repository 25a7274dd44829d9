"""apply_bitmask: the torch path and the Triton kernel (CPU interpreter) against the reference.

The reference is itself checked against the bit-by-bit definition and against
xgrammar.apply_token_bitmask_inplace.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: kernels run on CPU

import subprocess
import sys

import pytest
import torch

from constrained_spec.errors import ConfigError
from constrained_spec.kernels import apply_bitmask, apply_bitmask_reference
from constrained_spec.kernels._backend import resolve_backend, triton_available

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install triton); the Triton "
    "kernels are tested on CPU under TRITON_INTERPRET=1 when it is")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """Random words, with whole words of 0 and -1 mixed in (as grammars produce)."""
    bitmask = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 3, (rows, words), generator=gen)
    bitmask = torch.where(kind == 0, 0, torch.where(kind == 1, -1, bitmask))
    return bitmask.to(torch.int32)


def check_all_backends_match_reference(logits, bitmask, indices=None, backends=("torch",)):
    expected = logits.clone()
    apply_bitmask_reference(expected, bitmask, indices)
    for backend in backends:
        got = logits.clone()
        apply_bitmask(got, bitmask, indices, backend=backend)
        assert torch.equal(got, expected), backend
        assert torch.equal(torch.isneginf(got), torch.isneginf(expected)), backend


def test_apply_bitmask_reference_follows_the_bit_definition():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 70, 4  # 3 words = 96 bits: 26 bits past the vocabulary are ignored
    bitmask = random_bitmask(rows, 3, gen)
    logits = torch.randn(rows, vocab, generator=gen)
    masked = logits.clone()
    apply_bitmask_reference(masked, bitmask)
    for r in range(rows):
        for token in range(vocab):
            allowed = (int(bitmask[r, token // 32]) >> (token % 32)) & 1
            assert masked[r, token] == (logits[r, token] if allowed else float("-inf"))


def test_apply_bitmask_masks_padded_vocab_past_the_bitmask_width():
    logits = torch.zeros(2, 40)
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)  # 32 tokens, all allowed
    for backend in ["torch"] + (["triton"] if triton_available() else []):
        got = logits.clone()
        apply_bitmask(got, bitmask, backend=backend)
        assert torch.equal(got[:, :32], logits[:, :32])
        assert torch.isneginf(got[:, 32:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 49153, 151936])
@pytest.mark.parametrize("extra_words", [-1, 0, 1])
def test_apply_bitmask_torch_matches_reference_on_awkward_shapes(dtype, vocab, extra_words):
    gen = torch.Generator().manual_seed(vocab + extra_words)
    rows = 13
    words = -(-vocab // 32) + extra_words
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    check_all_backends_match_reference(logits, random_bitmask(rows, words, gen))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab", "extra_words"), [
    (2, 49152, 0), (3, 49153, 0), (2, 151936, 0), (1, 151936, -3), (2, 49153, 2),
    (300, 97, 0), (127, 33, 1), (64, 1000, -1),
])
def test_apply_bitmask_triton_matches_reference_on_awkward_shapes(dtype, rows, vocab,
                                                                  extra_words):
    gen = torch.Generator().manual_seed(rows * vocab)
    words = -(-vocab // 32) + extra_words
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    check_all_backends_match_reference(logits, random_bitmask(rows, words, gen),
                                       backends=("triton",))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("vocab", [100, 49153])
def test_apply_bitmask_with_index_map_matches_reference(backend, vocab):
    gen = torch.Generator().manual_seed(vocab)
    requests, rows = 4, 6 * 4  # K + 1 = 6 logits rows per request share a bitmask buffer
    bitmask = random_bitmask(requests * 6 + 3, -(-vocab // 32), gen)
    indices = torch.randperm(requests * 6 + 3, generator=gen)[:rows]
    logits = torch.randn(rows, vocab, generator=gen)
    check_all_backends_match_reference(logits, bitmask, indices, backends=(backend,))
    check_all_backends_match_reference(logits, bitmask, indices.int(), backends=(backend,))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_allowed_none_allowed_and_single_allowed_masks(backend, dtype):
    vocab = 49153
    words = -(-vocab // 32)
    logits = torch.randn(3, vocab).to(dtype)
    bitmask = torch.zeros(3, words, dtype=torch.int32)
    bitmask[0] = -1                                    # everything allowed
    single = 32 * 1000 + 31
    bitmask[2, 1000] = -2**31                          # bit 31 only: the sign bit
    got = logits.clone()
    apply_bitmask(got, bitmask, backend=backend)
    assert torch.equal(got[0], logits[0])
    assert torch.isneginf(got[1]).all()
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [single]
    assert got[2, single] == logits[2, single]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_infinite_logits_are_masked_or_kept_like_any_other(backend):
    logits = torch.tensor([[float("inf"), float("inf"), float("-inf"), -0.0] + [1.0] * 28])
    bitmask = torch.tensor([[0b1010]], dtype=torch.int32)   # tokens 1 and 3 allowed
    apply_bitmask(logits, bitmask, backend=backend)
    assert logits[0, :4].tolist() == [float("-inf"), float("inf"), float("-inf"), 0.0]
    assert torch.isneginf(logits[0, 4:]).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_apply_bitmask_masks_strided_logits_in_place(backend):
    gen = torch.Generator().manual_seed(1)
    storage = torch.randn(5, 3000, generator=gen)
    logits = storage[:, :2500]                         # row stride 3000, vocab 2500
    bitmask = random_bitmask(5, 79, gen)
    expected = logits.clone()
    apply_bitmask_reference(expected, bitmask)
    before = storage.clone()
    apply_bitmask(logits, bitmask, backend=backend)
    assert torch.equal(storage[:, :2500], expected)
    assert torch.equal(storage[:, 2500:], before[:, 2500:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 49153, 128256])
def test_apply_bitmask_agrees_with_xgrammar_on_cpu(dtype, vocab):
    xgrammar = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(vocab)
    # xgrammar leaves columns past the bitmask width alone and indexes logits and bitmask
    # rows together, so compare where the conventions meet: words >= ceil(V / 32), and our
    # index map against xgrammar on the gathered bitmask rows.
    bitmask = random_bitmask(8, -(-vocab // 32), gen)
    indices = torch.tensor([0, 0, 3, 7, 7, 7])
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    ours = logits.clone()
    apply_bitmask(ours, bitmask, indices)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask[indices].contiguous())
    assert torch.equal(ours, theirs)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask_reference(ours, bitmask[:6])
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask[:6].contiguous())
    assert torch.equal(ours, theirs)


def test_auto_backend_uses_torch_on_cpu_and_rejects_unknown_names():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ConfigError, match="backend"):
        apply_bitmask(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32), backend="cuda")


@needs_triton
def test_triton_backend_on_cpu_without_interpreter_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        apply_bitmask(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32),
                      backend="triton")


def test_bad_shapes_and_dtypes_are_value_errors():
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_bitmask(torch.zeros(3, 32), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="indices"):
        apply_bitmask(torch.zeros(3, 32), torch.zeros(2, 1, dtype=torch.int32),
                      torch.tensor([0, 1]))


def test_kernels_import_and_run_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from constrained_spec.kernels import apply_bitmask, rejection_sample\n"
            "x = torch.zeros(2, 64)\n"
            "apply_bitmask(x, torch.tensor([[-1, 0], [-1, 0]], dtype=torch.int32))\n"
            "assert torch.isneginf(x[:, 32:]).all() and not torch.isinf(x[:, :32]).any()\n"
            "out = rejection_sample(x, torch.tensor([3]), torch.tensor([0, 1]), greedy=True)\n"
            "assert out.num_accepted.tolist() == [0]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=120)
    assert result.returncode == 0, result.stderr
