"""The cache folder: where fetched and converted models, measured plans and built kernels live.

One folder (``CONSTRAINED_SPEC_CACHE``, else the platform's user cache folder), written by many
processes at once and killed at any point: every build goes through `cached_build` (a private
temp folder renamed into place under a lock, with a manifest checked before use). The model
loader and the native kernels both use it; it imports neither.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from constrained_spec.settings import settings

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where fetched and converted models live (``CONSTRAINED_SPEC_CACHE`` overrides)."""
    chosen = settings().cache
    if chosen is not None:
        return chosen
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("constrained_spec"))


# -- the cache under concurrent first use ---------------------------------------------------
# Every build goes into a private temp folder (one per process) and is renamed into place
# under a lock; a finished folder carries a `done` manifest (every file's size, written last)
# that is checked before use, so a half-written or damaged cache is rebuilt instead of failing
# for good. Kill points, and what the next process does (tests/reliability/
# test_cache_kill_points.py kills a process at each one):
#   holding the lock, nothing written   -> the kernel releases the lock; it builds
#   during the build, before `done`     -> the temp folder has no manifest: removed, rebuilt
#   after `done`, before the rename     -> the temp folder is complete: renamed into place
#   after removing a damaged folder     -> the same (adopted; nothing half-removed is trusted)
#   after the rename                    -> the folder is complete: used as it is
_DONE = "done"


# Fault injection, for those tests only: they set this hook in a forked child to kill it at a
# named stage (`fault_point` calls in fetch_default_gguf, _fetch_into and cached_build).
# Production never sets it; a stage costs one global lookup.
_fault_hook: Callable[[str], None] | None = None


def fault_point(stage: str) -> None:
    if _fault_hook is not None:
        _fault_hook(stage)


@contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if missing; advisory, POSIX
    ``flock``; a no-op where it is missing). Released when the holder exits or is killed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished build: its manifest lists every file with its size."""
    try:
        manifest = json.loads((folder / _DONE).read_text())
        files = manifest["files"]
        return bool(files) and all((folder / name).is_file() and (folder / name).stat().st_size == size
                                   for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def cached_build(out: Path, build: Callable[[Path], None]) -> Path:
    """``out``, built once by ``build(tmp)`` into a private temp folder and renamed into place.

    Safe under any interleaving of processes (a lock around check-and-build) and any kill point
    (see the table above: a killed build leaves at most its temp folder, which the next build
    removes, or renames into place when its manifest says it is complete); a damaged folder is
    rebuilt with a warning."""
    if cache_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.with_name(f".{out.name}.lock")):
        fault_point("build.locked")
        if cache_complete(out):  # another process built it while we waited
            return out
        if out.exists():
            logger.warning("the cached folder %s is incomplete or damaged; rebuilding it", out)
        prefix = f".{out.name}.tmp-"
        # a build killed between its manifest and its rename (we hold the lock: its owner is dead)
        finished = next((p for p in out.parent.glob(prefix + "*") if cache_complete(p)), None)
        if finished is not None:
            _replace_folder(finished, out)
        remove_stale(out.parent, prefix)
        if finished is not None:
            return out
        # named by us, not mkdtemp: mkdtemp's mode 0700 would survive the rename, and a cache
        # shared between users (CONSTRAINED_SPEC_CACHE) must keep the umask's permissions
        tmp = out.with_name(f"{prefix}{os.getpid()}-{os.urandom(4).hex()}")
        tmp.mkdir()
        try:
            build(tmp)
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
            fault_point("build.built")
            (tmp / _DONE).write_text(json.dumps({"files": files}))
            fault_point("build.manifest")
            _replace_folder(tmp, out)
            fault_point("build.renamed")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace_folder(new: Path, out: Path) -> None:
    """Rename the finished folder ``new`` to ``out``, removing a damaged ``out`` first (under
    the build's lock). A kill in between leaves ``new`` complete, for the next build to adopt."""
    if out.exists():
        shutil.rmtree(out)
        fault_point("build.old_removed")
    os.replace(new, out)


def remove_stale(parent: Path, prefix: str) -> None:
    """Temp folders and files a killed build left (only called under the build's lock)."""
    for p in parent.glob(prefix + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def write_cached_json(path: Path, values: Any) -> None:
    """Write ``values`` to ``path`` in a converted folder (a private temp file, then renamed:
    the same content whoever writes it, the last rename wins). A read-only cache, or a value
    JSON cannot hold, writes nothing: the reader computes the values again next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(values))
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
