"""Shared helpers for the reliability tests: the coverage script's machinery, a small tokenizer.

``benchmarks/coverage.py`` is loaded by path (``benchmarks`` is not a package, and the module
name ``coverage`` belongs to the code-coverage tool).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench_module(name: str):
    key = f"constrained_spec_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def coverage_mod():
    return load_bench_module("coverage")


@pytest.fixture(scope="session")
def ascii_tok():
    """Printable ASCII, one token per character (+ eos): grammar checks in milliseconds."""
    from constrained_spec.grammar import TokenizerData

    return TokenizerData.from_tokens(["<eos>"] + [chr(i) for i in range(32, 127)], eos_token_id=0)
