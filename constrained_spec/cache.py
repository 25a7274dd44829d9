"""The cache folder: where fetched and converted models, measured plans and built kernels live.

One folder (``CONSTRAINED_SPEC_CACHE``, else the platform's user cache folder), written by many
processes at once and killed at any point: every build goes through `cached_build` (a private
temp folder renamed into place under a lock, with a manifest checked before use). The model
loader and the native kernels both use it; it imports neither.

The cache is owner-only whatever the umask: every folder this package creates in it is 0700
and every file 0600 (`private_mkdir`, `write_private`, `restrict_tree`, the lock files of
`cache_lock`), because what it holds decides what runs: converted weights and tokenizers,
kernel plans, and the native kernels' shared library (which `kernels.cpu_native` loads only
after its own owner, permission and digest checks). Nothing here changes the process's umask
(a library must not change process state): modes are set explicitly after creation, while the
new file or folder is still unreachable by anyone else. A cache root that someone else owns,
or that group or others can write, is used with a warning (`cache_dir`).

A full disk (or quota) is a `CacheFullError` naming the folder written to, never a bare
``OSError`` or a third party's traceback (`full_disk_as_error`, `cached_build`): the failed
step's temp files are removed as after any other failure, and the error says how much space the
step needs where that is known.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from constrained_spec.errors import CacheFullError, ConfigError
from constrained_spec.settings import settings

logger = logging.getLogger(__name__)

_VARIABLE = "CONSTRAINED_SPEC_CACHE"
_warned_roots: set[Path] = set()  # cache roots already warned about (once per process)


def cache_dir() -> Path:
    """Where fetched and converted models live (``CONSTRAINED_SPEC_CACHE`` overrides), created
    owner-only if missing.

    Raises
    ------
    ConfigError
        The folder is a file, cannot be created or cannot be read (``option`` names
        ``CONSTRAINED_SPEC_CACHE``, the way to choose another).
    """
    chosen = settings().cache
    if chosen is not None:
        root = chosen
    else:
        from platformdirs import user_cache_dir

        root = Path(user_cache_dir("constrained_spec"))
    _check_root(root, chosen is not None)
    return root


def _check_root(root: Path, from_env: bool) -> None:
    """`cache_dir`'s checks of ``root``: usable (a ConfigError otherwise), and a warning, once,
    when someone else could write it."""
    which = f"{_VARIABLE}={root}" if from_env else f"the default cache folder {root}"
    fix = f"set {_VARIABLE} to a folder of your own (it is created if missing)"
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{which} is a file, not a folder: {fix}", option=_VARIABLE)
    try:
        private_mkdir(root)
    except OSError as e:
        raise ConfigError(f"{which} cannot be created ({e.strerror or e}): {fix}",
                          option=_VARIABLE) from e
    if not os.access(root, os.R_OK | os.X_OK):  # a read-only cache is usable (nothing is written)
        raise ConfigError(f"{which} cannot be read (permission denied): {fix}", option=_VARIABLE)
    problem = untrusted_reason(root.stat())
    if problem is not None and root not in _warned_roots:
        _warned_roots.add(root)
        logger.warning(
            "the cache folder %s is %s: whoever can write it can change the models, tokenizers "
            "and kernel plans read from it (the native kernels are checked before use and "
            "rebuilt). Make it owner-only (chmod 700) or %s", root, problem, fix)


# -- owner-only files and folders -----------------------------------------------------------
# Modes are set explicitly after each creation (mkdir's and open's modes are masked by the
# umask, which may be 000): a new folder is made 0700 before anything is put in it, and a new
# file is created 0600 (O_EXCL) in a folder of ours before its bytes are written, so no other
# user can open either in between.

def untrusted_reason(st: os.stat_result) -> str | None:
    """Why a cache file or folder with status ``st`` could have been written by someone other
    than this user: owned by another user, or writable by group or others. None: it could not."""
    if not hasattr(os, "getuid"):  # pragma: no cover - not POSIX: no owner or modes to check
        return None
    if st.st_uid != os.getuid():
        return f"owned by another user (uid {st.st_uid}, this process runs as {os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


def private_mkdir(path: Path) -> None:
    """``path`` and its missing parents created owner-only (0700 whatever the umask). Folders
    that exist already are left as they are. Raises OSError (NotADirectoryError when ``path``
    is something other than a folder)."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # made by another process meanwhile: its mode is its own
            continue
        os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask; set it exactly
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` owner-only (0600) and atomically: a new private temp file
    beside it, renamed over it (the last writer wins; a reader never sees half a file).
    The folder is created owner-only if missing. Raises OSError."""
    private_mkdir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # the umask may have removed the owner's own bits
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def restrict_tree(folder: Path) -> None:
    """Make a finished temp tree owner-only: folders 0700, files 0600. Third-party writers
    (safetensors, transformers' ``save_pretrained``, a compiler) create their files with the
    umask's modes; this runs while the tree is still inside its private (0700) temp folder, so
    no other user can have opened any of them, and before its manifest is written. Symbolic
    links are left alone (their own mode means nothing)."""
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o700)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o600)


# -- a full disk -----------------------------------------------------------------------------
# Writers report a full disk in several forms: Python's own writes as an OSError (ENOSPC, or
# EDQUOT for a quota), safetensors' Rust writer as an exception whose text carries the OS's
# words or code, and a chained exception (a ModelLoadError raised from one) somewhere down its
# causes. All of them are told as one `CacheFullError`.
_FULL_ERRNOS = frozenset(n for n in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if n is not None)
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28",
               "os error 122")
_FIX = ("free some space there, or set CONSTRAINED_SPEC_CACHE to a folder on a disk with room "
        "(it is created if missing)")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, says that a disk or quota is full."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(words in str(e) for words in _FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(folder: Path) -> int | None:
    """Bytes this user may still write on the disk holding ``folder`` (or its nearest existing
    parent: the folder may not be made yet); None when the system does not say."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def cache_full_error(folder: Path, what: str, *, needed: int | None = None,
                     written: int | None = None) -> CacheFullError:
    """The `CacheFullError` for ``what`` (a step, in words: "fetching the embedded model")
    failing for want of space in ``folder``: the space it needs when known (``needed``), or
    at least what it had written when the disk filled (``written``, removed since), and the
    space free there now."""
    free = free_bytes(folder)
    if needed is not None:
        wants = f"{what} needs about {_megabytes(needed)} there"
    elif written:
        wants = (f"{what} had written {_megabytes(written)} when the disk filled (removed "
                 "now) and needs more than that")
    else:
        wants = f"{what} could not write there"
    has = f"; {_megabytes(free)} are free there now" if free is not None else ""
    return CacheFullError(f"no space left in the cache folder {folder} (its disk, or your quota "
                          f"there, is full): {wants}{has}; {_FIX}",
                          folder=folder, needed=needed, free=free)


@contextmanager
def full_disk_as_error(folder: Path, what: str, *, needed: int | None = None) -> Iterator[None]:
    """Within the block, an error that says the disk is full (`disk_full`) becomes the
    `CacheFullError` for ``what`` in ``folder`` (raised from it); other errors pass unchanged.
    What the block leaves half-written is its own to remove (its ``finally`` runs first)."""
    try:
        yield
    except CacheFullError:
        raise
    except Exception as e:
        if disk_full(e):
            raise cache_full_error(folder, what, needed=needed) from e
        raise


def _tree_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 if it is gone)."""
    total = 0
    for p in folder.rglob("*"):
        try:
            total += p.stat(follow_symlinks=False).st_size if p.is_file() else 0
        except OSError:
            continue
    return total


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


# Lock files are removed when their holder is done, whether the build they guard finished or
# failed, so no zero-byte `.lock` stays behind. Unlinking a flock'ed file is only safe with
# both halves of this protocol: (1) a file is unlinked only by the process holding its lock,
# before releasing it; (2) after `flock` returns, the acquirer checks that ``path`` still names
# the file it locked, and starts again on the current file when it does not. A process that
# opened the file and waited while the holder removed it thus never works beside a process
# that locked the new file created at the same path. A holder killed before its unlink leaves
# the file; the next holder locks that same file and removes it when done.

@contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (an owner-only file, created if missing and
    removed on release; advisory, POSIX ``flock``; a no-op where it is missing). Released when
    the holder exits or is killed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    private_mkdir(path.parent)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o600:
                os.fchmod(fd, 0o600)  # created under the umask; flock needs no write access
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _names(path, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed (or replaced) by its holder while we waited: lock the current one
    try:
        yield
    finally:
        try:
            path.unlink()  # under the lock: see the protocol above
        except OSError:
            pass
        # released explicitly: a child forked meanwhile shares the open file, so closing our
        # descriptor alone would not release it
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` is (still) the file open as ``fd``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    st = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


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
    rebuilt with a warning.

    A full disk (or quota) is a `CacheFullError` naming ``out``'s folder and how much the build
    had written when it failed; the temp folder is removed all the same."""
    if cache_complete(out):
        return out
    with full_disk_as_error(out.parent, f"building {out.name}"):
        return _build_locked(out, build)


def _build_locked(out: Path, build: Callable[[Path], None]) -> Path:
    """`cached_build` past its first check: the check again and the build, under the lock."""
    private_mkdir(out.parent)
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
        # owner-only from the start (0700: the folder's mode survives the rename), its tree
        # restricted again once built, before the manifest vouches for it
        tmp = out.with_name(f"{prefix}{os.getpid()}-{os.urandom(4).hex()}")
        private_mkdir(tmp)
        try:
            build(tmp)
            restrict_tree(tmp)
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
            fault_point("build.built")
            write_private(tmp / _DONE, json.dumps({"files": files}))
            fault_point("build.manifest")
            _replace_folder(tmp, out)
            fault_point("build.renamed")
        except Exception as e:
            if disk_full(e) and not isinstance(e, CacheFullError):  # say how far it got
                written = _tree_bytes(tmp)  # (removed by the finally below)
                raise cache_full_error(out.parent, f"building {out.name}", written=written) from e
            raise
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
    """Write ``values`` to ``path`` in a converted folder (`write_private`: owner-only, a
    private temp file then renamed: the same content whoever writes it, the last rename wins).
    A read-only cache, or a value JSON cannot hold, writes nothing: the reader computes the
    values again next time."""
    try:
        write_private(path, json.dumps(values))
    except (OSError, TypeError, ValueError):
        pass


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of ``path``, remembered in the cache by path, size and mtime (a multi-GB file is
    hashed once; where the cache cannot be written, a full disk say, it is hashed each time)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index = cache_dir() / "models" / "digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if ident in known:
        return known[ident]
    digest = file_sha256(path)
    try:
        with cache_lock(index.with_name(".digests.lock")):
            try:
                known = json.loads(index.read_text())
            except (OSError, ValueError):
                known = {}
            known[ident] = digest
            write_private(index, json.dumps(known))
    except OSError as e:  # a full disk or a read-only cache: the digest is right all the same
        logger.info("could not remember the digest of %s in %s (%s): it is computed again next "
                    "time", path, index, e.strerror or e)
    return digest
