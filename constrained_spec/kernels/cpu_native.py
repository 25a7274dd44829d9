"""Few-row products with a GGUF file's own 4-bit and 8-bit groups on an x86 CPU: the ``q4``
and ``q8`` kernels.

torch's CPU int4 weight-only kernel (``_weight_int4pack_mm_for_cpu``, the plan's ``int4``)
dequantizes to float32 and multiplies with float32 FMAs, rounds the group scales to bfloat16
and costs much more for a 7-row verify than for a 1-row decode. ``q4`` (``cpu_native.c``) is a
small C kernel built for this CPU at first use:

- on AVX-512-BF16 CPUs it turns the 4-bit values into bfloat16 (exact: 0..15) and multiplies
  with ``vdpbf16ps`` (products exact, fp32 sums), 8 rows per read of a weight tile;
- on AVX2 + FMA CPUs it converts them to float32 and multiplies with FMAs, 4 rows per read;
- per group of `GROUP` inputs it applies the file's scale and min in float32 (not rounded to
  bfloat16): ``y += scale * (x . q) + min * sum(x)``.

``q8`` is the same for int8 values (``y += scale * (x . q)``, plus ``min * sum(x)`` when the
groups carry mins): the 8-, 6- and 5-bit GGUF types, whose values are exact in int8, and a
4-bit type's values beside them in one fused matrix. Which GGUF types reach which kernel is
their row of ``constrained_spec.model.quant.TYPES``; the kernels themselves take groups of
the sizes in `GROUPS` (`GROUP` inputs for both, and `GROUP16` without mins for q8 -- Q6_K's
16-wide sub-blocks: `supports`). Both hold a weight as a
`GroupPack`.

Speed against torch's kernels, per build: benchmarks/RESULTS.md, "Native CPU kernels against
torch's (avx512bf16 build)" and "(avx2 build)" (`benchmarks/native_kernels.py`); their error
against the float32 product of the dequantized weights is a small fraction of torch's int4
kernel's (bf16 out).

A row's bits do not depend on the other rows of a call (each row has its own accumulators and
the same instruction sequence), so ``q4`` and ``q8`` are row-invariant
(`weights.ROW_INVARIANT_KERNELS`, tested). Which build runs follows the CPU flags AND torch's
capability, so the AVX2-only simulation (``ATEN_CPU_CAPABILITY=avx2``) gets the AVX2 build.
Built with the C compiler (``$CC``, a command line such as ``ccache gcc``, else ``cc``; 120 s
per attempt) and OpenMP into the cache folder's owner-only ``kernels/`` (``CONSTRAINED_SPEC_CACHE``),
keyed by the source and the build, with a manifest recording its sha256; it is loaded only when
it, its manifest and the folder are this user's alone and the digest matches (else rebuilt,
with a warning: see "building and loading the library" below). Without a compiler, on
another architecture or when the build fails, `available` is False (`why_unavailable` says
why) and the plan never offers ``q4`` or ``q8`` (torch's kernels run instead). Threads: the
library uses the OpenMP runtime torch already loaded, so ``torch.set_num_threads`` applies to it.
The same library holds the exact decode attention (`attention`) and the whole decode / verify
layer stack in one call (``cs_forward``: `forward_function`, driven by `native_forward`).
The library also multiplies 4-bit packs with int8 activations (`matmul`'s ``int8_act``,
`int8_activations`): with the CPU's integer dot products where it has them (AVX-512-VNNI, or
AVX-VNNI on the AVX2 build: `VNNI`, compiled in only there), elsewhere with byte pairs
(``vpmaddubsw``, as llama.cpp's AVX2 path), which give the same integers (`int8_instructions`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per group: cpu_native.c's GROUP
GROUP16 = 16  # cpu_native.c's Q8_GROUP16: the q8 kernel's groups of 16 (GGUF's Q6_K), no mins
# the group sizes each kernel takes, by the bits of its values (q4: 4, q8: 8)
GROUPS: dict[int, tuple[int, ...]] = {4: (GROUP,), 8: (GROUP, GROUP16)}
SOURCE = Path(__file__).with_name("cpu_native.c")
# build -> (CPU flags it needs, compiler flags, columns per tile)
# (amx: the avx512bf16 build with its 4-bit products on AMX tiles, `amx_permitted`)
BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], int]] = {
    "amx": (("avx512f", "avx512bw", "avx512_bf16", "fma", "amx_tile", "amx_bf16"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile",
             "-mamx-bf16"), 16),
    "avx512bf16": (("avx512f", "avx512bw", "avx512_bf16", "fma"),
                   ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"), 16),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), 8),
}
_CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-std=c11")
# build -> (CPU flag, compiler flag) of its integer dot products (the q4 kernel with int8
# activations, ``cs_q4i8_gemm``): compiled in only where this CPU has them, so the library of
# a CPU without them never faults (its int8 kernel takes byte pairs, the same integers)
VNNI: dict[str, tuple[str, str]] = {"amx": ("avx512_vnni", "-mavx512vnni"),
                                    "avx512bf16": ("avx512_vnni", "-mavx512vnni"),
                                    "avx2": ("avx_vnni", "-mavxvnni")}


def _build_flags(build: str) -> tuple[str, ...]:
    """The compiler flags of ``build`` on this CPU: `BUILDS`' and, where the CPU has them, its
    integer dot products' (`VNNI`)."""
    cpu_flag, cc_flag = VNNI[build]
    return BUILDS[build][1] + ((cc_flag,) if cpu_flag in _cpu_flags() else ())


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: a CPU with them (``amx_tile``, ``amx_bf16``) and
    a Linux kernel that grants the request for their state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, once per process). A VM that does not enable AMX refuses it; a tile
    instruction without it would kill the process, so the amx build is never loaded then."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" \
            or not {"amx_tile", "amx_bf16"} <= _cpu_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(158, 0x1023, 18)) == 0  # SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        return False


