"""A decoder's whole decode / verify layer stack in ONE native call (``cs_forward`` in
cpu_native.c): the lean runner's exact decode rows without ~40 small torch ops per layer.

For every layer and row: RMSNorm, the fused QKV product, the q / k norms (qk-norm), RoPE, the
k / v cache write, the exact attention (`cpu_native.attention`'s kernel), the output
projection, the residual, RMSNorm, the gate / up product with SiLU or tanh-GELU times up, the
down product, the residual; the family switches of `constrained_spec.model.families` that
reach a layer are fields of it here: q/k/v, o and MLP biases, q/k norms, Gemma's ``1 + w``
norms in float32 and its norms after attention and MLP, sliding windows (each layer reads its
window's attention rows), attention soft-capping and scale, partial rotary, per-layer RoPE
tables. What stays in torch around the call: the embeddings (and their scale), the RoPE
tables (the model's own rotary module, whatever its scaling), and the final norm, LM head and
logit soft-cap (the LM head is one native product already: `cpu_native.matmul`).

Numerics: every step rounds to bfloat16 where the runner's torch path does, so the two differ
only in the order of float32 sums inside a norm, a product or the activation
(docs/performance.md states the measured difference). Row invariance: a row's bits depend only
on the row (each row is computed by one thread with the same instruction sequence, as in the
q4 / q8 and attention kernels), so a 7-row verify gives each row the bits of a 1-row decode.
Threads: one OpenMP team for the whole forward; each step is a worksharing loop of it (over
rows, weight tiles or attention tasks).

Where the plan says ``act=int8`` (the default, `settings.Settings.activations`): the 4-bit
products on int8 activations (``int8_activations=True``; `LeanRunner.int8_activations`), each
row's groups of 32 inputs quantized on their own (llama.cpp's Q8_0 scheme, float32 scales).
Still row-invariant (decode and verify rows take it alike, so speculation on = off), but not
bit-equal to the bf16 products: docs/performance.md states the difference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from constrained_spec.kernels import cpu_native
from constrained_spec.kernels.cpu_native import GroupPack


class _Lin(ctypes.Structure):
    """cpu_native.c's ``cs_lin``."""

    _fields_ = [("pack", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int),
                ("k", ctypes.c_int), ("bits", ctypes.c_int), ("half", ctypes.c_int),
                ("has_min", ctypes.c_int), ("group", ctypes.c_int)]


