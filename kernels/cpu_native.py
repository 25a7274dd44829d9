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
groups carry mins): the 8-bit and 5-bit GGUF types, whose values are exact in int8, and a
4-bit type's values beside them in one fused matrix. Which GGUF types reach which kernel is
their row of ``constrained_spec.model.quant.TYPES``; the kernels themselves take groups of
the sizes in `GROUPS` (`GROUP` inputs for both: `supports`). Both hold a weight as a
`GroupPack`.

Speed against torch's kernels, per build: benchmarks/RESULTS.md, "Native CPU kernels against
torch's (avx512bf16 build)" and "(avx2 build)" (`benchmarks/native_kernels.py`); their error
against the float32 product of the dequantized weights is a small fraction of torch's int4
kernel's (bf16 out).

A row's bits do not depend on the other rows of a call (each row has its own accumulators and
the same instruction sequence), so ``q4`` and ``q8`` are row-invariant
(`weights.ROW_INVARIANT_KERNELS`, tested). Which build runs follows the CPU flags AND torch's
capability, so the AVX2-only simulation (``ATEN_CPU_CAPABILITY=avx2``) gets the AVX2 build.
Built with the C compiler (``$CC``, else ``cc``) and OpenMP into the cache folder
(``CONSTRAINED_SPEC_CACHE``), keyed by the source and the build; without a compiler, on
another architecture or when the build fails, `available` is False and the plan never offers
``q4`` or ``q8`` (torch's kernels run instead). Threads: the library uses the OpenMP runtime
torch already loaded, so ``torch.set_num_threads`` applies to it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per group: cpu_native.c's GROUP
# the group sizes each kernel takes, by the bits of its values (q4: 4, q8: 8)
GROUPS: dict[int, tuple[int, ...]] = {4: (GROUP,), 8: (GROUP,)}
SOURCE = Path(__file__).with_name("cpu_native.c")
# build -> (CPU flags it needs, compiler flags, columns per tile)
BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], int]] = {
    "avx512bf16": (("avx512f", "avx512bw", "avx512_bf16", "fma"),
                   ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"), 16),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), 8),
}
_CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-std=c11")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache  # asked on every weight multiply (Linear.supports)
def build_for_this_cpu() -> str | None:
    """The build this machine runs: ``avx512bf16``, ``avx2`` or None. torch's capability caps
    it (``ATEN_CPU_CAPABILITY=avx2`` simulates an AVX2-only CPU for torch and for this)."""
    flags = _cpu_flags()
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512") and all(f in flags for f in BUILDS["avx512bf16"][0]):
        return "avx512bf16"
    if cap.startswith(("AVX2", "AVX512")) and all(f in flags for f in BUILDS["avx2"][0]):
        return "avx2"
    return None


def _compile(build: str, out: Path) -> bool:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        logger.info("no C compiler (%s): the q4 kernel is not available", cc)
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    base = [cc, *_CFLAGS, *BUILDS[build][1], str(SOURCE), "-o", str(tmp), "-lm"]
    # OpenMP for the threads (torch's runtime, already loaded); without it, one thread
    for cmd in (base[:1] + ["-fopenmp"] + base[1:], base):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning("building the q4 kernel failed: %s", e)
            return False
        if done.returncode == 0:
            os.replace(tmp, out)
            return True
        logger.info("building the q4 kernel with %s failed: %s", " ".join(cmd), done.stderr[-2000:])
    tmp.unlink(missing_ok=True)
    logger.warning("the q4 kernel could not be built (see the log at INFO): torch's kernels run")
    return False


@functools.cache
def _library(build: str | None) -> tuple[ctypes.CDLL, int] | None:
    if build is None:
        return None
    from constrained_spec.cache import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + repr((_CFLAGS, BUILDS[build])).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_native-{build}-{key}.so"
    if not path.exists() and not _compile(build, path):
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("cannot load the q4 kernel %s: %s", path, e)
        return None
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cs_q4_tile.restype = i
    lib.cs_q4_gemm.argtypes = [vp, i, i, i, vp, i, vp, i]
    lib.cs_q4_gemm.restype = i
    lib.cs_q8_gemm.argtypes = [vp, i, i, i, vp, i, i, vp, i]
    lib.cs_q8_gemm.restype = i
    f = ctypes.c_float
    lib.cs_attention.argtypes = [vp, vp, vp, i, vp, vp, vp, i, i, i, i, f, f, vp]
    lib.cs_attention.restype = i
    lib.cs_attention_width.restype = i
    tile = int(lib.cs_q4_tile())
    if tile != BUILDS[build][2]:
        logger.warning("the q4 kernel %s has tiles of %d columns, not %d: not used", path, tile,
                       BUILDS[build][2])
        return None
    return lib, tile


def _lib(build: str | None) -> tuple[ctypes.CDLL, int]:
    lib = _library(build_for_this_cpu() if build is None else build)
    if lib is None:
        raise RuntimeError(f"the q4 / q8 kernels are not available ({build or 'this machine'})")
    return lib


def available(build: str | None = None) -> bool:
    """Whether the kernels run here (``build``: one of `BUILDS`, default this CPU's); the
    first call builds them."""
    return _library(build_for_this_cpu() if build is None else build) is not None


def tile(build: str | None = None) -> int:
    """Output columns per tile of ``build`` (N must be a multiple)."""
    return _lib(build)[1]


def supports(n: int, k: int, build: str | None = None, *, group: int = GROUP, bits: int = 4) -> bool:
    """Whether an [n, k] weight in groups of ``group`` inputs can run here on the kernel for
    ``bits``-bit values (4: q4, 8: q8)."""
    return group in GROUPS[bits] and available(build) and n > 0 and k > 0 \
        and n % tile(build) == 0 and k % group == 0


@dataclass(eq=False)
class GroupPack:
    """A weight in the kernels' form (`pack` for q4, `pack_q8` for q8): per tile of `tile`
    output columns, per group of `GROUP` inputs, the values (4-bit, or int8 when ``bits`` is
    8) then the group's scales (and mins: always for 4 bits, when ``has_min`` for 8), float16
    when ``half``."""

    data: torch.Tensor  # uint8, tiles x groups x group bytes
    n: int
    k: int
    half: bool
    build: str
    bits: int = 4
    has_min: bool = True  # 8 bits: whether groups carry a min (a type that stores one: Q5_1)


def _group_bytes(T: int, half: bool, bits: int = 4, has_min: bool = True) -> int:
    per = 2 if half else 4
    return GROUP * T // 2 + 2 * T * per if bits == 4 else GROUP * T + (2 if has_min else 1) * T * per


def _exact_in_half(t: torch.Tensor) -> bool:
    h = t.half()
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t.float())


