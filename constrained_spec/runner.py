"""Target model runners: they own the KV cache and turn token ids into logits.

The engine knows nothing about tokenization or model internals; it talks to a runner in slots
(one per running request) and positions:

- ``forward(slots, tokens, num_logits)`` appends ``tokens[i]`` to slot ``slots[i]`` at the
  positions after its current length, in ONE batched forward for all slots, and returns the
  logits of the last ``num_logits[i]`` appended positions of each slot (fp32, concatenated).
- ``truncate(slot, n)`` keeps the first ``n`` positions. The cache is written by position, so
  rejected draft positions are simply overwritten by the next forward (no rollback copies).

``LlamaRunner`` is a lean, batched runner for Llama-family models (llama, mistral, qwen2: the
same block with or without q/k/v biases) with a per-slot cache indexed by position.
``HFRunner`` wraps any other ``transformers`` causal LM, one ``DynamicCache`` per slot.

4-bit weights: a checkpoint converted from a Q4_1 GGUF (the embedded model) holds, in every
group of 32 input weights of a row, exactly ``d * q + m`` with ``q`` in 0..15. On the CPU in
bfloat16, ``LlamaRunner`` detects that (`pack_int4`: the weights re-quantize with zero error)
and multiplies with torch's int4 weight-only kernel instead of a dense bf16 GEMM: the quantized
values are the file's own (only ``d`` and the zero point are rounded to bf16), a quarter of the
bytes are read, and a 1-token step is ~2x faster. The kernel's cost grows with the rows of a
forward, so past `INT4_MAX_ROWS` rows the dense bf16 copy is used. Weights that are not exactly
4-bit stay dense.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

_LLAMA_FAMILY = {"llama", "mistral", "qwen2"}


def make_runner(model: Any, *, dtype: torch.dtype, device: torch.device,
                int4: dict[str, Any] | None = None) -> Runner:
    """The fastest runner that supports ``model``'s architecture (``int4``: see `int4_weights`)."""
    if is_llama_family(model):
        return LlamaRunner(model, dtype=dtype, device=device, int4=int4)
    return HFRunner(model, dtype=dtype, device=device)


def is_llama_family(model: Any) -> bool:
    return getattr(model.config, "model_type", None) in _LLAMA_FAMILY and _plain_rope(model.config)


INT4_GROUP = 32
# Up to this many rows in a forward (batch x tokens) the int4 kernel is faster than the dense
# bf16 GEMM; its cost grows ~linearly with rows (measured crossover ~12 on a 2-core x86 CPU).
INT4_MAX_ROWS = 12


