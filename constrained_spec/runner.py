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

from .weights import (
    ACT_DTYPE,
    GROUP,
    Int4Groups,
    Linear,
    int4_kernel_available,
    int8_kernel_available,
    int8_pack,
    packed_matmul,
)

_LLAMA_FAMILY = {"llama", "mistral", "qwen2"}


def make_runner(model: Any, *, dtype: torch.dtype, device: torch.device,
                int4: dict[str, Any] | None = None) -> Runner:
    """The fastest runner that supports ``model``'s architecture (``int4``: see `int4_weights`)."""
    if is_llama_family(model):
        return LlamaRunner(model, dtype=dtype, device=device, int4=int4)
    return HFRunner(model, dtype=dtype, device=device)


def is_llama_family(model: Any) -> bool:
    return getattr(model.config, "model_type", None) in _LLAMA_FAMILY and _plain_rope(model.config)


def lean_runner_supports(model: Any) -> bool:
    """Whether `make_runner` gives ``model`` the lean runner (kernel plans, packed weights)."""
    return is_llama_family(model)


INT4_GROUP = GROUP
# Up to this many rows in a forward (batch x tokens) the int4 kernel is faster than the dense
# bf16 GEMM on a CPU with bf16 units (measured crossover ~12 on a 2-core x86 CPU): the bucket
# of the plan for an explicit bfloat16 dtype and for draft models. A measured plan finds its own.
INT4_MAX_ROWS = 12
_LINEARS = ("qkv", "o", "gate_up", "down")