def _runs_here(build: str) -> str | None:
    """Why ``build``'s library cannot run on this CPU (None: it can): a CPU flag it needs, or
    for the amx build the OS's grant of the tiles (`amx_permitted`)."""
    missing = [f for f in BUILDS[build][0] if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if build == "amx" and not amx_permitted():
        return "the operating system does not grant this process AMX tiles"
    return None


@functools.cache  # asked on every weight multiply (Linear.supports)
def build_for_this_cpu() -> str | None:
    """The build this machine runs: ``amx``, ``avx512bf16``, ``avx2`` or None. torch's
    capability caps it (``ATEN_CPU_CAPABILITY=avx2`` simulates an AVX2-only CPU for torch and
    for this)."""
    from constrained_spec.settings import settings

    flags = _cpu_flags()
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512") and settings().amx and _runs_here("amx") is None:
        return "amx"
    if cap.startswith("AVX512") and all(f in flags for f in BUILDS["avx512bf16"][0]):
        return "avx512bf16"
    if cap.startswith(("AVX2", "AVX512")) and all(f in flags for f in BUILDS["avx2"][0]):
        return "avx2"
    return None


# -- building and loading the library ------------------------------------------------------
# The library is executed code read from the cache folder, so it is loaded only when this user
# alone could have written it: the kernels folder and the file owned by this user and not
# writable by group or others, and the file's sha256 equal to the one recorded in a manifest
# (owner-only too) written when this library built it. Anything else is warned about (naming
# the file) and rebuilt. A kernels folder of this user's that others could write is made
# owner-only and its libraries dropped; one someone else owns is not used at all (torch's
# kernels run).
# The check and the load read the same bytes: the verified library is copied, hashing what is
# written, into a new file (O_EXCL, 0600) in the owner-only folder, reached through a
# descriptor of that folder (/proc/self/fd/N/<copy>, so a folder renamed or swapped meanwhile
# does not matter), and that copy is what dlopen maps (then unlinked; a unique name also keeps
# dlopen from handing back a library loaded earlier under the same name). What remains: a
# process running as this user, or root, can change the library at any time (out of scope:
# it can run code as this user anyway); a cache that is read-only to this user cannot hold the
# copy, so its kernels are not loaded (torch's run); without /proc the copy is loaded by its
# path, which goes through the folder's parents again.

# seconds per compiler attempt: a build takes a second or two; a hung compiler must not hold
# up the first load
_TIMEOUT = 120
_why: dict[str, str] = {}  # build -> why its kernels are not available (set by `_library`)


class _Refused(Exception):
    """A cached library (or its manifest) failed a check or did not load; says which and why."""


def _key(build: str) -> str:
    return hashlib.sha256(SOURCE.read_bytes()
                          + repr((_CFLAGS, BUILDS[build], _build_flags(build))).encode()).hexdigest()[:16]


def _compiler() -> tuple[list[str] | None, str]:
    """``$CC`` as a command line (``CC="ccache gcc"``), else ``cc``; None (and the reason)
    when it is not one or its first word is not found."""
    raw = os.environ.get("CC", "").strip() or "cc"
    try:
        words = shlex.split(raw)
    except ValueError as e:
        return None, f"CC={raw!r} is not a command line ({e})"
    if not words or shutil.which(words[0]) is None:
        return None, f"no C compiler ({raw})"
    return words, raw


def _run_compiler(cc: list[str], build: str, out: Path) -> str | None:
    """Compile the library for ``build`` to ``out``; None when built, else why not."""
    base = [*cc, *_CFLAGS, *_build_flags(build), str(SOURCE), "-o", str(out), "-lm"]
    n, last = len(cc), ""
    # OpenMP for the threads (torch's runtime, already loaded); without it, one thread
    for cmd in (base[:n] + ["-fopenmp"] + base[n:], base):
        try:  # its own session: a timeout stops the driver and the compiler passes it started
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
        except OSError as e:
            logger.warning("building the q4 / q8 kernels with %s failed: %s", " ".join(cc), e)
            return f"the build failed: {e}"
        try:
            _, err = proc.communicate(timeout=_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            logger.warning("the C compiler (%s) ran over %d s building the q4 / q8 kernels and was "
                           "stopped: torch's kernels run", " ".join(cc), _TIMEOUT)
            return f"the build timed out: {' '.join(cc)} ran over {_TIMEOUT} s"
        if proc.returncode == 0:
            return None
        last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        logger.info("building the q4 kernel with %s failed: %s", " ".join(cmd), err[-2000:])
    logger.warning("the q4 kernel could not be built (see the log at INFO): torch's kernels run")
    return f"the build failed: {last}"


def _compile(build: str, folder: Path, name: str) -> str | None:
    """Build ``folder/name.so`` and its manifest (under the caller's lock); None when built,
    else why not. The compiler writes into a private temp folder, so its output (made with the
    umask's mode) is never reachable by anyone else before it is 0600 and hashed."""
    from constrained_spec.cache import file_sha256, private_mkdir, restrict_tree, write_private

    cc, raw = _compiler()
    if cc is None:
        logger.info("%s: the q4 / q8 kernels are not available", raw)
        return raw
    tmp = folder / f".{name}.build-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        private_mkdir(tmp)
        built = tmp / f"{name}.so"
        failed = _run_compiler(cc, build, built)
        if failed is not None:
            return failed
        restrict_tree(tmp)
        manifest = {"sha256": file_sha256(built), "build": build, "key": name.rsplit("-", 1)[1]}
        (folder / f"{name}.json").unlink(missing_ok=True)
        os.replace(built, folder / f"{name}.so")
        write_private(folder / f"{name}.json", json.dumps(manifest))
        return None
    except OSError as e:
        logger.warning("building the q4 / q8 kernels in %s failed: %s", folder, e)
        return f"the build failed: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kernels_folder(folder: Path) -> str | None:
    """Why ``folder`` cannot hold the library (None: it can). A folder of this user's that
    group or others could write is made owner-only and the libraries in it are dropped (they
    could have been swapped while it was open); one owned by someone else is not used."""
    from constrained_spec.cache import private_mkdir, untrusted_reason

    try:
        private_mkdir(folder)
        st = os.lstat(folder)
    except OSError as e:
        return f"not usable ({e})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    problem = untrusted_reason(st)
    if problem is None:
        return None
    if st.st_uid != os.getuid():
        return problem
    try:
        os.chmod(folder, 0o700)
        for p in folder.glob("cpu_native-*"):  # the final files only: temp files stay private
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    except OSError as e:
        return f"{problem} and could not be made owner-only ({e})"
    logger.warning("the native kernels' folder %s was %s: made owner-only; the libraries it held "
                   "are not trusted and are built again", folder, problem)
    return None


def _open_checked(dfd: int, name: str, what: str) -> int:
    """``name`` in the folder open as ``dfd``, opened for reading (not through a link) once it
    is a regular file only this user could have written; else `_Refused`."""
    from constrained_spec.cache import untrusted_reason

    subject = "it" if what == "library" else f"its {what} {name}"
    try:
        # O_NONBLOCK: a FIFO in its place is refused below instead of blocking the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise _Refused(f"it has no {what} ({name})" if what != "library" else "it is missing") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise _Refused(f"{subject} cannot be opened ({e.strerror})") from e
    st = os.fstat(fd)
    problem = "not a regular file" if not stat.S_ISREG(st.st_mode) else untrusted_reason(st)
    if problem is not None:
        os.close(fd)
        raise _Refused(f"{subject} is {problem}")
    return fd


def _recorded_digest(dfd: int, name: str, build: str) -> str:
    """The sha256 the manifest ``name.json`` records for ``name.so``; else `_Refused`."""
    fd = _open_checked(dfd, f"{name}.json", "manifest")
    try:
        with os.fdopen(fd, "rb") as f:
            manifest = json.loads(f.read(1 << 16))
        digest = manifest["sha256"]
        if manifest["build"] != build or not (isinstance(digest, str) and len(digest) == 64):
            raise ValueError("not this build's")
        int(digest, 16)
        return digest
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Refused(f"its manifest {name}.json does not record its digest ({e})") from e


def _copy_hashed(dfd: int, src_name: str, dst_name: str) -> str:
    """Copy ``src_name`` (checked by `_open_checked`) to the new owner-only file ``dst_name``
    in the same folder; the sha256 of the bytes written."""
    src = _open_checked(dfd, src_name, "library")
    try:
        out = os.open(dst_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dfd)
        h = hashlib.sha256()
        with os.fdopen(out, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # readable by us whatever the umask
            while chunk := os.read(src, 1 << 20):
                h.update(chunk)
                f.write(chunk)
        return h.hexdigest()
    finally:
        os.close(src)


def _bind(lib: ctypes.CDLL, build: str) -> tuple[ctypes.CDLL, int]:
    """Declare the kernels' signatures; `_Refused` when a symbol is missing or the library's
    tiles are not the build's."""
    vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    try:
        lib.cs_q4_tile.restype = i
        lib.cs_q4_gemm.argtypes = [vp, i, i, i, vp, i, vp, i]
        lib.cs_q4_gemm.restype = i
        lib.cs_q8_gemm.argtypes = [vp, i, i, i, vp, i, i, i, vp, i]
        lib.cs_q8_gemm.restype = i
        lib.cs_attention.argtypes = [vp, vp, vp, i, vp, vp, vp, i, i, i, i, f, f, vp]
        lib.cs_attention.restype = i
        lib.cs_attention_width.restype = i
    except AttributeError as e:  # "<path>: undefined symbol: cs_..."
        raise _Refused(f"it lacks a kernel ({': '.join(str(e).rsplit(': ', 2)[-2:])})") from e
    # the one-call decode / verify forward (native_forward.py, which mirrors its structs): a
    # library without it still runs the kernels above, and the runner its torch forward
    if hasattr(lib, "cs_forward"):
        lib.cs_forward.argtypes = [vp, vp, i, vp, vp, vp, i, vp, vp, vp]
        lib.cs_forward.restype = i
    # the q4 kernel with int8 activations (`int8_activations`): likewise optional
    if hasattr(lib, "cs_vnni") and hasattr(lib, "cs_q4i8_gemm"):
        lib.cs_vnni.restype = i
        lib.cs_q4i8_gemm.argtypes = [vp, i, i, i, vp, i, vp, i]
        lib.cs_q4i8_gemm.restype = i
    tile = int(lib.cs_q4_tile())
    if tile != BUILDS[build][2]:
        raise _Refused(f"its tiles have {tile} columns, not {BUILDS[build][2]}")
    return lib, tile


def _load_checked(folder: Path, name: str, build: str) -> tuple[ctypes.CDLL, int]:
    """``folder/name.so`` loaded after every check (see the comment above); else `_Refused`."""
    from constrained_spec.cache import untrusted_reason

    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _Refused(f"its folder cannot be opened ({e.strerror})") from e
    try:
        problem = untrusted_reason(os.fstat(dfd))  # the folder opened: checked again, by its fd
        if problem is not None:
            raise _Refused(f"its folder is {problem}")
        digest = _recorded_digest(dfd, name, build)
        copy = f".{name}.load-{os.getpid()}-{os.urandom(4).hex()}.so"
        try:
            got = _copy_hashed(dfd, f"{name}.so", copy)
            if got != digest:
                raise _Refused(f"its sha256 is not the one its manifest records ({got[:16]}..., "
                               f"recorded {digest[:16]}...)")
            via_fd = f"/proc/self/fd/{dfd}/{copy}"  # this folder, whatever its path names now
            try:
                lib = ctypes.CDLL(via_fd if os.path.exists(via_fd) else str(folder / copy))
            except OSError as e:
                raise _Refused(f"it cannot be loaded ({e})") from e
        finally:
            try:
                os.unlink(copy, dir_fd=dfd)  # mapped now: the copy's bytes stay until exit
            except OSError:
                pass
    finally:
        os.close(dfd)
    return _bind(lib, build)


def _load_or_build(build: str, folder: Path, name: str) -> tuple[ctypes.CDLL, int] | None:
    """Under the library's lock: the cached library if it passes every check, else a new build
    (with a warning naming the file that failed); None when neither (`_why` says why)."""
    from constrained_spec.cache import remove_stale

    so = folder / f"{name}.so"
    for prefix in (f".{name}.build-", f".{name}.load-"):  # left by killed processes
        remove_stale(folder, prefix)
    cached = ""
    if os.path.lexists(so) or os.path.lexists(folder / f"{name}.json"):
        try:
            return _load_checked(folder, name, build)
        except _Refused as e:
            cached = f"the cached library failed its check: {so.name}: {e}"
            logger.warning("the cached native kernel library %s failed its check (%s): building "
                           "it again", so, e)
            for p in (so, folder / f"{name}.json"):
                p.unlink(missing_ok=True)
    failed = _compile(build, folder, name)
    if failed is not None:
        _why[build] = f"{cached}; {failed}" if cached else failed
        return None
    try:
        return _load_checked(folder, name, build)
    except _Refused as e:
        logger.warning("the native kernel library %s did not load (%s): torch's kernels run", so, e)
        _why[build] = f"the built library failed to load: {so.name}: {e}"
        return None


@functools.cache
def _library(build: str | None) -> tuple[ctypes.CDLL, int] | None:
    if build is None:
        return None
    from constrained_spec.cache import cache_dir, cache_lock
    from constrained_spec.errors import ConfigError

    _why.pop(build, None)
    cannot = _runs_here(build)
    if cannot is not None:  # never loaded where its instructions would fault
        _why[build] = f"the {build} build cannot run here: {cannot}"
        return None
    try:
        folder = cache_dir() / "kernels"
    except ConfigError as e:  # the kernels are optional: torch's run; the loader says it again
        logger.warning("the q4 / q8 kernels are not available: %s", e)
        _why[build] = f"the cache folder is not usable: {e}"
        return None
    problem = _kernels_folder(folder)
    if problem is not None:
        logger.warning("the native kernels' folder %s is %s: the q4 / q8 kernels are neither built "
                       "nor loaded there; torch's kernels run", folder, problem)
        _why[build] = f"the cached library failed its check: its folder {folder} is {problem}"
        return None
    name = f"cpu_native-{build}-{_key(build)}"
    try:
        with cache_lock(folder / f".{name}.lock"):
            return _load_or_build(build, folder, name)
    except OSError as e:  # a read-only cache, a full disk
        logger.warning("the q4 / q8 kernels are not available: %s", e)
        _why[build] = f"the kernels folder {folder} is not usable: {e}"
        return None


def _lib(build: str | None) -> tuple[ctypes.CDLL, int]:
    lib = _library(build_for_this_cpu() if build is None else build)
    if lib is None:
        raise RuntimeError(f"the q4 / q8 kernels are not available ({build or 'this machine'})")
    return lib


def available(build: str | None = None) -> bool:
    """Whether the kernels run here (``build``: one of `BUILDS`, default this CPU's); the
    first call builds them."""
    return _library(build_for_this_cpu() if build is None else build) is not None


def why_unavailable(build: str | None = None) -> str | None:
    """None when the kernels load here (``build``: one of `BUILDS`, default this CPU's), else
    a short reason for a person: "no C compiler (cc)", "this CPU has no AVX2/FMA", "the build
    failed: ...", "the cached library failed its check: ..."."""
    b = build_for_this_cpu() if build is None else build
    if b is None:
        if all(f in _cpu_flags() for f in BUILDS["avx2"][0]):
            return (f"torch runs at CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                    "below AVX2 (ATEN_CPU_CAPABILITY)")
        return "this CPU has no AVX2/FMA"
    if _library(b) is not None:
        return None
    return _why.get(b, "the kernels did not load")


def int8_activations(build: str | None = None) -> bool:
    """Whether the q4 kernel with int8 activations (`matmul`'s ``int8_act``, the native
    forward's) runs here: wherever the library loads (`int8_instructions` says with what)."""
    if not available(build):
        return False
    lib = _lib(build)[0]
    return hasattr(lib, "cs_vnni") and hasattr(lib, "cs_q4i8_gemm")


def int8_instructions(build: str | None = None) -> str | None:
    """What the int8 products run on here: ``"vnni"`` (the CPU's integer dot products,
    ``vpdpbusd``), ``"pairs"`` (``vpmaddubsw`` byte pairs widened once a group: the same
    integers, about twice the instructions), None where `int8_activations` is False."""
    if not int8_activations(build):
        return None
    return "vnni" if _lib(build)[0].cs_vnni() else "pairs"


def tile(build: str | None = None) -> int:
    """Output columns per tile of ``build`` (N must be a multiple)."""
    return _lib(build)[1]


def supports(n: int, k: int, build: str | None = None, *, group: int = GROUP, bits: int = 4,
             has_min: bool = False) -> bool:
    """Whether an [n, k] weight in groups of ``group`` inputs (with a min per group:
    ``has_min``) can run here on the kernel for ``bits``-bit values (4: q4, 8: q8). The q8
    kernel's groups of `GROUP16` carry no mins; every weight's k is whole groups of `GROUP`
    (the products' input sums are per `GROUP`)."""
    return group in GROUPS[bits] and not (group == GROUP16 and has_min) and available(build) \
        and n > 0 and k > 0 and n % tile(build) == 0 and k % GROUP == 0


@dataclass(eq=False)
class GroupPack:
    """A weight in the kernels' form (`pack` for q4, `pack_q8` for q8): per tile of `tile`
    output columns, per group of ``group`` inputs (`GROUP`; `GROUP16` for 8 bits without
    mins), the values (4-bit, or int8 when ``bits`` is 8) then the group's scales (and mins:
    always for 4 bits, when ``has_min`` for 8), float16 when ``half``."""

    data: torch.Tensor  # uint8, tiles x groups x group bytes
    n: int
    k: int
    half: bool
    build: str
    bits: int = 4
    has_min: bool = True  # 8 bits: whether groups carry a min (a type that stores one: Q5_1)
    group: int = GROUP  # inputs per group


def _group_bytes(T: int, half: bool, bits: int = 4, has_min: bool = True, group: int = GROUP) -> int:
    per = 2 if half else 4
    return GROUP * T // 2 + 2 * T * per if bits == 4 else group * T + (2 if has_min else 1) * T * per


def _exact_in_half(t: torch.Tensor) -> bool:
    h = t.half()
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t.float())


def _check(N: int, K: int, scale: torch.Tensor, build: str | None, bits: int,
           has_min: bool = True) -> tuple[str, int, int]:
    """(build, tile, group size) of an [N, K] weight with scales [N, K / group]; a ValueError
    naming what does not fit the ``bits``-bit kernel here."""
    b = build_for_this_cpu() if build is None else build
    if b is None or not supports(N, K, b, bits=bits):
        raise ValueError(f"a {N} x {K} weight does not fit the q4 / q8 kernels here (available: "
                         f"{available(b)}; N a multiple of the tile, K of {GROUP})")
    group = K // scale.shape[1] if scale.dim() == 2 and scale.shape[1] else 0
    if tuple(scale.shape) != (N, K // max(group, 1)) or group not in GROUPS[bits] \
            or (group == GROUP16 and has_min):
        takes = " or ".join(str(g) for g in GROUPS[bits])
        raise ValueError(f"scales {tuple(scale.shape)} are not one per group of {takes} inputs "
                         f"of a {N} x {K} weight (the group sizes the {bits}-bit kernel takes"
                         f"{'; groups of 16 without mins' if bits == 8 else ''})")
    return b, tile(b), group


def _per_tile(t: torch.Tensor, T: int, dt: torch.dtype) -> torch.Tensor:
    """[N, G] -> bytes [N / T, G, T * size]: a group's T values of one tile together."""
    N, G = t.shape
    return t.to(dt).view(N // T, T, G).transpose(1, 2).contiguous().view(torch.uint8)


# rows packed at a time (a multiple of every tile): a block's transients (its values in tile
# order) stay small whatever the matrix, and nothing is concatenated
_PACK_ROWS = 4096


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, *,
         build: str | None = None) -> GroupPack:
    """The q4 form of ``w = scale * q + min``: ``q`` integer [N, K] in 0..15, ``scale`` and
    ``minimum`` [N, K / GROUP]. They are kept exactly: as float16 when every one of them is a
    float16 value (Q4_0's and Q4_1's are), else as float32. Written into one buffer a block of
    rows at a time."""
    N, K = q.shape
    b, T, _ = _check(N, K, scale, build, 4)
    G = K // GROUP
    half = _exact_in_half(scale) and _exact_in_half(minimum)
    dt, per, nb = (torch.float16 if half else torch.float32), (2 if half else 4), GROUP * T // 2
    data = torch.empty(N // T, G, _group_bytes(T, half), dtype=torch.uint8)
    for a in range(0, N, _PACK_ROWS):
        z = min(N, a + _PACK_ROWS)
        v, out = q[a:z].to(torch.uint8), data[a // T: z // T]
        if T == 16:  # [tile, k / 4, column, 2]: low nibble q[k + p], high nibble q[k + 2 + p]
            v = v.view((z - a) // 16, 16, K // 4, 4).permute(0, 2, 1, 3)
            nib = v[..., :2] | (v[..., 2:] << 4)
        else:  # [tile, k / 2, column]: low nibble q[k], high nibble q[k + 1]
            v = v.view((z - a) // 8, 8, K // 2, 2).permute(0, 2, 1, 3)
            nib = v[..., 0] | (v[..., 1] << 4)
        out[..., :nb] = nib.reshape((z - a) // T, G, nb)
        out[..., nb: nb + T * per] = _per_tile(scale[a:z], T, dt)
        out[..., nb + T * per:] = _per_tile(minimum[a:z], T, dt)
    return GroupPack(data.view(-1), N, K, half, b)


def pack_q8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None, *,
            build: str | None = None) -> GroupPack:
    """The q8 form of ``w = scale * q (+ min)``: ``q`` int8 [N, K], ``scale`` (and ``minimum``)
    [N, K / group] with groups of `GROUP` (GGUF's Q8_0, Q5_0 without a min, Q5_1 and Q5_K with
    one) or of `GROUP16` without mins (Q6_K), kept exactly (float16 when every one is a float16
    value, as Q8_0's, Q5_0's and Q5_1's are; Q5_K's and Q6_K's products of two scales stay
    float32). Written into one buffer a block of rows at a time (an LM head's values are not
    copied whole)."""
    N, K = q.shape
    b, T, group = _check(N, K, scale, build, 8, has_min=minimum is not None)
    G = K // group
    half = _exact_in_half(scale) and (minimum is None or _exact_in_half(minimum))
    dt, per, nv = (torch.float16 if half else torch.float32), (2 if half else 4), group * T
    data = torch.empty(N // T, G, _group_bytes(T, half, 8, minimum is not None, group), dtype=torch.uint8)
    for a in range(0, N, _PACK_ROWS):
        z = min(N, a + _PACK_ROWS)
        n, out = (z - a) // T, data[a // T: z // T]
        vals = q[a:z].to(torch.int8).view(n, T, G, group).permute(0, 2, 3, 1)  # [tile, G, k, column]
        if T == 16:  # pairs of k per column: [tile, G, k / 2, column, 2] (bf16 dot products)
            vals = vals.reshape(n, G, group // 2, 2, T).transpose(3, 4)
        out[..., :nv] = vals.reshape(n, G, nv).view(torch.uint8)
        out[..., nv: nv + T * per] = _per_tile(scale[a:z], T, dt)
        if minimum is not None:
            out[..., nv + T * per:] = _per_tile(minimum[a:z], T, dt)
    return GroupPack(data.view(-1), N, K, half, b, bits=8, has_min=minimum is not None, group=group)


def _groups_view(packed: GroupPack) -> torch.Tensor:
    """The pack's bytes as [N / T, G, bytes per group of T columns]."""
    T = tile(packed.build)
    gb = _group_bytes(T, packed.half, packed.bits, packed.has_min, packed.group)
    return packed.data.view(packed.n // T, packed.k // packed.group, gb)


def unpack_scales(packed: GroupPack) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, min or None)``, float32 [N, K / group], back from a `pack` or `pack_q8`: the
    values given to it, exactly (float16 ones were exact in float16), so a pack can be the only
    copy of its groups' scales."""
    N, T = packed.n, tile(packed.build)
    G = packed.k // packed.group
    per = 2 if packed.half else 4
    g = _groups_view(packed)
    dt = torch.float16 if packed.half else torch.float32

    def per_row(lo: int) -> torch.Tensor:  # bytes [N / T, G, T * per] -> float32 [N, G]
        v = g[..., lo: lo + T * per].contiguous().view(dt).float()  # [N / T, G, T]
        return v.permute(0, 2, 1).reshape(N, G)

    base = packed.group * T // (2 if packed.bits == 4 else 1)  # the values' bytes come first
    return per_row(base), per_row(base + T * per) if packed.has_min else None


def unpack_q8(packed: GroupPack) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q int8 [N, K], scale float32 [N, K / group], min or None)`` back from a `pack_q8`."""
    N, K, T, group = packed.n, packed.k, tile(packed.build), packed.group
    G = K // group
    v = _groups_view(packed)[..., : group * T]
    if T == 16:
        v = v.reshape(N // T, G, group // 2, T, 2).transpose(3, 4)
    q = v.reshape(N // T, G, group, T).permute(0, 3, 1, 2).reshape(N, K)
    return (q.contiguous().view(torch.int8), *unpack_scales(packed))


def tiles_of(packed: GroupPack, rows: torch.Tensor) -> tuple[GroupPack, torch.Tensor]:
    """A pack of just the tiles that hold ``rows`` (int64 [R]), and where each row is in it:
    reading a few rows back (an embedding's lookup) unpacks those tiles only."""
    T = tile(packed.build)
    tiles, inverse = torch.unique(rows // T, return_inverse=True)
    data = _groups_view(packed)[tiles]  # [tiles, G, bytes]: a copy of those tiles
    sub = GroupPack(data.view(-1), len(tiles) * T, packed.k, packed.half, packed.build,
                    bits=packed.bits, has_min=packed.has_min, group=packed.group)
    return sub, inverse * T + rows % T


def unpack_q(packed: GroupPack) -> torch.Tensor:
    """``q`` uint8 [N, K] back from a 4-bit `pack`."""
    N, K, T = packed.n, packed.k, tile(packed.build)
    G = K // GROUP
    nib = packed.data.view(N // T, G, _group_bytes(T, packed.half))[..., : GROUP * T // 2]
    out = torch.empty(N, K, dtype=torch.uint8)
    if T == 16:
        b = nib.reshape(N // 16, K // 4, 16, 2)
        v = out.view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3)
        v[..., :2] = b & 15
        v[..., 2:] = b >> 4
    else:
        b = nib.reshape(N // 8, K // 2, 8)
        v = out.view(N // 8, 8, K // 2, 2).permute(0, 2, 1, 3)
        v[..., 0] = b & 15
        v[..., 1] = b >> 4
    return out


def matmul(x: torch.Tensor, packed: GroupPack, *, out_dtype: torch.dtype = torch.bfloat16,
           int8_act: bool = False) -> torch.Tensor:
    """``x @ W.T`` for a `pack` or `pack_q8`: ``x`` [..., K] (cast to bfloat16), the result
    [..., N] in ``out_dtype`` (bfloat16, rounded to nearest even, or float32). ``int8_act``
    (a 4-bit pack, where `int8_activations`): each row's groups of `GROUP` inputs quantized to
    int8 with a float32 scale each (llama.cpp's Q8_0 but for the scale's precision) and
    multiplied in integers (cpu_native.c, ``cs_q4i8_gemm``; `int8_instructions`)."""
    lib = _lib(packed.build)[0]
    N, K = packed.n, packed.k
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {K}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, not {out_dtype}")
    x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=out_dtype)
    if int8_act:
        if packed.bits != 4 or not int8_activations(packed.build):
            raise ValueError(f"int8 activations take a 4-bit pack where the native kernels load "
                             f"(this pack: {packed.bits}-bit; here: {int8_activations(packed.build)})")
        failed = M and lib.cs_q4i8_gemm(x2.data_ptr(), M, K, N, packed.data.data_ptr(),
                                        int(packed.half), y.data_ptr(), int(out_dtype == torch.bfloat16))
    elif packed.bits == 8:
        failed = M and lib.cs_q8_gemm(x2.data_ptr(), M, K, N, packed.data.data_ptr(),
                                      int(packed.half), int(packed.has_min), packed.group,
                                      y.data_ptr(), int(out_dtype == torch.bfloat16))
    else:
        failed = M and lib.cs_q4_gemm(x2.data_ptr(), M, K, N, packed.data.data_ptr(),
                                      int(packed.half), y.data_ptr(), int(out_dtype == torch.bfloat16))
    if failed == -2:
        raise ValueError(f"the q8 kernel does not take groups of {packed.group} "
                         f"({'with' if packed.has_min else 'without'} mins) over {K} inputs")
    if failed:
        raise MemoryError("the q4 / q8 kernel could not allocate its row buffers")
    return y.view(*x.shape[:-1], N)


MAX_HEAD_DIM, MAX_HEADS_PER_KV = 256, 16  # cpu_native.c's MAX_HD, MAX_G


def forward_function() -> Callable[..., int] | None:
    """``cs_forward`` of this machine's library (`native_forward` calls it), or None where the
    kernels do not load or the library has none."""
    if not available():
        return None
    return getattr(_lib(None)[0], "cs_forward", None)


def attention_supports(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether `attention` takes this shape here (else the runner's torch attention runs)."""
    if not available():
        return False
    width = int(_lib(None)[0].cs_attention_width())
    return (head_dim % width == 0 and head_dim <= MAX_HEAD_DIM and heads % kv_heads == 0
            and heads // kv_heads <= MAX_HEADS_PER_KV)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              scale: float, softcap: float | None = None) -> torch.Tensor:
    """Exact decode attention (``cs_attention`` in cpu_native.c): row ``r`` of ``q`` [R, H, hd]
    (bfloat16) attends over the keys ``rows[1, r]`` to ``rows[2, r] - 1`` of cache slot
    ``rows[0, r]`` (``rows``: int32 [3, R]) in ``k_cache`` / ``v_cache`` (bfloat16 [slots,
    positions, KV, hd], contiguous), in key order and float32, with ``scale`` and an optional
    soft cap. A row's bits depend only on its own query and keys (tested): [R, H, hd] bfloat16."""
    lib = _lib(None)[0]
    R, H, hd = q.shape
    S, L, KV, hd2 = k_cache.shape
    if hd2 != hd or v_cache.shape != k_cache.shape or rows.shape != (3, R):
        raise ValueError(f"attention shapes do not match: q {tuple(q.shape)}, cache "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}, rows {tuple(rows.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16) or rows.dtype != torch.int32:
        raise ValueError("attention takes bfloat16 q and caches and int32 rows")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and rows.is_contiguous()):
        raise ValueError("attention reads contiguous caches and rows")
    q = q.contiguous()
    out = torch.empty(R, H, hd, dtype=torch.bfloat16)
    rc = lib.cs_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), L,
                          rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(), R, H, KV, hd,
                          float(scale), float(softcap or 0.0), out.data_ptr())
    if rc == -2:
        raise ValueError(f"attention does not take {H} heads over {KV} kv heads of {hd}")
    if rc:
        raise MemoryError("attention could not allocate its scores")
    return out
