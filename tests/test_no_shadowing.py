"""No bare name of ours shadows a distribution on PyPI, however the project is run.

``kernels``, ``grammar`` and ``schemas`` are names of PyPI distributions (transformers imports
Hugging Face's ``kernels``). Ours live inside the package, as ``constrained_spec.kernels`` and so
on; a folder of that name at the repository root would be found first by pytest with the root on
``sys.path`` and by ``python -m ...`` started from the root, and would break the dependency that
imports the real one (docs/design.md, "Layout").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("kernels", "grammar", "schemas")

# prints, for each name, the file a bare import of it would run (null when none: not found, or
# only a namespace portion, such as the test folders pytest puts on sys.path; a namespace portion
# never shadows, since any regular package or module of that name further on wins)
_WHERE = """
import importlib.util, json
print(json.dumps({name: getattr(importlib.util.find_spec(name), "origin", None) for name in %r}))
""" % (NAMES,)

# a stand-in for the PyPI distribution of each name, as a dependency would import it
_STAND_IN = """
import importlib, json
print(json.dumps({name: getattr(importlib.import_module(name), "WHO", None) for name in %r}))
""" % (NAMES,)


def _ours(location: str | None) -> bool:
    """Whether ``location`` is a file of this repository (the virtual environment the tests may
    run from sits inside the checkout; what is installed there is not ours)."""
    if not location or location in ("built-in", "frozen"):
        return False
    path = Path(location).resolve()
    return path.is_relative_to(ROOT) and not path.is_relative_to(Path(sys.prefix).resolve())


def _shadowing(where: dict[str, str | None]) -> dict[str, str]:
    return {name: origin for name, origin in where.items() if origin and _ours(origin)}


def test_bare_names_do_not_resolve_to_this_repository_under_pytest() -> None:
    where = {name: getattr(importlib.util.find_spec(name), "origin", None) for name in NAMES}
    assert _shadowing(where) == {}, "bare imports that run a file of this repository"


def test_bare_names_do_not_resolve_to_this_repository_from_the_root() -> None:
    # `python -c` and `python -m` both put the working folder first on sys.path
    out = subprocess.run([sys.executable, "-c", _WHERE], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert _shadowing(json.loads(out.stdout)) == {}, "bare imports from the repository root"


def test_a_distribution_of_the_same_name_is_the_one_imported_from_the_root(tmp_path: Path) -> None:
    for name in NAMES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text('WHO = "the distribution"\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # after the working folder on sys.path
    out = subprocess.run([sys.executable, "-c", _STAND_IN], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == dict.fromkeys(NAMES, "the distribution")


def test_the_package_folders_are_real_folders_inside_the_package() -> None:
    # one mechanism that every tool understands: plain folders, no links, no path mapping
    for name in NAMES:
        folder = ROOT / "constrained_spec" / name
        assert folder.is_dir() and not folder.is_symlink(), folder
        assert (folder / "__init__.py").is_file()
        assert not (ROOT / name).exists(), f"{name}/ at the repository root would shadow PyPI's"


def test_transformers_imports_its_hub_kernels_in_the_test_session() -> None:
    # transformers imports Hugging Face's `kernels` here; a folder of ours named `kernels` first
    # on sys.path made this an ImportError (cannot import name 'CUDAProperties')
    importlib.import_module("transformers.integrations.hub_kernels")
    kernels = sys.modules.get("kernels")
    if kernels is not None:
        assert not _ours(getattr(kernels, "__file__", None)), kernels