def pack_int4(weight: torch.Tensor, group: int = INT4_GROUP, *,
              exact: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(packed, scales_and_zeros)`` for torch's CPU int4 kernel when every group of ``group``
    input weights of every row is exactly ``d * q + m`` with ``q`` in 0..15 (as dequantized
    from a Q4_1 GGUF), else None. ``weight``: float32 [N, K]. ``exact=False`` quantizes any
    weight that way (round to nearest; for draft heads, whose drafts are verified anyway)."""
    N, K = weight.shape
    if weight.dtype != torch.float32 or K % group or N % 16:
        return None
    g = weight.view(N, K // group, group)
    lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
    d = (hi - lo) / 15
    q = (g - lo).mul_(torch.where(d == 0, torch.zeros_like(d), 1.0 / d)).round_().clamp_(0, 15)
    # exact up to fp32 rounding of d * q + m (the converter computed the same expression)
    err = (q * d).add_(lo).sub_(g).abs_()
    if exact and not bool((err <= 1e-6 * (hi.abs() + lo.abs())).all()):
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(N, K).to(torch.int32), 1)
    # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.cat([d, lo + 8 * d], -1).view(N, K // group, 2).transpose(0, 1)
    return packed, scales_zeros.contiguous().to(torch.bfloat16)



def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(int8 weight [N, K], bf16 scales [N])`` for torch's CPU int8 weight-only kernel:
    symmetric round-to-nearest per output row (~1% relative error, as fast per few-row forward
    as the int4 kernel and ~8x faster than a bf16 GEMV on the CPU). For drafters, whose tokens
    the target verifies. None when the kernel is missing."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scales.to(torch.bfloat16)


def _layer_weights(layer: Any) -> dict[str, torch.Tensor]:
    a, m = layer.self_attn, layer.mlp
    return {"qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "o": a.o_proj.weight,
            "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            "down": m.down_proj.weight}


def int4_weights(model: Any) -> dict[str, Any] | None:
    """Packed int4 weights for every linear of a Llama-family ``model`` whose float32 weights
    are exactly 4-bit (see `pack_int4`), keyed ``"{layer}.{name}"``; None when there are none,
    the model is not Llama-family, or the kernel is missing. Call before casting to bf16."""
    if not is_llama_family(model) or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    packs = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name, w in _layer_weights(layer).items():
                try:
                    packed = pack_int4(w.detach())
                except RuntimeError:  # a torch build without the CPU int4 kernel
                    return None
                if packed is not None:
                    packs[f"{i}.{name}"] = packed
    return packs or None


def _plain_rope(config: Any) -> bool:
    # Sliding windows would need a different mask; anything else we hand to transformers.
    return getattr(config, "sliding_window", None) in (None, 0) or not getattr(
        config, "use_sliding_window", False)


class Runner:
    """Slot bookkeeping shared by the runners."""

    vocab_size: int
    max_context: int

    def __init__(self) -> None:
        self._lengths: dict[int, int] = {}
        self._next = 0
        self._free: list[int] = []

    def new_slot(self) -> int:
        slot = self._free.pop() if self._free else self._take_new_slot()
        self._lengths[slot] = 0
        return slot

    def _take_new_slot(self) -> int:
        slot = self._next
        self._next += 1
        return slot

    def free_slot(self, slot: int) -> None:
        if self._lengths.pop(slot, None) is not None:
            self._free.append(slot)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    @property
    def slots_in_use(self) -> int:
        """Slots handed out by `new_slot` and not freed yet."""
        return len(self._lengths)

    def truncate(self, slot: int, length: int) -> None:
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._lengths[slot]} to {length}")
        self._lengths[slot] = length

    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def enable_features(self, layers: Sequence[int]) -> None:
        from .errors import ConfigError

        raise ConfigError(f"{type(self).__name__} does not keep hidden states; drafters that read "
                          "them (eagle3, mtp) need a Llama-family target (llama, mistral, qwen2)",
                          option="speculative.method")


class LlamaRunner(Runner):
    """Batched Llama-family forward with a position-indexed KV cache per slot."""

    def __init__(self, model: Any, *, dtype: torch.dtype, device: torch.device,
                 int4: dict[str, Any] | None = None) -> None:
        super().__init__()
        cfg = model.config
        self.device, self.dtype = device, dtype
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_context = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        self.rotary = model.model.rotary_emb
        inner = model.model

        def w(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(device=device, dtype=dtype).contiguous()

        self.embed = w(inner.embed_tokens.weight)
        self.lm_head = w(model.get_output_embeddings().weight)
        self.norm = w(inner.norm.weight)
        # int4 kernels: CPU, bf16 activations only (the kernel's scales are bf16)
        use_int4 = int4 is not None and device.type == "cpu" and dtype == torch.bfloat16
        self.int4_linears = 0
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a = layer.self_attn
            bias = None
            if a.q_proj.bias is not None:
                bias = w(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            entry: dict[str, Any] = {"ln1": w(layer.input_layernorm.weight), "qkv_bias": bias,
                                         "ln2": w(layer.post_attention_layernorm.weight)}
            for name, weight in _layer_weights(layer).items():
                packed = int4.get(f"{i}.{name}") if use_int4 else None
                entry[name] = w(weight)
                entry[name + "_int4"] = packed if packed is not None else entry[name]
                self.int4_linears += packed is not None
            self.layers.append(entry)
        self.vocab_size = int(self.lm_head.shape[0])
        self.lm_head_packed: Any = None  # packed LM head of a draft model (quantize_for_drafting)
        self.int4_max_rows = INT4_MAX_ROWS
        self._cap_slots, self._cap_len = 0, 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # hidden states kept per slot and position for drafters that read them (EAGLE-3, MTP)
        self.feature_layers: tuple[int, ...] = ()
        self.f_cache: torch.Tensor | None = None

    def quantize_for_drafting(self) -> int:
        """Run every linear of every layer and the LM head on the int8 weight-only kernel
        (`pack_int8`) for few-row forwards -- those on exact int4 weights stay on int4: for a
        DRAFT model only, whose tokens the target verifies (its drafts may change, the output
        does not). CPU bf16 only (elsewhere nothing changes). Returns the number of matrices
        packed."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return 0
        packed = 0
        for L in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                if isinstance(L[name + "_int4"], torch.Tensor):
                    pack = pack_int8(L[name])
                    if pack is not None:
                        L[name + "_int4"] = pack
                        packed += 1
        self.lm_head_packed = pack_int8(self.lm_head)
        self.int4_linears += packed
        return packed + (self.lm_head_packed is not None)

    # -- features -------------------------------------------------------------------------
    def enable_features(self, layers: Sequence[int]) -> None:
        """From now on every forward keeps, per slot and position, the hidden states of
        ``layers`` (transformers' ``hidden_states`` numbering: 0 = embeddings, i = output of
        decoder layer i - 1, the last (n_layers, or -1) after the final norm), read back with `features`. Several
        drafters may ask: the union is kept (positions cached before a change read as zeros)."""
        for i in layers:
            if not (i == -1 or 0 <= i <= self.n_layers):
                raise ValueError(f"feature layer {i} is not in -1, 0..{self.n_layers}")
        union = tuple(sorted(set(self.feature_layers) | {int(i) for i in layers}))
        if union != self.feature_layers:
            self.feature_layers = union
            self.f_cache = None
            if self._cap_slots:
                self._alloc_features()

    def _alloc_features(self) -> None:
        D = self.embed.shape[1]
        self.f_cache = torch.zeros((self._cap_slots, self._cap_len, len(self.feature_layers) * D),
                                   device=self.device, dtype=self.dtype)

    def features(self, slot: int, start: int, end: int, layers: Sequence[int]) -> torch.Tensor:
        """[end - start, len(layers) * D]: the kept hidden states of ``layers`` (each enabled
        with `enable_features`) at positions start..end-1 of ``slot``."""
        D = self.embed.shape[1]
        rows = self.f_cache[slot, start:end]
        if tuple(layers) == self.feature_layers:
            return rows
        cols = [self.feature_layers.index(i) * D for i in layers]
        return torch.cat([rows[:, c: c + D] for c in cols], dim=-1)

    # -- cache ----------------------------------------------------------------------------
    def _ensure_capacity(self, slots: int, length: int) -> None:
        if slots <= self._cap_slots and length <= self._cap_len:
            return
        new_slots = self._cap_slots if slots <= self._cap_slots else max(slots, 2 * self._cap_slots, 4)
        new_len = self._cap_len
        while new_len < length:
            new_len = max(256, new_len * 2)
        new_len = min(max(new_len, length), max(self.max_context, length))
        shape = (new_slots, new_len, self.n_kv, self.head_dim)
        for cache in (self.k_cache, self.v_cache):
            for i in range(self.n_layers):
                fresh = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if i < len(cache):
                    fresh[: self._cap_slots, : self._cap_len] = cache[i]
                    cache[i] = fresh
                else:
                    cache.append(fresh)
        old_f, old_slots, old_len = self.f_cache, self._cap_slots, self._cap_len
        self._cap_slots, self._cap_len = new_slots, new_len
        if self.feature_layers:
            self._alloc_features()
            if old_f is not None:
                self.f_cache[:old_slots, :old_len] = old_f

    # -- forward --------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: normalise in fp32, scale in the model dtype
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: bool = False) -> Any:
        B = len(slots)
        T = max(len(t) for t in tokens)
        starts = [self._lengths[s] for s in slots]
        ends = [st + len(t) for st, t in zip(starts, tokens)]
        # padded rows write up to start + T - 1: the cache must hold them too
        self._ensure_capacity(max(slots) + 1, max(starts) + T)
        dev = self.device
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        ids = ids.to(dev)
        start_t = torch.tensor(starts, device=dev)
        pos = start_t[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]
        Lk = max(ends)
        # key j is visible to query at position p iff j <= p (stale/padded keys sit beyond p)
        mask = torch.arange(Lk, device=dev)[None, None, :] <= pos[:, :, None]  # [B, T, Lk]
        mask = mask[:, None]  # [B, 1, T, Lk]
        slot_t = torch.tensor(slots, device=dev)
        contiguous = list(slots) == list(range(slots[0], slots[0] + B))

        x = F.embedding(ids, self.embed)  # [B, T, D]
        cos, sin = self.rotary(x, pos)  # [B, T, hd]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, hd]
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        write_idx = (slot_t[:, None].expand(B, T), pos)
        # the int4 kernel costs ~linear in rows; past a dozen the dense GEMM is cheaper
        sfx = "_int4" if self.int4_linears and B * T <= self.int4_max_rows else ""
        keep = self.feature_layers
        kept: dict[int, torch.Tensor] = {}
        for i, L in enumerate(self.layers):
            if i in keep:
                kept[i] = x
            h = self._rms(x, L["ln1"])
            qkv = _linear(h, L["qkv" + sfx], L["qkv_bias"]).view(B, T, H + 2 * KV, hd)
            qk = qkv[:, :, : H + KV]
            qk = qk * cos + _rotate_half(qk) * sin  # RoPE on q and k heads at once
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + KV:]  # [B, T, heads, hd]
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.index_put_(write_idx, k)  # cache layout [S, L, KV, hd]
            vc.index_put_(write_idx, v)
            if contiguous:
                keys = kc[slots[0]: slots[0] + B, :Lk]
                vals = vc[slots[0]: slots[0] + B, :Lk]
            else:
                keys = kc.index_select(0, slot_t)[:, :Lk]
                vals = vc.index_select(0, slot_t)[:, :Lk]
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
                enable_gqa=KV != H, scale=1.0 / math.sqrt(hd))  # [B, H, T, hd]
            x = x + _linear(attn.transpose(1, 2).reshape(B, T, H * hd), L["o" + sfx])
            h = self._rms(x, L["ln2"])
            gate, up = _linear(h, L["gate_up" + sfx]).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, L["down" + sfx])
        if keep:
            if self.n_layers in keep or -1 in keep:  # the last one after the final norm
                kept[self.n_layers] = kept[-1] = self._rms(x, self.norm)
            self.f_cache.index_put_(write_idx, torch.cat([kept[i] for i in keep], dim=-1))
        for s, e in zip(slots, ends):
            self._lengths[s] = e
        # logits only for the rows asked for: the last num_logits[b] real positions of each slot
        rows = [b * T + len(t) - n + j for b, (t, n) in enumerate(zip(tokens, num_logits)) for j in range(n)]
        idx = torch.tensor(rows, device=dev, dtype=torch.long)
        hidden = x.reshape(B * T, -1).index_select(0, idx)
        hidden = self._rms(hidden, self.norm)
        head = self.lm_head_packed if self.lm_head_packed is not None and len(rows) <= self.int4_max_rows \
            else self.lm_head
        logits = _linear(hidden, head).float()  # [sum num_logits, V]
        return (logits, hidden) if return_hidden else logits


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    packed, scales = weight  # see pack_int4 / pack_int8
    x2 = x.reshape(-1, x.shape[-1])
    if packed.dtype == torch.int8:
        y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), packed, scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, INT4_GROUP, scales)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class HFRunner(Runner):
    """Any transformers causal LM: one DynamicCache per slot, one forward per slot."""

    def __init__(self, model: Any, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device = device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        self._caches: dict[int, Any] = {}
        import inspect

        # transformers 5.x renamed past_key_values -> cache
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def new_slot(self) -> int:
        from transformers import DynamicCache

        slot = super().new_slot()
        self._caches[slot] = DynamicCache()
        return slot

    def free_slot(self, slot: int) -> None:
        self._caches.pop(slot, None)
        super().free_slot(slot)

    def truncate(self, slot: int, length: int) -> None:
        super().truncate(slot, length)
        cache = self._caches[slot]
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)  # a negative crop removes from the end in every transformers version

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: bool = False) -> Any:
        out, hid = [], []
        for s, t, n in zip(slots, tokens, num_logits):
            ids = torch.tensor([list(t)], device=self.device)
            start = self._lengths[s]
            pos = torch.arange(start, start + len(t), device=self.device)[None]
            res = self.model(input_ids=ids, use_cache=True, position_ids=pos,
                             output_hidden_states=return_hidden, logits_to_keep=max(n, 1),
                             **{self._cache_kw: self._caches[s]})
            self._lengths[s] = start + len(t)
            out.append(res.logits[0, res.logits.shape[1] - n:].float())
            if return_hidden:
                hid.append(res.hidden_states[-1][0, len(t) - n:])
        logits = torch.cat(out)
        return (logits, torch.cat(hid)) if return_hidden else logits
