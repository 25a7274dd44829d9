"""Shared helpers for the reliability tests: the coverage script's machinery, a small tokenizer."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def coverage_mod():
    from benchmarks import coverage

    return coverage


@pytest.fixture(scope="session")
def ascii_tok():
    """Printable ASCII, one token per character (+ eos): grammar checks in milliseconds."""
    from constrained_spec.grammar import TokenizerData

    return TokenizerData.from_tokens(["<eos>"] + [chr(i) for i in range(32, 127)], eos_token_id=0)
