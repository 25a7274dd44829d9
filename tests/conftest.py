"""Shared fixtures: a tiny random Llama on a character vocabulary, and the embedded model.

Most tests use the tiny model (milliseconds); tests marked ``model`` share ONE loaded
instance of the embedded default model (fetched and converted once, then cached).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# the suite runs the default, the exact (row-invariant) runner on the CPU, whose guarantees
# the losslessness tests check token for token; a CONSTRAINED_SPEC_EXACT left in the caller's
# environment would change that. Cleared before anything reads the settings.
os.environ.pop("CONSTRAINED_SPEC_EXACT", None)
from cs_testlib import CHARS, tiny_llama

from constrained_spec.settings import reload_settings


def _load_benchmarks() -> None:
    """The benchmark scripts as the package ``benchmarks``, loaded from their folder by path.

    The repository root is deliberately not on ``sys.path``: there every folder would be
    importable by its bare name, and a bare name of ours must never shadow a distribution a
    dependency imports (tests/test_no_shadowing.py)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location(
        "benchmarks", folder / "__init__.py", submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = module
    spec.loader.exec_module(module)


_load_benchmarks()


@pytest.fixture
def cs_env() -> Iterator[Callable[..., None]]:
    """Set (a string) or unset (``None``) environment variables for one test, and re-read the
    settings each time (`constrained_spec.settings` reads the environment once and keeps it):
    ``cs_env(CONSTRAINED_SPEC_MEMORY="lean", CONSTRAINED_SPEC_PLAN=None)``. A bad value raises
    its `ConfigError` from the call. The variables and the settings are restored afterwards.

    (``monkeypatch.setenv`` alone would change the environment without the settings seeing it,
    and its undo runs after this fixture's teardown, so this fixture restores by itself.)
    """
    saved: dict[str, str | None] = {}

    def set_env(**values: str | None) -> None:
        for name, value in values.items():
            saved.setdefault(name, os.environ.get(name))
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_settings()

    yield set_env
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    reload_settings()


@pytest.fixture(scope="session")
def tiny_tok():
    from constrained_spec.grammar import TokenizerData

    # logits width is 2 larger than the vocabulary: padded ids must never be allowed
    return TokenizerData.from_tokens(CHARS, eos_token_id=0, vocab_size=len(CHARS) + 2)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_loaded():
    """A LoadedModel over a tiny random Llama and a byte-level BPE: the public API and the
    server on any text, milliseconds per token."""
    from cs_testlib import tiny_loaded_model

    return tiny_loaded_model()


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model, loaded once for the whole session."""
    from constrained_spec.model.loading import load_model

    return load_model(None, quiet=True)


@pytest.fixture(scope="session")
def embedded_fp32():
    """The embedded model in float32, for exact token-identity checks.

    bf16 GEMMs round differently for different batch shapes, so a batched run can resolve a
    near-tie differently from a single run (with or without speculation); fp32 does not show
    this on the benchmark tasks.
    """
    from constrained_spec.model.loading import load_model

    return load_model(None, dtype="float32", quiet=True)
