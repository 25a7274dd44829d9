"""Test helpers shared across test folders (not a conftest: several conftest modules exist,
so ``from conftest import ...`` would be ambiguous)."""

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


def load_tasks() -> list[dict]:
    path = BENCH_DIR / "tasks.jsonl"
    if not path.exists():
        pytest.skip(f"benchmark tasks not found at {path} (shared/bench is absent)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