def pack_int4(weight: torch.Tensor, group: int = INT4_GROUP, *,
              exact: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(packed, scales_and_zeros)`` for torch's CPU int4 kernel when every group of 32 input
    weights of every row is exactly ``d * q + m`` (`weights.Int4Groups.from_dense`), else None.
    ``exact=False`` quantizes any weight that way (round to nearest)."""
    if group != GROUP or weight.shape[0] % 16:
        return None
    groups = Int4Groups.from_dense(weight, exact=exact)
    return None if groups is None else groups.int4_pack()


pack_int8 = int8_pack


def _layer_weights(layer: Any) -> dict[str, torch.Tensor]:
    a, m = layer.self_attn, layer.mlp
    return {"qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "o": a.o_proj.weight,
            "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            "down": m.down_proj.weight}


def int4_weights(model: Any) -> dict[str, Int4Groups] | None:
    """The exact 4-bit groups (`weights.Int4Groups`) of every linear of a Llama-family
    ``model`` whose float32 weights are exactly 4-bit, keyed ``"{layer}.{name}"``; None when
    there are none, the model is not Llama-family, or the CPU kernel is missing. Call before
    casting to bf16."""
    if not is_llama_family(model) or not int4_kernel_available():
        return None
    groups = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name, w in _layer_weights(layer).items():
                g = Int4Groups.from_dense(w.detach()) if w.shape[0] % 16 == 0 else None
                if g is not None:
                    groups[f"{i}.{name}"] = g
    return groups or None


def _default_plan(dtype: torch.dtype, int4: bool) -> Any:
    from .plan import KernelPlan

    if dtype == torch.float32:
        return KernelPlan.uniform("fp32")
    return KernelPlan(prefill="bf16", decode=[(INT4_MAX_ROWS, "int4" if int4 else "bf16"),
                                             (1 << 30, "bf16")], lm_head="bf16")


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

        def lin(weight: torch.Tensor, key: str | None, bias: torch.Tensor | None = None) -> Linear:
            groups = (int4 or {}).get(key) if key is not None and device.type == "cpu" else None
            if groups is not None:
                return Linear(int4=groups, bias=bias)
            # dense weights are kept in the runner's dtype (bf16 by default: half the bytes)
            return Linear(dense=w(weight), bias=bias)

        self.embed = w(inner.embed_tokens.weight)
        self.lm_head_weight = lin(model.get_output_embeddings().weight, None)
        self.lm_head = self.lm_head_weight.dense  # drafters share the target's LM head rows
        self.norm = w(inner.norm.weight)
        self.int4_linears = 0
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a = layer.self_attn
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            entry: dict[str, Any] = {"ln1": w(layer.input_layernorm.weight),
                                     "ln2": w(layer.post_attention_layernorm.weight)}
            for name, weight in _layer_weights(layer).items():
                entry[name] = lin(weight, f"{i}.{name}", bias if name == "qkv" else None)
                self.int4_linears += entry[name].int4 is not None
            self.layers.append(entry)
        self.vocab_size = int(self.lm_head_weight.shape[0])
        self.hidden_size = int(self.embed.shape[1])
        # which kernel runs each phase (constrained_spec.plan); until a plan is chosen, as
        # before plans: the 4-bit kernel for few rows where exact, dense in `dtype` otherwise
        self.plan = _default_plan(dtype, bool(self.int4_linears) and device.type == "cpu")
        self.kv_dtype = torch.float32 if self.plan.kv == "fp32" else torch.bfloat16
        self._cap_slots, self._cap_len = 0, 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # hidden states kept per slot and position for drafters that read them (EAGLE-3, MTP)
        self.feature_layers: tuple[int, ...] = ()
        self.f_cache: torch.Tensor | None = None

    def quantize_for_drafting(self) -> int:
        """Run every linear and the LM head on the weight-only quantized kernels for few-row
        forwards (`weights.int8_pack`; those on exact 4-bit weights stay on int4): for a DRAFT
        model only, whose tokens the target verifies (its drafts may change, the output does
        not). CPU bf16 only (elsewhere nothing changes). Returns the number of matrices on a
        quantized kernel."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not int8_kernel_available():
            return 0
        from .plan import KernelPlan

        self.plan = KernelPlan(prefill="bf16", decode=[(INT4_MAX_ROWS, "int8"), (1 << 30, "bf16")],
                               lm_head="int8", source="drafting")
        linears = [L[n] for L in self.layers for n in _LINEARS] + [self.lm_head_weight]
        for lin in linears:
            lin.prepare({self._kernel(lin, "int8"), "bf16"}, resident=lin.int4 is None)
        self.int4_linears = len(linears) - 1
        return len(linears)

    # -- kernels --------------------------------------------------------------------------
    def supports_kernel(self, kernel: str) -> bool:
        """Whether ``kernel`` runs any of this runner's linears (the others fall back)."""
        return any(L[n].supports(kernel) for L in self.layers for n in _LINEARS)

    @staticmethod
    def _kernel(lin: Linear, kernel: str) -> str:
        # "int8" means weight-only quantized: the exact 4-bit groups where the file has them;
        # "int4" on a weight without them runs its dense bf16 form (same activations)
        if kernel == "int8" and lin.supports("int4"):
            return "int4"
        return kernel if lin.supports(kernel) else "bf16"

    def set_plan(self, plan: Any) -> None:
        """Use ``plan`` from now on: build the packs and resident copies its kernels need, drop
        the rest, and put the KV cache in its dtype."""
        self.plan = plan
        decode = {k for _, k in plan.decode}
        for L in self.layers:
            for n in _LINEARS:
                lin = L[n]
                kernels = {self._kernel(lin, k) for k in plan.kernels()}
                # dense forms a decode step uses stay resident (a per-step dequantization
                # would cost more than the step); prefill may dequantize per call
                lin.prepare(kernels, resident=any(k in ("fp32", "bf16") for k in
                                                  {self._kernel(lin, d) for d in decode}))
        self.lm_head_weight.prepare({self._kernel(self.lm_head_weight, plan.lm_head)}, resident=True)
        self.reset_cache()

    def reset_cache(self) -> None:
        """Drop every slot's cache (lengths too) and reallocate it in the plan's KV dtype."""
        for s in list(self._lengths):
            self._lengths[s] = 0
        self.kv_dtype = torch.float32 if self.plan.kv == "fp32" else torch.bfloat16
        self._cap_slots, self._cap_len = 0, 0
        self.k_cache, self.v_cache = [], []
        self.f_cache = None

    def lm_head_linear(self, hidden: torch.Tensor, kernel: str) -> torch.Tensor:
        return self.lm_head_weight(hidden, self._kernel(self.lm_head_weight, kernel))

    def resident_bytes(self) -> int:
        """Bytes of weights this runner holds (packs, resident dense copies, embeddings)."""
        linears = [L[n] for L in self.layers for n in _LINEARS] + [self.lm_head_weight]
        total = sum(lin.nbytes() for lin in linears)
        if self.lm_head_weight.dense is None or self.embed.data_ptr() != self.lm_head_weight.dense.data_ptr():
            total += self.embed.numel() * self.embed.element_size()
        return total

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
                fresh = torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
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
        # as transformers' LlamaRMSNorm: normalise in fp32, scale in the activations' dtype
        return weight.to(x.dtype) * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _matmul(self, x: torch.Tensor, L: dict[str, Any], name: str, kernel: str) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for the layer's linear ``name`` with the phase's ``kernel``."""
        lin = L[name]
        return lin(x, self._kernel(lin, kernel))

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: bool = False,
                phase: str | None = None) -> Any:
        """``phase``: "prefill" (a prompt) or "decode" (decode / verify rows); None = prefill
        when no logits are asked for. It picks the kernel from the plan."""
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

        if phase is None:
            phase = "decode" if any(num_logits) else "prefill"
        kernel = (self.plan.prefill_kernel if phase == "prefill" else self.plan.decode_kernel)(B * T)
        act = ACT_DTYPE[kernel]
        x = F.embedding(ids, self.embed).to(act)  # [B, T, D]
        cos, sin = self.rotary(x, pos)  # [B, T, hd]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, hd]
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        write_idx = (slot_t[:, None].expand(B, T), pos)
        keep = self.feature_layers
        kept: dict[int, torch.Tensor] = {}
        for i, L in enumerate(self.layers):
            if i in keep:
                kept[i] = x
            h = self._rms(x, L["ln1"])
            qkv = self._matmul(h, L, "qkv", kernel).view(B, T, H + 2 * KV, hd)
            qk = qkv[:, :, : H + KV]
            qk = qk * cos + _rotate_half(qk) * sin  # RoPE on q and k heads at once
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + KV:]  # [B, T, heads, hd]
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.index_put_(write_idx, k.to(kc.dtype))  # cache layout [S, L, KV, hd]
            vc.index_put_(write_idx, v.to(vc.dtype))
            if contiguous:
                keys = kc[slots[0]: slots[0] + B, :Lk]
                vals = vc[slots[0]: slots[0] + B, :Lk]
            else:
                keys = kc.index_select(0, slot_t)[:, :Lk]
                vals = vc.index_select(0, slot_t)[:, :Lk]
            keys, vals = keys.to(act), vals.to(act)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
                enable_gqa=KV != H, scale=1.0 / math.sqrt(hd))  # [B, H, T, hd]
            x = x + self._matmul(attn.transpose(1, 2).reshape(B, T, H * hd), L, "o", kernel)
            h = self._rms(x, L["ln2"])
            gate, up = self._matmul(h, L, "gate_up", kernel).chunk(2, dim=-1)
            x = x + self._matmul(F.silu(gate) * up, L, "down", kernel)
        if keep:
            if self.n_layers in keep or -1 in keep:  # the last one after the final norm
                kept[self.n_layers] = kept[-1] = self._rms(x, self.norm)
            self.f_cache.index_put_(write_idx, torch.cat([kept[i] for i in keep], dim=-1).to(self.f_cache.dtype))
        for s, e in zip(slots, ends):
            self._lengths[s] = e
        # logits only for the rows asked for: the last num_logits[b] real positions of each slot
        rows = [b * T + len(t) - n + j for b, (t, n) in enumerate(zip(tokens, num_logits)) for j in range(n)]
        idx = torch.tensor(rows, device=dev, dtype=torch.long)
        hidden = x.reshape(B * T, -1).index_select(0, idx)
        hidden = self._rms(hidden, self.norm)
        logits = self.lm_head_linear(hidden, self.plan.lm_head).float()  # [sum num_logits, V]
        return (logits, hidden) if return_hidden else logits


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a dense weight or a pack (`weights.packed_matmul`)."""
    y = F.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else packed_matmul(x, weight)
    return y if bias is None or isinstance(weight, torch.Tensor) else y + bias


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
