"""GGUF quantization types: one row per type, everything this package knows about each.

`TYPES` is the one table (in the manner of llama.cpp's ``type_traits``): a type's block layout,
its group size (inputs per scale), its bits, whether the file stores a min per group, how its
blocks unpack into exact integer groups (`QuantType.unpack`) and which packed kernel runs
those groups (`QuantType.kernel`). Every reader of types asks it: `gguf.read_gguf` (which
types a file may hold), `gguf.QuantTensor` (which groups a tensor unpacks to, and how),
`loading` (which stored form a GGUF's matrices take once converted, and whether the plan
should time the int8 re-quantization). The packs (`weights.Int4Groups`, `weights.Q8Groups`)
carry their own group size, read off their shapes, so nothing downstream assumes one.

A type whose row has no ``unpack`` is read through gguf-py's dequantization only (and
re-quantized per row to int8 when the plan asks for it). One with an ``unpack`` but no
``kernel`` has exact groups that no packed kernel takes (yet): its matrices stay dense. A
row's ``kernel`` decides what a GGUF is converted to, so changing one changes converted
folders: bump ``loading._LEAN_VERSION`` with it.

Exactness of the 4-bit groups (``groups="int4"``; checked by tests, in float32, as values):
the block scales are float16, a 4-bit ``q`` times a float16 ``d`` (or times ``d * sc`` with a
6-bit ``sc`` for Q4_K) is exact in float32, so ``scale * q + min`` rounds once, exactly where
gguf-py's expression rounds: Q4_1 ``d * q + m`` is the same expression; Q4_K
``d*sc * q - dmin*m`` adds the negated min; Q4_0 ``d * (q - 8)`` is exact either way
(``min = -8 * d``). The only difference is the sign of a zero (Q4_0 with ``q = 8``), which no
product sees. The 8-bit groups (``groups="int8"``) are the blocks' own float16 ``d`` (and
``m``) and integer ``q``: exact by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

# (q [n_blocks, block], scale [n_blocks, block / group], min or None): w = scale * q (+ min)
Groups = tuple[np.ndarray, np.ndarray, np.ndarray | None]
# raw blocks uint8 [n_blocks, block_bytes] -> their groups
Unpack = Callable[[np.ndarray], Groups]
GroupKind = Literal["int4", "int8"]
PackedKernel = Literal["q4", "q8"]


@dataclass(frozen=True)
class QuantType:
    """One GGML type (see the module docstring)."""

    name: str
    block: int  # elements per block (a row is a whole number of blocks)
    block_bytes: int  # bytes per block
    group: int | None  # inputs per scale (and min); None: a float type, no scales
    bits: int  # bits per stored value
    has_min: bool  # the file stores a min per group (w = d * q + m); Q4_0's -8 d is derived
    # the exact groups `unpack` returns: "int4" (uint8 q in 0..15, always with a min: a
    # `weights.Int4Groups`), "int8" (int8 q, a min only when has_min: a `weights.Q8Groups`),
    # None: no exact groups, dequantized only
    groups: GroupKind | None = None
    unpack: Unpack | None = None
    # the packed kernel that runs a matrix of this type from its groups (weights.Linear's
    # "q4" / "q8", this package's C kernels), None: dense kernels (or int8 re-quantization)
    kernel: PackedKernel | None = None

    @property
    def int8_worth_it(self) -> bool:
        """A matrix of this type is lossy already and no 4-bit kernel runs its own values: its
        dense form is a dequantization, and an int8 re-quantization of it adds ~0.4-0.8% error
        (the table in `gguf`'s docstring) for half the bytes of bf16 per decode step, so the
        plan also times the int8 kernel (`loading.int8_worth_it`)."""
        return self.bits <= 8 and self.kernel != "q4"


# -- unpacking 4-bit blocks ---------------------------------------------------------------------

def _nibbles(qs: np.ndarray) -> np.ndarray:
    """32 values from 16 bytes, as ggml packs them: the low nibbles are elements 0..15, the
    high nibbles 16..31. ``qs``: [..., 16] -> [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _unpack_q4_0(blocks: np.ndarray) -> Groups:
    """``scale = d``, ``min = -8 d``; a block: d f16, 16 bytes of nibbles."""
    d = _half(blocks[:, :2])[:, 0]
    return _nibbles(blocks[:, 2:]), d, d * np.float32(-8)


def _unpack_q4_1(blocks: np.ndarray) -> Groups:
    """``scale = d``, ``min = m``; a block: d f16, m f16, 16 bytes of nibbles."""
    return _nibbles(blocks[:, 4:]), _half(blocks[:, :2])[:, 0], _half(blocks[:, 2:4])[:, 0]


def _unpack_q4_k(blocks: np.ndarray) -> Groups:
    """``scale = d * sc``, ``min = -dmin * m`` of each 32-wide sub-block (``sc``, ``m``: its
    6-bit packed scale and min); a block: d f16, dmin f16, 12 bytes of 6-bit scales and mins,
    128 bytes of nibbles."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])  # [n, 1]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each
    # 4 runs of 32 bytes; run j holds sub-block 2j in its low nibbles, 2j+1 in its high ones
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8 * 32)
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


# -- unpacking 8-, 6- and 5-bit blocks (to int8 groups) ------------------------------------------

def _unpack_q8_0(blocks: np.ndarray) -> Groups:
    """``q`` as stored, ``scale = d``, no min; a block: d f16, 32 int8."""
    return blocks[:, 2:].view(np.int8), _half(blocks[:, :2])[:, 0], None


def _five_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    """32 values in 0..31: 4 bytes of high bits (bit j: element j) at ``at``, then 16 bytes of
    nibbles (low: elements 0..15, high: 16..31)."""
    qh = np.ascontiguousarray(blocks[:, at: at + 4]).view(np.uint32)  # [n, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]
    return _nibbles(blocks[:, at + 4: at + 20]) | (high << 4)


def _unpack_q5_0(blocks: np.ndarray) -> Groups:
    """``q - 16`` (in -16..15), ``scale = d``, no min; a block: d f16, 4 bytes of high bits, 16
    bytes of nibbles."""
    return (_five_bits(blocks, 2).astype(np.int8) - np.int8(16)), _half(blocks[:, :2])[:, 0], None


def _unpack_q5_1(blocks: np.ndarray) -> Groups:
    """``q`` in 0..31, ``scale = d``, ``min = m``; a block: d f16, m f16, 4 bytes of high bits,
    16 bytes of nibbles."""
    return (_five_bits(blocks, 4).astype(np.int8), _half(blocks[:, :2])[:, 0],
            _half(blocks[:, 2:4])[:, 0])


def _unpack_q5_k(blocks: np.ndarray) -> Groups:
    """``q`` in 0..31 of each 32-wide sub-block, ``scale = d * sc``, ``min = -dmin * m`` (its
    6-bit packed scale and min, as Q4_K's); a block: d f16, dmin f16, 12 bytes of scales and
    mins, 32 bytes of high bits (byte j, bit i: element j of sub-block i), 128 bytes of
    nibbles (run j: sub-block 2j low, 2j + 1 high, as Q4_K's)."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])  # [n, 1]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, sub-block, 32]
    qs = blocks[:, 48:].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 256).astype(np.int8)
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _unpack_q6_k(blocks: np.ndarray) -> Groups:
    """``q - 32`` (in -32..31) of each 16-wide sub-block, ``scale = d * sc`` (its int8 scale),
    no min; a block: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales,
    d f16. Per half of 128 values: nibble run j (64 bytes, low then high nibbles) and 2-bit
    field f of the half's 32 high bytes give elements in the order gguf-py's dequantization
    reads them."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [n, 2, 4, 32]
    q = (low | (high << 4)).reshape(n, 256).astype(np.int8) - np.int8(32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _half(blocks[:, 208:210])  # [n, 1]
    return q, d * sc, None


# -- the table ------------------------------------------------------------------------------------

_ROWS = (
    #         name    block bytes group bits min    groups  unpack        kernel
    QuantType("F32",      1,   4, None, 32, False),
    QuantType("F16",      1,   2, None, 16, False),
    QuantType("BF16",     1,   2, None, 16, False),
    QuantType("Q8_0",    32,  34,   32,  8, False, "int8", _unpack_q8_0, "q8"),
    QuantType("Q4_0",    32,  18,   32,  4, False, "int4", _unpack_q4_0, "q4"),
    QuantType("Q4_1",    32,  20,   32,  4, True,  "int4", _unpack_q4_1, "q4"),
    QuantType("Q5_0",    32,  22,   32,  5, False, "int8", _unpack_q5_0, "q8"),
    QuantType("Q5_1",    32,  24,   32,  5, True,  "int8", _unpack_q5_1, "q8"),
    # K-quants: super-blocks of 256 in sub-blocks of 16 or 32 inputs, one scale (and min) each
    QuantType("Q2_K",   256,  84,   16,  2, True),
    QuantType("Q3_K",   256, 110,   16,  3, False),
    QuantType("Q4_K",   256, 144,   32,  4, True,  "int4", _unpack_q4_k, "q4"),
    QuantType("Q5_K",   256, 176,   32,  5, True,  "int8", _unpack_q5_k, "q8"),
    QuantType("Q6_K",   256, 210,   16,  6, False, "int8", _unpack_q6_k, "q8"),
)
# Types this package reads (gguf-py dequantizes them and the tests check them; Q4_K_M / Q4_K_S
# files mix Q4_K with Q5_K / Q6_K, Q2_K and Q3_K files carry Q4_K / Q5_K / Q6_K too), by name.
TYPES: dict[str, QuantType] = {t.name: t for t in _ROWS}
