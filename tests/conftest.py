"""Shared fixtures: a tiny random Llama on a character vocabulary, and the embedded model.

Most tests use the tiny model (milliseconds); tests marked ``model`` share ONE loaded
instance of the embedded default model (fetched and converted once, then cached).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "bench"

# A character vocabulary: enough for small JSON objects and regexes. Id 0 is the eos token.
CHARS = ['<eos>', '{', '}', '"', ':', ',', ' ', '[', ']', 'a', 'b', 'c', 'd', 'e', 'n', 'm',
         '0', '1', '2', '3', '4', '5', '6', '7', '8', '9', '-', '.', 't', 'r', 'u', 'f',
         'l', 's', 'ab', '"a', '": ', 'xyz']


def tiny_llama(vocab_size: int = len(CHARS) + 2, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the random distribution a little so greedy paths vary
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_tok():
    from constrained_spec.grammar import TokenizerData

    # logits width is 2 larger than the vocabulary: padded ids must never be allowed
    return TokenizerData.from_tokens(CHARS, eos_token_id=0, vocab_size=len(CHARS) + 2)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model, loaded once for the whole session."""
    from constrained_spec.models import load_model

    return load_model(None, quiet=True)


@pytest.fixture(scope="session")
def embedded_fp32():
    """The embedded model in float32, for exact token-identity checks.

    bf16 GEMMs round differently for different batch shapes, so a batched run can resolve a
    near-tie differently from a single run (with or without speculation); fp32 does not show
    this on the benchmark tasks.
    """
    from constrained_spec.models import load_model

    return load_model(None, dtype="float32", quiet=True)


def load_tasks() -> list[dict]:
    path = BENCH_DIR / "tasks.jsonl"
    if not path.exists():
        pytest.skip(f"benchmark tasks not found at {path} (shared/bench is absent)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