def _check(N: int, K: int, scale: torch.Tensor, build: str | None, bits: int) -> tuple[str, int]:
    b = build_for_this_cpu() if build is None else build
    if b is None or not supports(N, K, b, bits=bits):
        raise ValueError(f"a {N} x {K} weight does not fit the q4 / q8 kernels here (available: "
                         f"{available(b)}; N a multiple of the tile, K of {GROUP})")
    if tuple(scale.shape) != (N, K // GROUP):
        raise ValueError(f"scales {tuple(scale.shape)} are not one per group of {GROUP} inputs "
                         f"of a {N} x {K} weight (the group size the {bits}-bit kernel takes)")
    return b, tile(b)


def _per_tile(t: torch.Tensor, T: int, dt: torch.dtype) -> torch.Tensor:
    """[N, G] -> bytes [N / T, G, T * size]: a group's T values of one tile together."""
    N, G = t.shape
    return t.to(dt).view(N // T, T, G).transpose(1, 2).contiguous().view(torch.uint8)


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, *,
         build: str | None = None) -> GroupPack:
    """The q4 form of ``w = scale * q + min``: ``q`` integer [N, K] in 0..15, ``scale`` and
    ``minimum`` [N, K / GROUP]. They are kept exactly: as float16 when every one of them is a
    float16 value (Q4_0's and Q4_1's are), else as float32."""
    N, K = q.shape
    b, T = _check(N, K, scale, build, 4)
    G = K // GROUP
    q = q.to(torch.uint8)
    if T == 16:  # [tile, k / 4, column, 2]: low nibble q[k + p], high nibble q[k + 2 + p]
        v = q.view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3)
        nib = v[..., :2] | (v[..., 2:] << 4)
    else:  # [tile, k / 2, column]: low nibble q[k], high nibble q[k + 1]
        v = q.view(N // 8, 8, K // 2, 2).permute(0, 2, 1, 3)
        nib = v[..., 0] | (v[..., 1] << 4)
    half = _exact_in_half(scale) and _exact_in_half(minimum)
    dt = torch.float16 if half else torch.float32
    data = torch.cat([nib.reshape(N // T, G, GROUP * T // 2), _per_tile(scale, T, dt),
                      _per_tile(minimum, T, dt)], -1)
    return GroupPack(data.contiguous().view(-1), N, K, half, b)


def pack_q8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None, *,
            build: str | None = None) -> GroupPack:
    """The q8 form of ``w = scale * q (+ min)``: ``q`` int8 [N, K], ``scale`` (and ``minimum``)
    [N, K / GROUP] (GGUF's Q8_0 and Q5_0 without a min, Q5_1 with one), kept exactly (float16
    when every one is a float16 value, as Q8_0's, Q5_0's and Q5_1's are)."""
    N, K = q.shape
    b, T = _check(N, K, scale, build, 8)
    G = K // GROUP
    vals = q.to(torch.int8).view(N // T, T, G, GROUP).permute(0, 2, 3, 1)  # [tile, G, k, column]
    if T == 16:  # pairs of k per column: [tile, G, k / 2, column, 2] (bf16 dot products)
        vals = vals.reshape(N // T, G, GROUP // 2, 2, T).transpose(3, 4)
    half = _exact_in_half(scale) and (minimum is None or _exact_in_half(minimum))
    dt = torch.float16 if half else torch.float32
    parts = [vals.reshape(N // T, G, GROUP * T).view(torch.uint8), _per_tile(scale, T, dt)]
    if minimum is not None:
        parts.append(_per_tile(minimum, T, dt))
    return GroupPack(torch.cat(parts, -1).contiguous().view(-1), N, K, half, b, bits=8,
                     has_min=minimum is not None)


def unpack_q8(packed: GroupPack) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q int8 [N, K], scale float32 [N, K / GROUP], min or None)`` back from a `pack_q8`."""
    N, K, T = packed.n, packed.k, tile(packed.build)
    G = K // GROUP
    per = 2 if packed.half else 4
    g = packed.data.view(N // T, G, _group_bytes(T, packed.half, 8, packed.has_min))
    v = g[..., : GROUP * T]
    if T == 16:
        v = v.reshape(N // T, G, GROUP // 2, T, 2).transpose(3, 4)
    q = v.reshape(N // T, G, GROUP, T).permute(0, 3, 1, 2).reshape(N, K)
    dt = torch.float16 if packed.half else torch.float32

    def per_row(lo: int) -> torch.Tensor:  # bytes [N / T, G, T * per] -> float32 [N, G]
        v = g[..., lo: lo + T * per].contiguous().view(dt).float()  # [N / T, G, T]
        return v.permute(0, 2, 1).reshape(N, G)

    base = GROUP * T
    return (q.contiguous().view(torch.int8), per_row(base),
            per_row(base + T * per) if packed.has_min else None)


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


def matmul(x: torch.Tensor, packed: GroupPack, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ W.T`` for a `pack` or `pack_q8`: ``x`` [..., K] (cast to bfloat16), the result
    [..., N] in ``out_dtype`` (bfloat16, rounded to nearest even, or float32)."""
    lib = _lib(packed.build)[0]
    N, K = packed.n, packed.k
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {K}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, not {out_dtype}")
    x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=out_dtype)
    if packed.bits == 8:
        failed = M and lib.cs_q8_gemm(x2.data_ptr(), M, K, N, packed.data.data_ptr(),
                                      int(packed.half), int(packed.has_min), y.data_ptr(),
                                      int(out_dtype == torch.bfloat16))
    else:
        failed = M and lib.cs_q4_gemm(x2.data_ptr(), M, K, N, packed.data.data_ptr(),
                                      int(packed.half), y.data_ptr(), int(out_dtype == torch.bfloat16))
    if failed:
        raise MemoryError("the q4 / q8 kernel could not allocate its row buffers")
    return y.view(*x.shape[:-1], N)


MAX_HEAD_DIM, MAX_HEADS_PER_KV = 256, 16  # cpu_native.c's MAX_HD, MAX_G


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
