"""Weight matrices and the kernels that multiply with them.

A `Linear` is one weight matrix ``[N, K]`` (output x input) kept in ONE resident form -- the
file's own 4-bit groups when they are exactly 4-bit (`Int4Groups`: a GGUF type whose groups
are ``"int4"`` in `quant.TYPES`, or a dense checkpoint dequantized from one), the file's own
8-bit groups (`Q8Groups`: a type whose groups are ``"int8"``), else a dense tensor -- and
multiplied by one of six kernels, chosen per phase by the kernel plan
(`constrained_spec.model.plan`). Each pack carries its own group size (inputs per scale, read
off its shapes); a kernel that takes only some group sizes says so in `Linear.supports`.

========  =====================  ===========  ============================================
kernel    activations            weights      what it reads per call
========  =====================  ===========  ============================================
``fp32``  float32                dense fp32   resident fp32, else dequantized per call
``bf16``  bfloat16               dense bf16   resident bf16, else dequantized per call
``int4``  bfloat16               4-bit pack   torch's CPU int4 weight-only kernel (groups of
                                              32 to 256, bf16 scale and zero: the file's
                                              own q)
``int8``  bfloat16               int8 pack    torch's CPU int8 weight-only kernel (per-row
                                              scale: a RE-quantization, ~1% error; opt-in
                                              for targets, default for draft heads)
``q4``    bfloat16               q4 pack      this package's C kernel for few rows (the
                                              file's own q, scale and min kept exactly;
                                              AVX-512-BF16 or AVX2 build, `kernels.cpu_native`)
``q8``    bfloat16               q8 pack      the same for 8-bit groups (`Q8Groups`; the LM
                                              head of most GGUF files, whose logits come
                                              back in float32)
========  =====================  ===========  ============================================

"Dequantized per call" is how a large prompt runs in float32 on a CPU without bf16 units while
the weights stay 4-bit in memory: the group dequantization costs a fraction of the product it
feeds (benchmarks/RESULTS.md, "Memory: one copy of the 4-bit weights, the auto memory mode"),
and no dense copy of the model is ever kept (the resident set is the 4-bit file plus the
non-4-bit tensors).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from constrained_spec.kernels import cpu_native

PACKED_KERNELS: frozenset[str] = frozenset({"int4", "int8", "q4", "q8"})
# the activation dtype each kernel multiplies in
ACT_DTYPE: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                     "int8": torch.bfloat16, "int4": torch.bfloat16,
                                     "q4": torch.bfloat16, "q8": torch.bfloat16}
# group sizes torch's CPU int4 kernel takes (its own check on qGroupSize); the q4 and q8
# kernels take theirs (`kernels.cpu_native.supports`)
INT4_KERNEL_GROUPS: tuple[int, ...] = (32, 64, 128, 256)
# Kernels whose result rows do not depend on the number of rows multiplied (each row reduced in
# the same order whether it is multiplied alone or among 2..256 others; measured on x86 with
# AVX-512, tests/kernels/test_row_invariance.py checks it on the machine it runs on): torch's
# int4 / int8 weight-only kernels, this package's q4 and q8 kernels (each row its own
# accumulators and instruction sequence, `kernels.cpu_native`), and oneDNN's bf16 GEMM from
# 2 rows on -- its 1-row product (a GEMV) reduces differently once K > ~1024 (576x1536: every
# row of a 3..256-row product differs from the row alone), so an exact 1-row bf16 product is padded to 2 rows
# (`Linear.__call__`). MKL's fp32 GEMM picks its blocking by shape (a row among 2, 4, 6, ...
# differs), so float32 is not row-invariant, through F.linear or oneDNN's fp32 linear alike.
ROW_INVARIANT_KERNELS: frozenset[str] = frozenset({"bf16", "int4", "int8", "q4", "q8"})


# cached: asked on every weight multiply (through Linear.supports), and an op lookup on
# torch.ops.aten costs microseconds each time
@functools.cache
def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@functools.cache
def int8_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _group_of(shape: tuple[int, int], scale: torch.Tensor) -> int:
    """Inputs per group of an [N, K] weight with scales [N, G]: K / G, which must be whole."""
    N, K = shape
    if scale.dim() != 2 or scale.shape[0] != N or not scale.shape[1] or K % scale.shape[1]:
        raise ValueError(f"scales {tuple(scale.shape)} do not divide a {N} x {K} weight into "
                         f"whole groups")
    return K // int(scale.shape[1])


class Int4Groups:
    """A weight that is exactly ``scale * q + min`` in every group of `group` input weights of
    every row, ``q`` in 0..15 (the layout of a 4-bit GGUF type after unpacking:
    `gguf.QuantTensor.int4_groups`).

    ``q`` is held ONCE: as ``nibbles`` in row order (as loaded), or -- after `keep_packed_only`, when
    torch's CPU int4 kernel uses a layout `pack_block` recognises -- only as that kernel's own
    pack, or -- after `keep_q4_only` -- only as the q4 kernel's tiles, which then hold the
    scales and mins too; `values`, `scale`, `min` and `dequantize` read them back from there (the
    kernel and the dense paths then share one copy of the 4-bit weights instead of two).

    ``nibbles``: uint8 [N, K // 2], q[:, 2j] in the low nibble, q[:, 2j + 1] high; ``scale``,
    ``min``: float32 [N, K // group]; ``packed``: torch's CPU int4 pack (uint8 [N, K // 2] in
    blocks of ``block`` rows), when nibbles is None; ``q4``: the q4 kernel's pack
    (`kernels.cpu_native.pack`), when nibbles is None.
    """

    def __init__(self, nibbles: torch.Tensor | None, scale: torch.Tensor, min: torch.Tensor,
                 packed: torch.Tensor | None = None, block: int = 0,
                 q4: cpu_native.GroupPack | None = None) -> None:
        self.nibbles, self.packed, self.block, self.q4 = nibbles, packed, block, q4
        # None once the q4 pack holds them (`keep_q4_only`)
        self._scale: torch.Tensor | None = scale
        self._min: torch.Tensor | None = min
        # input weights per group (one scale and one min each), read off the shapes
        self.group = _group_of(self.shape, scale)

    @property
    def scale(self) -> torch.Tensor:
        """float32 [N, K // group]: as given, or read back from the q4 pack."""
        return self._scale if self._scale is not None else self._q4_scales()[0]

    @property
    def min(self) -> torch.Tensor:
        """float32 [N, K // group]: as given, or read back from the q4 pack."""
        return self._min if self._min is not None else self._q4_scales()[1]

    def _q4_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.q4 is not None  # scales are dropped only once the q4 pack holds them
        scale, minimum = cpu_native.unpack_scales(self.q4)
        assert minimum is not None  # a 4-bit pack always carries mins
        return scale, minimum

    @property
    def device(self) -> torch.device:
        held = [t for t in (self.nibbles, self.packed, self._scale) if t is not None]
        return held[0].device if held else torch.device("cpu")  # a q4 pack lives on the CPU

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors these groups hold (q in one form, scales and mins unless a pack has them)."""
        held = [self.nibbles, self.packed, self._scale, self._min, None if self.q4 is None else self.q4.data]
        return [t for t in held if t is not None]

    @property
    def _q(self) -> torch.Tensor:
        """q as held: the nibbles, else the kernel's pack (one of them is always set)."""
        q = self.nibbles if self.nibbles is not None else self.packed
        if q is None:
            raise ValueError("these 4-bit groups hold neither nibbles nor an int4 pack: build "
                             "them with from_values / from_dense, or pass packed with block")
        return q

    @property
    def shape(self) -> tuple[int, int]:
        if self.nibbles is None and self.packed is None and self.q4 is not None:
            return self.q4.n, self.q4.k
        q = self._q
        return int(q.shape[0]), int(q.shape[1]) * 2

    @classmethod
    def from_values(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> Int4Groups:
        """``q``: integer [N, K] in 0..15; ``scale``, ``minimum``: [N, K // group] (the group
        is what divides K into that many columns)."""
        q = q.to(torch.uint8)
        return cls(nibbles=(q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(),
                   scale=scale.float().contiguous(), min=minimum.float().contiguous())

    @classmethod
    def from_dense(cls, weight: torch.Tensor, *, group: int = 32,
                   exact: bool = True) -> Int4Groups | None:
        """The groups of ``group`` inputs of a float32 ``weight`` whose every group is exactly
        ``d * q + m`` (as a checkpoint dequantized from a 4-bit GGUF is: groups of 32 for Q4_0,
        Q4_1 and Q4_K, the default), else None. ``exact=False`` quantizes any weight that way
        (round to nearest)."""
        N, K = weight.shape
        if weight.dtype != torch.float32 or K % group:
            return None
        g = weight.detach().view(N, K // group, group)
        lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
        d = (hi - lo) / 15
        q = (g - lo).mul_(torch.where(d == 0, torch.zeros_like(d), 1.0 / d)).round_().clamp_(0, 15)
        # exact up to fp32 rounding of d * q + m (the converter computed the same expression)
        err = (q * d).add_(lo).sub_(g).abs_()
        if exact and not bool((err <= 1e-6 * (hi.abs() + lo.abs())).all()):
            return None
        return cls.from_values(q.view(N, K), d.view(N, -1), lo.view(N, -1))

    def _unpack_into(self, out: torch.Tensor) -> None:
        """Write q into ``out`` (float32 [N, K // group, group] or any dtype [N, K])."""
        N, K = self.shape
        if self.nibbles is not None:
            nb = self.nibbles.view(N, K // 2)
            pairs = out.view(N, K // 2, 2)
            torch.bitwise_and(nb, 15, out=pairs[..., 0])
            torch.bitwise_right_shift(nb, 4, out=pairs[..., 1])
            return
        if self.packed is None and self.q4 is not None:
            out.view(N, K).copy_(cpu_native.unpack_q(self.q4))
            return
        # the kernel's layout: for rows b*B..b*B+B-1 and each input k, B/2 bytes whose low
        # nibbles are rows b*B + j and high nibbles rows b*B + B/2 + j
        B = self.block
        p = self._q.view(N // B, K, B // 2)  # the pack, nibbles being None
        blocks = out.view(N // B, B, K).transpose(1, 2)  # [N/B, K, B] view of out
        blocks[..., : B // 2] = p & 15
        blocks[..., B // 2:] = p >> 4

    def values(self) -> torch.Tensor:
        """q as uint8 [N, K]."""
        out = torch.empty(self.shape, dtype=torch.uint8, device=self.device)
        self._unpack_into(out)
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] ``scale * q + min`` computed in float32 (the file's own dequantization: a
        multiply, then an add), then cast to ``dtype``. Written in place into one float32
        buffer, 2x faster than a broadcasting stack/addcmul form (benchmarks/RESULTS.md,
        "Memory: one copy of the 4-bit weights, the auto memory mode"), which matters because
        the lean memory mode and the float32 path dequantize every weight on every prefill
        call."""
        N, K = self.shape
        G = self.group
        w = torch.empty(N, K // G, G, dtype=torch.float32, device=self.device)
        self._unpack_into(w)
        scale, minimum = (self._scale, self._min) if self._scale is not None and self._min is not None \
            else self._q4_scales()
        w.mul_(scale[..., None]).add_(minimum[..., None])
        w = w.view(N, K)
        return w if dtype == torch.float32 else w.to(dtype)

    def keep_packed_only(self, packed: torch.Tensor) -> None:
        """Hold q only as ``packed`` (this weight's int4 kernel pack) from now on, when the
        kernel's layout is one `pack_block` recognises and fits; else keep the nibbles. In
        place, so every holder of these groups (a second runner, the loaded model) frees the
        nibbles too and shares the one pack."""
        N, _ = self.shape
        B = pack_block()
        if self.nibbles is None or not B or N % B or packed.shape != self.nibbles.shape:
            return
        self.packed, self.block, self.nibbles = packed, B, None

    def keep_q4_only(self, pack: cpu_native.GroupPack) -> None:
        """Hold q, the scales and the mins only in ``pack`` (this weight's q4 kernel pack, which
        keeps them exactly) from now on, when q is still held as nibbles (in place, as
        `keep_packed_only`)."""
        if self.nibbles is not None and (pack.n, pack.k) == self.shape:
            self.q4, self.nibbles, self._scale, self._min = pack, None, None, None

    def int4_pack(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(packed, scales_and_zeros)`` for torch's CPU int4 kernel, or None without it or
        when it does not take this weight (its rows a multiple of 16, its groups one of
        `INT4_KERNEL_GROUPS`). The kernel computes ``(q - 8) * scale + zero`` with bf16 scale
        and zero."""
        N, K = self.shape
        if not int4_kernel_available() or N % 16 or self.group not in INT4_KERNEL_GROUPS:
            return None
        if self.packed is not None:
            packed = self.packed
        else:
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    self.values().to(torch.int32), 1)
            except RuntimeError:  # a torch build without the CPU int4 kernel
                return None
        sz = torch.stack([self.scale, self.min + 8 * self.scale], -1).transpose(0, 1)  # [K/G, N, 2]
        return packed, sz.contiguous().to(torch.bfloat16)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held_tensors())


class Q8Groups:
    """A matrix whose every group of `group` inputs is exactly ``scale * q (+ min)`` with ``q``
    in int8, as the file holds it (`gguf.QuantTensor.q8_groups`: a min only for a type that
    stores one), for the q8 kernel.

    ``q``: int8 [N, K]; ``scale`` (and ``min``): float32 [N, K // group]. Held once: as given,
    or -- after `keep_pack_only` -- only in the q8 kernel's pack, from which `q`, `scale`, `min`
    and `rows` read them back (in place: every holder, a loaded model or a second runner, then
    shares the one pack)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None = None) -> None:
        self._values: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = (q, scale, min)
        self.pack: cpu_native.GroupPack | None = None
        self.shape = int(q.shape[0]), int(q.shape[1])
        self.has_min = min is not None
        # input weights per group (one scale, and one min when there are mins), read off the shapes
        self.group = _group_of(self.shape, scale)

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._values is not None:
            return self._values
        assert self.pack is not None  # the values are dropped only once the pack holds them
        return cpu_native.unpack_q8(self.pack)

    @property
    def q(self) -> torch.Tensor:
        return self._held()[0]

    @property
    def scale(self) -> torch.Tensor:
        return self._values[1] if self._values is not None else self._held()[1]

    @property
    def min(self) -> torch.Tensor | None:
        return self._values[2] if self._values is not None else self._held()[2]

    def keep_pack_only(self, pack: cpu_native.GroupPack) -> None:
        """Hold the groups only in ``pack`` (their q8 kernel pack, `cpu_native.pack_q8`) from now on."""
        if (pack.n, pack.k) == self.shape:
            self.pack, self._values = pack, None

    def held_tensors(self) -> list[torch.Tensor]:
        if self._values is None:
            return [] if self.pack is None else [self.pack.data]
        return [t for t in self._values if t is not None]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] ``scale * q (+ min)`` in float32 (the file's own expression), cast to ``dtype``."""
        return _q8_dense(*self._held(), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 [R]) of `dequantize` (``dtype`` [R, K]), bit for bit, reading
        only those rows (from the pack: only their tiles): an embedding's lookup, when a tied
        embedding is held only as its LM head's groups."""
        if self._values is not None:
            q, scale, minimum = self._values
            return _q8_dense(q[ids], scale[ids], None if minimum is None else minimum[ids], dtype)
        assert self.pack is not None
        sub, at = cpu_native.tiles_of(self.pack, ids)
        q, scale, minimum = cpu_native.unpack_q8(sub)
        return _q8_dense(q[at], scale[at], None if minimum is None else minimum[at], dtype)


def _q8_dense(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """[N, K] ``scale * q (+ min)`` in float32 per group, cast to ``dtype`` (`Q8Groups.dequantize`)."""
    N, K = q.shape
    G = K // scale.shape[1]
    w = q.float().view(N, K // G, G).mul_(scale[..., None])
    if minimum is not None:
        w.add_(minimum[..., None])
    w = w.view(N, K)
    return w if dtype == torch.float32 else w.to(dtype)


_PACK_BLOCK: int | None = None


def pack_block() -> int:
    """Rows per block of torch's CPU int4 pack on this machine (it depends on the torch build
    and the CPU capability it dispatches to), found by packing random values and reading them
    back; 0 when no candidate layout reads them back exactly (then weights keep their nibbles)."""
    global _PACK_BLOCK
    if _PACK_BLOCK is None:
        _PACK_BLOCK = 0
        if int4_kernel_available():
            gen = torch.Generator().manual_seed(0)
            K = 2 * INT4_KERNEL_GROUPS[0]
            q = torch.randint(0, 16, (128, K), generator=gen)
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            except RuntimeError:
                packed = None
            for B in (64, 32, 16, 128):
                if packed is None or packed.shape != (128, K // 2):
                    break
                probe = Int4Groups(nibbles=None, scale=torch.ones(128, 2), min=torch.zeros(128, 2),
                                   packed=packed, block=B)
                if torch.equal(probe.values(), q.to(torch.uint8)):
                    _PACK_BLOCK = B
                    break
    return _PACK_BLOCK


def int8_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(int8 weight [N, K], bf16 scales [N])`` for torch's CPU int8 weight-only kernel:
    symmetric round-to-nearest per output row (~1% relative error). None without the kernel."""
    if not int8_kernel_available():
        return None
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.float32)
    # a block of rows at a time in float32 (each row on its own, so the same values as the
    # whole matrix at once): a 151,936 x 896 LM head would otherwise take ~1.6 GB of float32
    # temporaries while it is packed
    for i in range(0, w.shape[0], _PACK_ROWS):
        block = w[i: i + _PACK_ROWS].float()
        s = block.abs().amax(dim=1).clamp_min(1e-12) / 127
        q[i: i + _PACK_ROWS] = torch.round(block / s[:, None]).clamp_(-127, 127)
        scales[i: i + _PACK_ROWS] = s
    return q, scales.to(torch.bfloat16)


_PACK_ROWS = 4096


def packed_matmul(x: torch.Tensor, pack: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by `Int4Groups.int4_pack` or `int8_pack` (bf16 out)."""
    packed, scales = pack
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if packed.dtype == torch.int8:
        y = torch.ops.aten._weight_int8pack_mm(x2, packed, scales)
    else:
        # scales and zeros [K / group, N, 2]: the group is the pack's own
        group = x2.shape[-1] // scales.shape[0]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scales)
    return y.view(*x.shape[:-1], y.shape[-1])


class Linear:
    """One weight matrix in one resident form, multiplied by the kernel asked for.

    Build with ``dense`` (any float tensor; kept as given) or ``int4`` (exact groups), then
    `prepare` the kernels a plan uses: it builds the packs they need and, with
    ``resident=True``, dense copies in their dtypes (faster, more memory).
    """

    def __init__(self, *, dense: torch.Tensor | None = None, int4: Int4Groups | None = None,
                 bias: torch.Tensor | None = None, q8: Q8Groups | None = None,
                 float_out: bool = False) -> None:
        if (dense is not None and int4 is not None) or (dense is None and int4 is None and q8 is None):
            raise ValueError("a Linear holds a dense weight, 4-bit groups or 8-bit groups")
        # the file's 8-bit groups (alone, or beside a dense LM head), for the q8 kernel: held in
        # its pack once built (`Q8Groups.keep_pack_only`: the pack is then their only form,
        # never dropped)
        self.q8 = q8
        self.float_out = float_out  # q8 results in float32 (an LM head's logits), else bf16
        self.dense = None if dense is None else dense.detach()
        self.int4 = int4
        self.bias = None if bias is None else bias.detach().float()
        self._packs: dict[str, Any] = {}  # kernel -> its pack (a tensor pair, or a GroupPack)
        self._dense: dict[torch.dtype, torch.Tensor] = {}

    # at most one of dense and int4 is set, and q8 where neither is (checked in __init__);
    # these read the one expected
    @property
    def _dense_weight(self) -> torch.Tensor:
        if self.dense is None:
            raise ValueError("this Linear holds quantized groups, not a dense weight")
        return self.dense

    @property
    def _q8_groups(self) -> Q8Groups:
        """The 8-bit groups: as given, or read back from the q8 pack once built."""
        if self.q8 is not None:
            return self.q8
        pack = self._packs.get("q8")
        if pack is None:
            raise ValueError("this Linear holds no 8-bit groups")
        return Q8Groups(*cpu_native.unpack_q8(pack))

    @property
    def _groups(self) -> Int4Groups:
        if self.int4 is None:
            raise ValueError("this Linear holds a dense weight, not 4-bit groups: the int4 "
                             "kernel cannot run it (check supports('int4') first)")
        return self.int4

    @property
    def shape(self) -> tuple[int, int]:
        if self.int4 is not None:
            return self.int4.shape
        if self.dense is None:
            pack = self._packs.get("q8")
            if pack is not None:
                return pack.n, pack.k
            return self._q8_groups.shape
        return int(self._dense_weight.shape[0]), int(self._dense_weight.shape[1])

    @property
    def device(self) -> torch.device:
        if self.dense is None and self.int4 is None:
            return torch.device("cpu")  # 8-bit groups live on the CPU
        return (self.dense if self.dense is not None else self._groups.scale).device

    @property
    def packed_kernels(self) -> tuple[str, ...]:
        """The packed kernels built so far ("int4", "int8", "q4", "q8")."""
        return tuple(sorted(self._packs))

    def supports(self, kernel: str) -> bool:
        """Whether ``kernel`` can run this weight on its device."""
        if kernel in ("fp32", "bf16"):
            return True
        if self.device.type != "cpu":
            return False
        if kernel == "int4":
            return self.int4 is not None and int4_kernel_available() and self.shape[0] % 16 == 0 \
                and self.int4.group in INT4_KERNEL_GROUPS
        if kernel == "q4":
            return self.int4 is not None and cpu_native.supports(*self.shape, group=self.int4.group)
        if kernel == "q8":
            return "q8" in self._packs or (
                self.q8 is not None and cpu_native.supports(*self.shape, group=self.q8.group, bits=8,
                                                            has_min=self.q8.has_min))
        return kernel == "int8" and int8_kernel_available()

    def prepare(self, kernels: Iterable[str], *, resident: bool = False) -> None:
        """Build what ``kernels`` need (packs; with ``resident``, dense copies too) and drop
        what no kernel in ``kernels`` uses any more."""
        kernels = set(kernels)
        for k in list(self._packs):
            if k not in kernels and k != "q8":  # the q8 pack is the only form of its values
                del self._packs[k]
        self._dense = {dt: t for dt, t in self._dense.items()
                       if resident and any(ACT_DTYPE[k] == dt for k in kernels if k in ("fp32", "bf16"))}
        for k in kernels:
            if not self.supports(k):
                raise ValueError(f"kernel {k!r} cannot run this {self.shape} weight")
            if k in PACKED_KERNELS:
                self._pack(k)
            elif k in ("fp32", "bf16") and resident:
                dt = ACT_DTYPE[k]
                if dt not in self._dense:
                    self._dense[dt] = self.dequantized(dt)

    def _pack(self, kernel: str) -> Any:
        pack = self._packs.get(kernel)
        if pack is None and kernel == "q4":
            g = self._groups
            pack = self._packs[kernel] = cpu_native.pack(g.values(), g.scale, g.min)
            g.keep_q4_only(pack)  # from now on q lives only in the q4 pack (if nowhere else)
        if pack is None and kernel == "q8":
            if self.q8 is None:
                raise ValueError("this Linear holds no Q8_0 values: the q8 kernel cannot run it")
            # another runner of the same groups may have packed them already
            pack = self.q8.pack or cpu_native.pack_q8(self.q8.q, self.q8.scale, self.q8.min)
            self._packs[kernel] = pack
            self.q8.keep_pack_only(pack)
        if pack is None:
            # int8 from the dense weight as stored (int8_pack upcasts it a block at a time)
            pack = self._groups.int4_pack() if kernel == "int4" else int8_pack(
                self.dense if self.dense is not None else self.dequantized(torch.float32))
            if pack is None:
                raise ValueError(f"kernel {kernel!r} is not available in this torch build")
            self._packs[kernel] = pack
            if kernel == "int4":  # from now on q lives only in the kernel's pack
                self._groups.keep_packed_only(pack[0])
        return pack

    def drop_dense(self) -> bool:
        """Let go of the dense weight once the q8 pack holds the same values (an untied LM head
        whose plan runs it packed: the bf16 copy of a 151,936 x 896 head is 272 MB). Dense
        forms are dequantized from the pack when asked afterwards. Whether it was dropped."""
        if self.dense is None or "q8" not in self._packs:
            return False
        self.dense = None
        return True

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the weight in ``dtype`` (``[*ids.shape, K]``): an
        embedding's lookup of a tied embedding held only as this LM head's 8-bit groups
        (`Q8Groups.rows`), or of the dense form in ``dtype`` when one is resident."""
        if dtype in self._dense:
            return F.embedding(ids, self._dense[dtype])
        if self.int4 is not None or self.q8 is None:
            return F.embedding(ids, self.dequantized(dtype))
        return self.q8.rows(ids.reshape(-1), dtype).view(*ids.shape, -1)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight in ``dtype`` (resident when prepared so, else built now)."""
        if dtype in self._dense:
            return self._dense[dtype]
        if self.dense is not None:
            return self.dense if self.dense.dtype == dtype else self.dense.to(dtype)
        if self.int4 is None:
            return self._q8_groups.dequantize(dtype)
        return self._groups.dequantize(dtype)

    def __call__(self, x: torch.Tensor, kernel: str, *, row_invariant: bool = False) -> torch.Tensor:
        """``x @ W.T (+ bias)`` with ``kernel``; ``x`` is cast to the kernel's activation dtype
        and the result comes back in it (q8 with ``float_out``: in float32). ``row_invariant``: a row's result has
        the same bits whatever the number of rows (see `ROW_INVARIANT_KERNELS`; fp32 cannot)."""
        act = ACT_DTYPE[kernel]
        x = x.to(act)
        if kernel in ("q4", "q8"):  # built on first use when not prepared
            out = torch.float32 if kernel == "q8" and self.float_out else torch.bfloat16
            y = cpu_native.matmul(x, self._pack(kernel), out_dtype=out)
        elif kernel in ("int4", "int8"):
            y = packed_matmul(x, self._pack(kernel))
        elif row_invariant and kernel == "bf16" and x.numel() == x.shape[-1]:
            # one row: padded to two, so oneDNN runs its GEMM (as for every other row count)
            # rather than its GEMV, which reduces in another order
            x2 = torch.cat([x.reshape(1, -1), x.new_zeros(1, x.shape[-1])])
            y = F.linear(x2, self.dequantized(act))[:1].view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, self.dequantized(act))
        return y if self.bias is None else y + self.bias.to(act)

    def nbytes(self) -> int:
        """Bytes held: the resident form, packs and dense copies (a tensor shared between them,
        as the int4 pack and the packed 4-bit groups are, counted once)."""
        own = ([] if self.dense is None else [self.dense]) if self.int4 is None else \
            self.int4.held_tensors()
        packs = [t for p in self._packs.values() for t in ((p.data,) if isinstance(p, cpu_native.GroupPack) else p)]
        source = [] if self.q8 is None else self.q8.held_tensors()
        tensors = own + packs + source + list(self._dense.values())
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
        return sum(seen.values())