class _Layer(ctypes.Structure):
    """cpu_native.c's ``cs_layer``."""

    _fields_ = [("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin),
                ("attn_in", ctypes.c_void_p), ("mlp_in", ctypes.c_void_p),
                ("attn_out", ctypes.c_void_p), ("mlp_out", ctypes.c_void_p),
                ("qk_norm", ctypes.c_void_p), ("rope", ctypes.c_int), ("window", ctypes.c_int)]


class _Model(ctypes.Structure):
    """cpu_native.c's ``cs_model``."""

    _fields_ = [("layers", ctypes.c_int), ("D", ctypes.c_int), ("H", ctypes.c_int),
                ("KV", ctypes.c_int), ("hd", ctypes.c_int), ("I", ctypes.c_int),
                ("rot", ctypes.c_int), ("norm_offset", ctypes.c_int), ("gelu", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("int8", ctypes.c_int)]


@dataclass(eq=False)
class NativeLinear:
    """One packed weight (`cpu_native.pack` or `cpu_native.pack_q8`) and its bias (added as
    bfloat16, as the torch path adds it), or None."""

    pack: GroupPack
    bias: torch.Tensor | None = None


@dataclass(eq=False)
class NativeLayer:
    """One decoder layer: its four products and its norm weights as the products read them
    (float32 values: a bfloat16 weight converted exactly, or Gemma's ``1 + w``); ``qk_norm``
    [H + KV, hd]; ``rope`` and ``window``: which RoPE table and which attention rows of the call
    it reads."""

    qkv: NativeLinear
    o: NativeLinear
    gate_up: NativeLinear
    down: NativeLinear
    attn_in: torch.Tensor
    mlp_in: torch.Tensor
    attn_out: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None
    rope: int = 0
    window: int = 0


def available() -> bool:
    """Whether the one-call forward runs here (the native library loads and has it)."""
    return cpu_native.forward_function() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeForward:
    """The layer stack of one model, ready to run (it holds what the native structs point to).

    ``heads``, ``kv_heads``, ``head_dim``: the attention's shape; ``eps``: the norms'; ``scale``
    and ``softcap`` (None: none): the attention's; ``norm_offset``: Gemma's ``1 + w`` norms
    (product in float32); ``gelu``: tanh-GELU instead of SiLU; ``int8_activations``: the 4-bit
    products quantize their input rows to int8 per group of 32 and multiply in integers
    (`cpu_native.int8_instructions`; not exact against the bf16 products, still row-invariant).
    ``ValueError`` when a layer's shapes do not fit the kernel, or int8 activations are asked
    for where the library has none (the caller runs its torch path instead).
    """

    def __init__(self, layers: Sequence[NativeLayer], *, heads: int, kv_heads: int, head_dim: int,
                 eps: float, scale: float, softcap: float | None, norm_offset: bool, gelu: bool,
                 int8_activations: bool = False) -> None:
        fn = cpu_native.forward_function()
        if fn is None:
            raise ValueError(f"the native forward is not available here ({cpu_native.why_unavailable()})")
        if int8_activations and not cpu_native.int8_activations():
            raise ValueError("int8 activations need the native q4 kernel with int8 activations, "
                             "which this library lacks")
        self._fn = fn
        first = layers[0]
        D, inner = first.o.pack.n, first.down.pack.k
        self.hidden = D
        self._model = _Model(layers=len(layers), D=D, H=heads, KV=kv_heads, hd=head_dim, I=inner,
                             rot=head_dim, norm_offset=int(norm_offset), gelu=int(gelu), eps=eps,
                             scale=scale, softcap=softcap or 0.0, int8=int(int8_activations))
        # the tensors the structs point to, kept alive with them
        self._held: list[torch.Tensor] = []
        self._layers = (_Layer * len(layers))(*[self._layer(L) for L in layers])
        self._tables = 1 + max(L.rope for L in layers)  # RoPE tables and windows a call brings
        self._windows = 1 + max(L.window for L in layers)
        if not cpu_native.attention_supports(head_dim, heads, kv_heads):
            raise ValueError(f"the native attention does not take {heads} heads over {kv_heads} of {head_dim}")

    def _hold(self, t: torch.Tensor | None, dtype: torch.dtype) -> int | None:
        if t is None:
            return None
        t = t.detach().to(device="cpu", dtype=dtype).contiguous()
        self._held.append(t)
        return _ptr(t)

    def _lin(self, lin: NativeLinear) -> _Lin:
        p = lin.pack
        self._held.append(p.data)
        return _Lin(pack=p.data.data_ptr(), bias=self._hold(lin.bias, torch.bfloat16), n=p.n, k=p.k,
                    bits=p.bits, half=int(p.half), has_min=int(p.has_min), group=p.group)

    def _layer(self, L: NativeLayer) -> _Layer:
        f32 = torch.float32
        return _Layer(qkv=self._lin(L.qkv), o=self._lin(L.o), gate_up=self._lin(L.gate_up),
                      down=self._lin(L.down), attn_in=self._hold(L.attn_in, f32),
                      mlp_in=self._hold(L.mlp_in, f32), attn_out=self._hold(L.attn_out, f32),
                      mlp_out=self._hold(L.mlp_out, f32), qk_norm=self._hold(L.qk_norm, f32),
                      rope=L.rope, window=L.window)

    def __call__(self, x: torch.Tensor, write: torch.Tensor, k_cache: Sequence[torch.Tensor],
                 v_cache: Sequence[torch.Tensor], rope: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 rows: Sequence[torch.Tensor], keep: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Run every layer on ``x`` (bfloat16 [R, D], contiguous; overwritten with the last
        layer's output, which is returned). ``write``: int32 [2, R], each row's cache slot and
        position; ``k_cache`` / ``v_cache``: per layer, bfloat16 [slots, L, KV, hd] (written at
        those rows, then read); ``rope``: per RoPE table, (cos, sin) bfloat16 [R, rot_dim];
        ``rows``: per window, `cpu_native.attention`'s int32 [3, R]; ``keep``: per layer None or
        a bfloat16 [R, D] that receives the layer's input (the runner's kept features)."""
        m = self._model
        R = x.shape[0]
        n = m.layers
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or tuple(x.shape) != (R, m.D):
            raise ValueError(f"x must be contiguous bfloat16 [rows, {m.D}], not {x.dtype} {tuple(x.shape)}")
        if len(k_cache) != n or len(v_cache) != n or len(keep) != n:
            raise ValueError(f"one k cache, v cache and keep entry per layer ({n})")
        caches = []
        for k, v in zip(k_cache, v_cache):
            if not (k.dtype == v.dtype == torch.bfloat16 and k.is_contiguous() and v.is_contiguous()
                    and k.shape == v.shape and tuple(k.shape[2:]) == (m.KV, m.hd)):
                raise ValueError("the caches must be contiguous bfloat16 [slots, positions, KV, hd]")
            caches += [k.data_ptr(), v.data_ptr()]
        L = int(k_cache[0].shape[1])
        if len(rope) < self._tables or len(rows) < self._windows:
            raise ValueError(f"the layers read {self._tables} RoPE tables and {self._windows} windows' "
                             f"rows, the call brings {len(rope)} and {len(rows)}")
        tables = [t.to(torch.bfloat16).reshape(R, -1).contiguous() for pair in rope for t in pair]
        m.rot = int(tables[0].shape[1])
        rows = [r.to(torch.int32).contiguous() for r in rows]
        write = write.to(torch.int32).contiguous()
        for kt in keep:
            if kt is not None and (kt.dtype != torch.bfloat16 or not kt.is_contiguous() or kt.numel() != x.numel()):
                raise ValueError("a keep buffer must be contiguous bfloat16 of x's shape")
        vp = ctypes.c_void_p
        rc = self._fn(ctypes.byref(m), self._layers, R, x.data_ptr(), write.data_ptr(),
                      (vp * (2 * n))(*caches), L, (vp * len(tables))(*[t.data_ptr() for t in tables]),
                      (vp * len(rows))(*[r.data_ptr() for r in rows]),
                      (vp * n)(*[_ptr(kt) for kt in keep]))
        if rc == -2:
            raise ValueError(f"the native forward does not take this model's shapes (rot dim {m.rot})")
        if rc:
            raise MemoryError("the native forward could not allocate its buffers")
        return x
