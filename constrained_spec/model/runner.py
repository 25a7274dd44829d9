"""Target model runners: they own the KV cache and turn token ids into logits.

The engine knows nothing about tokenization or model internals; it talks to a runner in slots
(one per running request) and positions:

- ``forward(slots, tokens, num_logits)`` appends ``tokens[i]`` to slot ``slots[i]`` at the
  positions after its current length, in ONE batched forward for all slots, and returns the
  logits of the last ``num_logits[i]`` appended positions of each slot (fp32, concatenated).
- ``truncate(slot, n)`` keeps the first ``n`` positions. The cache is written by position, so
  rejected draft positions are simply overwritten by the next forward (no rollback copies).

``LeanRunner`` (also importable as ``LlamaRunner``) is a lean, batched runner with a per-slot
cache indexed by position for the decoder families people run locally: llama (3.x rope
scaling included), mistral, qwen2/2.5, qwen3, gemma2, gemma3 (text) and phi3. They are one
block with a few switches (`Family`, read from the transformers config): q/k/v biases, q/k
norms, Gemma's (1 + w) norms with extra norms around attention and MLP, scaled embeddings,
gelu-tanh MLPs, sliding-window layers, logit soft-capping, fused phi3 weights, partial RoPE.
RoPE comes from the model's own rotary module, which applies the config's scaling. Whatever
`Family.of` does not recognise (a config switch not implemented here) runs on ``HFRunner``,
which wraps any ``transformers`` causal LM with one ``DynamicCache`` per slot: slower, never
wrong (`lean_runner_supports`).

Weights and kernels: every matrix is a `weights.Linear` -- the exact 4-bit groups of a
checkpoint converted from a 4-bit GGUF (each group of 32 input weights of a row is exactly
``d * q + m``, detected by `int4_weights`), or a dense tensor -- and the kernel plan
(`constrained_spec.model.plan`, measured per machine) picks the kernel per phase and rows: fp32 or
bf16 dense, torch's int4 kernel on the file's own 4-bit values, or int8. The activations take
the kernel's dtype; the KV cache has the plan's. Every weight multiply goes through one method,
`LeanRunner._matmul`.

Row invariance (``exact``: the default on a CPU, ``CONSTRAINED_SPEC_EXACT=0`` turns it off):
every row of a forward -- a verify row, a padded batch row, a prompt row -- is computed exactly
as a forward of that row alone at the same position would compute it, so a greedy output does
not depend on speculation or on the other requests in the batch. What it takes: the linears
and the LM head run a kernel whose per-row reduction does not depend on the number of rows
(`weights.ROW_INVARIANT_KERNELS`, measured: torch's int4 and int8 weight-only kernels; bf16 on
oneDNN with a 1-row product padded to 2 rows; this package's q4 and q8; not MKL's fp32 GEMM), one kernel for every
decode / verify forward whatever its rows (`plan.KernelPlan.decode_kernel`); decode / verify
attention is this package's C kernel where it builds (`kernels.cpu_native.attention`: each row over
its own keys, in key order, one instruction sequence per row), else
`exact_attention.chunked_attention`, which calls the CPU flash-attention kernel in
ONE shape (queries in groups of `exact_attention.QUERY_GROUP`, keys in chunks of `KEY_BLOCK`
from position 0) and combines the chunks in a fixed order, so a query's bits depend on nothing
else in the call (SDPA over all of a verify's queries does not give that: its GEMM shapes
follow the number of queries and keys). Its cost against the not-exact path is within ~10% of a
forward (benchmarks/RESULTS.md). Prompts (``phase="prefill"``) run one per forward in a batch,
so a prompt's kernel and SDPA's query blocks come from its own length. RoPE, norms, embeddings
and activations are per row already.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from constrained_spec.kernels import cpu_native
from constrained_spec.model.attention import KEY_CHUNK, ChunkedMask, chunk_mask, chunked_attention
from constrained_spec.model.plan import exact_mode
from constrained_spec.model.slots import SlotAllocator
from constrained_spec.model.weights import (
    ACT_DTYPE,
    GROUP,
    Int4Groups,
    Linear,
    Q8Groups,
    int4_kernel_available,
    int8_kernel_available,
    int8_pack,
    packed_matmul,
)

logger = logging.getLogger(__name__)


def make_runner(model: Any, *, dtype: torch.dtype, device: torch.device,
                int4: dict[str, Any] | None = None, exact: bool | None = None) -> Runner:
    """The fastest runner that supports ``model``'s architecture (``int4``: see `int4_weights`;
    ``exact``: see `LeanRunner`)."""
    try:
        Family.of(model)
    except UnsupportedModel as e:
        logger.info("%s runs on the transformers forward (HFRunner): %s", type(model).__name__, e)
        return HFRunner(model, dtype=dtype, device=device)
    return LeanRunner(model, dtype=dtype, device=device, int4=int4, exact=exact)


def lean_runner_supports(model: Any) -> bool:
    """Whether `LeanRunner` computes exactly what ``model``'s transformers forward computes
    (`Family.of` says why not)."""
    try:
        Family.of(model)
    except UnsupportedModel:
        return False
    return True


is_llama_family = lean_runner_supports  # the old name (the lean runner covers more than Llama now)


class UnsupportedModel(ValueError):
    """The lean runner does not implement something ``model``'s forward does (HFRunner runs it)."""


_GEMMA = {"gemma2", "gemma3_text"}
LEAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
# families whose config.sliding_window applies to every layer; the others read layer_types
_WINDOW_ON_EVERY_LAYER = {"mistral", "phi3"}
_LAYER_TYPED = {"qwen2", "qwen3", "gemma2", "gemma3_text"}
# rope types whose frequencies the rotary module fixes at init (it only rescales them there)
_ROPE_FIXED = {"default", "linear", "llama3", "yarn"}
_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Family:
    """How a decoder family's block differs from Llama's, read from a transformers model
    (`Family.of`). One forward reads these switches for every family."""

    model_type: str
    # gemma: RMSNorm scales by (1 + w) in float32 before the cast; a norm on the attention
    # output and on the MLP output, and the MLP's input norm is pre_feedforward_layernorm
    gemma_norms: bool
    # qwen3, gemma3: RMSNorm over head_dim on every q and k head, before RoPE
    qk_norm: bool
    # gemma: embeddings times sqrt(hidden_size), the factor rounded to the model dtype
    embed_scale: float | None
    act: Literal["silu", "gelu_tanh"]
    attn_scale: float  # 1/sqrt(head_dim), or gemma's 1/sqrt(query_pre_attn_scalar)
    attn_softcap: float | None  # gemma2: tanh soft-capping of attention scores
    final_softcap: float | None  # gemma2/3: tanh soft-capping of the logits
    # per layer: the sliding window (key j visible to query p iff p - window < j <= p) or None
    windows: tuple[int | None, ...]
    # per layer: the layer_type argument of the rotary module (gemma3: a base per type) or None
    rope_keys: tuple[str | None, ...]
    # "batched": one rotary call per forward (frequencies fixed at init); "per_slot": longrope
    # picks its short or long factors from the last position of each call, so each slot gets
    # its own call, as each sequence does in transformers; "original": dynamic NTK equals plain
    # RoPE up to max_position_embeddings and grows statefully past it: the original
    # frequencies, and the runner refuses positions past that length
    rope: Literal["batched", "per_slot", "original"]

    @classmethod
    def of(cls, model: Any) -> Family:
        """The family switches of ``model`` (a transformers causal LM); raises UnsupportedModel
        for anything this runner does not compute exactly as its transformers forward does."""
        cfg = model.config
        mt = getattr(cfg, "model_type", None)
        if mt not in LEAN_FAMILIES:
            raise UnsupportedModel(f"model_type {mt!r} is not one of {', '.join(LEAN_FAMILIES)}")
        inner: Any = getattr(model, "model", None)  # checked for the modules below
        if not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
            raise UnsupportedModel("no model.model.{layers, embed_tokens, norm, rotary_emb}")
        head = model.get_output_embeddings()
        if getattr(head, "weight", None) is None or getattr(head, "bias", None) is not None:
            raise UnsupportedModel("the LM head is not a bias-free linear layer")
        gemma = mt in _GEMMA
        act_name = cfg.hidden_activation if gemma else cfg.hidden_act
        if act_name not in _ACTS:
            raise UnsupportedModel(f"activation {act_name!r}")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModel("bidirectional attention")
        n = cfg.num_hidden_layers
        if len(inner.layers) != n:
            raise UnsupportedModel(f"{len(inner.layers)} decoder layers for num_hidden_layers {n}")
        window = getattr(cfg, "sliding_window", None) or None
        if mt in _WINDOW_ON_EVERY_LAYER:
            types = ["sliding_attention" if window else "full_attention"] * n
        elif mt in _LAYER_TYPED:
            types = list(cfg.layer_types)
        else:
            types = ["full_attention"] * n
        if set(types) - {"full_attention", "sliding_attention"}:
            raise UnsupportedModel(f"layer types {sorted(set(types))}")
        if "sliding_attention" in types and not window:
            raise UnsupportedModel("sliding_attention layers without a sliding_window")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        rope_type = inner.rotary_emb.rope_type  # gemma3: a dict by layer type
        rope_keys = tuple(types) if isinstance(rope_type, dict) else (None,) * n
        kinds = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
        if kinds - _ROPE_FIXED - {"dynamic", "longrope"}:
            raise UnsupportedModel(f"rope type {sorted(kinds - _ROPE_FIXED)}")
        if {"dynamic", "longrope"} <= kinds:
            raise UnsupportedModel("dynamic and longrope RoPE in one model")
        rope = "original" if "dynamic" in kinds else "per_slot" if "longrope" in kinds else "batched"
        try:  # q/k/v + o, gate/up + down (phi3: qkv_proj and gate_up_proj, kept fused)
            _linears(inner.layers[0])
        except AttributeError as e:
            raise UnsupportedModel(f"decoder layer without the expected linear layers ({e})") from None
        qk_norm = mt in ("qwen3", "gemma3_text")
        if qk_norm and not hasattr(inner.layers[0].self_attn, "q_norm"):
            raise UnsupportedModel("no q_norm / k_norm on the attention")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        scale = cfg.query_pre_attn_scalar ** -0.5 if gemma else head_dim ** -0.5
        return cls(
            model_type=mt, gemma_norms=gemma, qk_norm=qk_norm,
            embed_scale=cfg.hidden_size ** 0.5 if gemma else None, act=_ACTS[act_name],  # type: ignore[arg-type]
            attn_scale=scale,
            # transformers' gemma3 attention does not pass its softcap on: neither do we
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if mt == "gemma2" else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            windows=windows, rope_keys=rope_keys, rope=rope)  # type: ignore[arg-type]


INT4_GROUP = GROUP
# Up to this many rows in a forward (batch x tokens) the int4 kernel is faster than the dense
# bf16 GEMM on a CPU with bf16 units (measured crossover ~12 on a 2-core x86 CPU): the bucket
# of the plan for an explicit bfloat16 dtype and for draft models. A measured plan finds its own.
INT4_MAX_ROWS = 12
_LINEARS = ("qkv", "o", "gate_up", "down")
# keys an exact forward reads come in whole chunks of this many positions from position 0
# (`exact_attention.chunked_attention` reduces a query chunk by chunk)
KEY_BLOCK = KEY_CHUNK
# ... and a sliding-window layer's first key is a multiple of this (a whole number of chunks,
# and of SDPA's key split on CPU for exact prompts): from any other first key the chunks, hence
# the reduction, would shift with the batch
WINDOW_KEY_BLOCK = 512


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


def _linears(layer: Any) -> dict[str, list[Any]]:
    """The decoder layer's linear modules per fused matrix of the runner: q/k/v and gate/up
    are concatenated (phi3 stores them fused already)."""
    a, m = layer.self_attn, layer.mlp
    qkv = [a.qkv_proj] if hasattr(a, "qkv_proj") else [a.q_proj, a.k_proj, a.v_proj]
    gate_up = [m.gate_up_proj] if hasattr(m, "gate_up_proj") else [m.gate_proj, m.up_proj]
    return {"qkv": qkv, "o": [a.o_proj], "gate_up": gate_up, "down": [m.down_proj]}


def _fused_weight(lins: Sequence[Any]) -> torch.Tensor:
    return lins[0].weight if len(lins) == 1 else torch.cat([lin.weight for lin in lins])


def _layer_weights(layer: Any) -> dict[str, torch.Tensor]:
    return {name: _fused_weight(lins) for name, lins in _linears(layer).items()}


def _layer_biases(layer: Any) -> dict[str, torch.Tensor | None]:
    """The fused biases (zeros for a part without one), None where no part has one."""
    out: dict[str, torch.Tensor | None] = {}
    for name, lins in _linears(layer).items():
        if all(lin.bias is None for lin in lins):
            out[name] = None
        else:
            out[name] = torch.cat([lin.weight.new_zeros(lin.weight.shape[0]) if lin.bias is None
                                   else lin.bias for lin in lins])
    return out


def int4_weights(model: Any) -> dict[str, Int4Groups] | None:
    """The exact 4-bit groups (`weights.Int4Groups`) of every linear of a ``model`` the lean
    runner supports whose float32 weights are exactly 4-bit, keyed ``"{layer}.{name}"``; None
    when there are none, the lean runner does not run the model, or the CPU kernel is missing.
    Call before casting to bf16."""
    if not lean_runner_supports(model) or not int4_kernel_available():
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
    from constrained_spec.model.plan import KernelPlan

    if dtype == torch.float32:
        return KernelPlan.uniform("fp32")
    return KernelPlan(prefill="bf16", decode=[(INT4_MAX_ROWS, "int4" if int4 else "bf16"),
                                             (1 << 30, "bf16")], lm_head="bf16")


class Runner(SlotAllocator):
    """What the runners share: their slots (`slots.SlotAllocator`). Each is a
    `protocols.Runner`; `LeanRunner` is a `protocols.FeatureSource` too."""

    vocab_size: int
    max_context: int

    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def enable_features(self, layers: Sequence[int]) -> None:
        from constrained_spec.model.protocols import feature_source

        feature_source(self)  # raises the ConfigError: this runner keeps no hidden states


class LeanRunner(Runner):
    """Batched forward of the decoder families in `Family` with a position-indexed KV cache per
    slot (every layer keeps every position, sliding-window layers included: only their mask
    differs).

    ``exact`` (default: `plan.exact_mode`, on for a CPU unless ``CONSTRAINED_SPEC_EXACT=0``):
    every row is computed as it would be alone (the module docstring says how); it holds on
    the row-invariant kernels (`weights.ROW_INVARIANT_KERNELS`), which a plan chosen for an
    exact runner keeps to, and on the CPU only (its attention is a CPU kernel).
    """

    def __init__(self, model: Any, *, dtype: torch.dtype, device: torch.device,
                 int4: dict[str, Any] | None = None, exact: bool | None = None) -> None:
        super().__init__()
        self.exact = exact_mode(device) if exact is None else bool(exact)
        if self.exact and device.type != "cpu":
            raise ValueError(f"an exact runner runs on the CPU only, not {device}")
        cfg = model.config
        self.family = fam = Family.of(model)
        self.device, self.dtype = device, dtype
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_context = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        self.rotary = model.model.rotary_emb
        inner = model.model

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        def norm(t: torch.Tensor) -> torch.Tensor:
            # Gemma scales by (1 + w) in float32 (see _rms)
            return (1.0 + t.detach().to(device=device, dtype=torch.float32)) if fam.gemma_norms else w(t)

        self.embed = w(inner.embed_tokens.weight)
        # as transformers: the factor rounded to the model dtype, then a product in that dtype
        self.embed_scale = None if fam.embed_scale is None else \
            torch.tensor(fam.embed_scale).to(device=device, dtype=dtype)
        # the LM head, shaped like a layer for _matmul
        # (with the file's Q8_0 values for the q8 kernel when the int4 dict brings them, under
        # the key "lm_head": `weights.Q8Groups`)
        head_q8 = (int4 or {}).get("lm_head") if device.type == "cpu" else None
        self.head: dict[str, Any] = {"lm_head": Linear(dense=w(model.get_output_embeddings().weight),
                                                       q8=head_q8, float_out=True)}
        self.norm = norm(inner.norm.weight)
        self.int4_linears = 0
        self.layers: list[dict[str, Any]] = []
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        for i, layer in enumerate(inner.layers):
            a = layer.self_attn
            L: dict[str, Any] = {"ln_attn": norm(layer.input_layernorm.weight)}
            if fam.gemma_norms:
                L["post_attn"] = norm(layer.post_attention_layernorm.weight)
                L["ln_mlp"] = norm(layer.pre_feedforward_layernorm.weight)
                L["post_mlp"] = norm(layer.post_feedforward_layernorm.weight)
            else:
                L["ln_mlp"] = norm(layer.post_attention_layernorm.weight)
            if fam.qk_norm:  # one weight row per q and k head: one norm call over [B, T, H + KV, hd]
                L["qk_norm"] = norm(torch.cat([a.q_norm.weight.expand(H, hd), a.k_norm.weight.expand(KV, hd)]))
            biases = _layer_biases(layer)
            for name, lins in _linears(layer).items():
                groups = (int4 or {}).get(f"{i}.{name}") if device.type == "cpu" else None
                # exact 4-bit weights keep their groups (their dense parts are meta tensors: a
                # torch.cat of those would import torch._dynamo, triton and sympy, ~100 MB);
                # the rest stay dense in the runner's dtype (bf16 by default: half the bytes)
                if isinstance(groups, Q8Groups):  # the file's 8-bit groups (Q8_0, Q5_x)
                    L[name] = Linear(q8=groups, bias=biases[name])
                else:
                    L[name] = Linear(int4=groups, bias=biases[name]) if groups is not None else \
                        Linear(dense=w(_fused_weight(lins)), bias=biases[name])
                    self.int4_linears += groups is not None
            self.layers.append(L)
        self.vocab_size = int(self.lm_head.shape[0])
        self.hidden_size = int(self.embed.shape[1])
        # which kernel runs each phase (constrained_spec.model.plan); until a plan is chosen, as
        # before plans: the 4-bit kernel for few rows where exact, dense in `dtype` otherwise
        self.plan = _default_plan(dtype, bool(self.int4_linears) and device.type == "cpu")
        self.kv_dtype = torch.float32 if self.plan.kv == "fp32" else torch.bfloat16
        self._cap_slots, self._cap_len = 0, 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # hidden states kept per slot and position for drafters that read them (EAGLE-3, MTP)
        self.feature_layers: tuple[int, ...] = ()
        self.f_cache: torch.Tensor | None = None

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head weight [V, D] (model dtype, on the device): drafters share its rows."""
        return self.head["lm_head"].dense

    @property
    def lm_head_weight(self) -> Linear:
        return self.head["lm_head"]

    def quantize_for_drafting(self) -> int:
        """Run every linear and the LM head on the weight-only quantized kernels for few-row
        forwards (`weights.int8_pack`; those on exact 4-bit weights stay on int4): for a DRAFT
        model only, whose tokens the target verifies (its drafts may change, the output does
        not). CPU bf16 only (elsewhere nothing changes). Returns the number of matrices on a
        quantized kernel."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not int8_kernel_available():
            return 0
        from constrained_spec.model.plan import KernelPlan

        self.plan = KernelPlan(prefill="bf16", decode=[(INT4_MAX_ROWS, "int8"), (1 << 30, "bf16")],
                               lm_head="int8", source="drafting")
        # a draft model's rows change drafts only, never the output: its buckets may switch
        self.exact = False
        linears = self._linears() + [self.lm_head_weight]
        for lin in linears:
            lin.prepare({self._kernel(lin, "int8"), "bf16"}, resident=lin.int4 is None)
        self.int4_linears = len(linears) - 1
        return len(linears)

    # -- kernels --------------------------------------------------------------------------
    def _linears(self) -> list[Linear]:
        return [L[n] for L in self.layers for n in _LINEARS]

    def supports_kernel(self, kernel: str) -> bool:
        """Whether ``kernel`` runs any of this runner's linears (the others fall back; "q4"
        and "q8" stand for the native kernels, each weight on the one its groups fit)."""
        if kernel in ("q4", "q8"):
            return any(lin.supports("q4") or lin.supports("q8") for lin in self._linears())
        return any(lin.supports(kernel) for lin in self._linears())

    @staticmethod
    def _kernel(lin: Linear, kernel: str) -> str:
        # "int8" means weight-only quantized: the file's own groups where it has them (4-bit on
        # q4 where it runs, else int4; 8-bit on q8); "q4" and "q8" mean the native kernels,
        # each weight on the one its groups fit; a kernel a weight cannot run (int4 or q4
        # without 4-bit groups) runs its dense bf16 form
        if kernel in ("int8", "q4", "q8"):
            for native in ("q4", "q8"):
                if lin.supports(native):
                    return native
            if kernel == "int8" and lin.supports("int4"):
                return "int4"
        return kernel if lin.supports(kernel) else "bf16"

    def set_plan(self, plan: Any) -> None:
        """Use ``plan`` from now on: build the packs and resident copies its kernels need, drop
        the rest, and put the KV cache in its dtype (every slot's cache is dropped)."""
        self.plan = plan
        decode = {k for _, k in plan.decode}
        # dense forms a decode step uses stay resident (a per-step dequantization would cost
        # more than the step); a prefill's too unless the plan is lean on memory
        resident_for = decode if plan.memory == "lean" else plan.kernels()
        for lin in self._linears():
            lin.prepare({self._kernel(lin, k) for k in plan.kernels()},
                        resident=any(self._kernel(lin, d) in ("fp32", "bf16") for d in resident_for))
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
        return self.lm_head_weight(hidden, self._kernel(self.lm_head_weight, kernel),
                                   row_invariant=self.exact)

    def resident_bytes(self) -> int:
        """Bytes of weights this runner holds (packs, resident dense copies, embeddings)."""
        total = sum(lin.nbytes() for lin in self._linears() + [self.lm_head_weight])
        if self.embed.data_ptr() != self.lm_head.data_ptr():
            total += self.embed.numel() * self.embed.element_size()
        return total

    # -- features -------------------------------------------------------------------------
    def enable_features(self, layers: Sequence[int]) -> None:
        """From now on every forward keeps, per slot and position, the hidden states of
        ``layers`` (transformers' ``hidden_states`` numbering: 0 = embeddings, i = output of
        decoder layer i - 1, the last (n_layers, or -1) after the final norm), read back with
        `features`. Several drafters may ask: the union is kept (positions cached before a
        change read as zeros)."""
        for i in layers:
            if not (i == -1 or 0 <= i <= self.n_layers):
                raise ValueError(f"feature layer {i} is not in -1, 0..{self.n_layers}")
        union = tuple(sorted(set(self.feature_layers) | {int(i) for i in layers}))
        if union != self.feature_layers:
            self.feature_layers = union
            self.f_cache = None
            if self._cap_slots:
                self._alloc_features()

    def _alloc_features(self) -> torch.Tensor:
        D = self.embed.shape[1]
        self.f_cache = torch.zeros((self._cap_slots, self._cap_len, len(self.feature_layers) * D),
                                   device=self.device, dtype=self.dtype)
        return self.f_cache

    @property
    def _kept_features(self) -> torch.Tensor:
        """The kept hidden states [slots, positions, len(feature_layers) * D]: allocated with
        the cache once `enable_features` asked for some."""
        if self.f_cache is None:
            raise RuntimeError("this runner keeps no hidden states: call enable_features(layers) "
                               "before the forwards whose features are read")
        return self.f_cache

    def features(self, slot: int, start: int, end: int, layers: Sequence[int]) -> torch.Tensor:
        """[end - start, len(layers) * D]: the kept hidden states of ``layers`` (each enabled
        with `enable_features`) at positions start..end-1 of ``slot``."""
        D = self.embed.shape[1]
        rows = self._kept_features[slot, start:end]
        if tuple(layers) == self.feature_layers:
            return rows
        cols = [self.feature_layers.index(i) * D for i in layers]
        return torch.cat([rows[:, c: c + D] for c in cols], dim=-1)

    # -- cache ----------------------------------------------------------------------------
    def _ensure_capacity(self, slots: int, length: int) -> None:
        grown = self.grown_capacity(slots, length, self.max_context)
        if grown is None:
            return
        new_slots, new_len = grown
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
            f_cache = self._alloc_features()
            if old_f is not None:
                f_cache[:old_slots, :old_len] = old_f

    # -- the pieces of the forward --------------------------------------------------------
    def _matmul(self, x: torch.Tensor, L: dict[str, Any], name: str, kernel: str) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for the linear ``L[name]`` with the phase's ``kernel`` (from the
        plan): EVERY weight multiply of the forward (qkv, o, gate_up, down, lm_head) goes
        through here."""
        lin = L[name]
        return lin(x, self._kernel(lin, kernel), row_invariant=self.exact)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim as the family's transformers module computes it."""
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.family.gemma_norms:  # Gemma: (x * (1 + w)) in fp32, then cast (weight holds 1 + w)
            return (h * weight).to(x.dtype)
        return weight.to(x.dtype) * h.to(x.dtype)  # Llama: cast, then scale in the activations' dtype

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, lengths: Sequence[int],
              key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rot_dim] at ``pos`` [B, T] for the layers of rotary ``key``."""
        args = () if key is None else (key,)
        mode = self.family.rope
        if mode == "batched":
            return self.rotary(x, pos, *args)
        if mode == "per_slot":  # padded rows get cos = sin = 0 (their q and k are never read)
            T = pos.shape[1]
            ns = [max(n, 1) for n in lengths]
            parts = [self.rotary(x[b: b + 1, :n], pos[b: b + 1, :n], *args) for b, n in enumerate(ns)]
            return tuple(torch.cat([F.pad(p[i], (0, 0, 0, T - n)) for p, n in zip(parts, ns)])
                         for i in range(2))  # type: ignore[return-value]
        # "original" (dynamic NTK): the module's forward with its init frequencies, which are
        # transformers' own below max_position_embeddings (the forward refuses past it)
        prefix = "" if key is None else f"{key}_"
        inv_freq = getattr(self.rotary, prefix + "original_inv_freq").to(x.device, torch.float32)
        scaling = getattr(self.rotary, prefix + "attention_scaling")
        freqs = pos[..., None].float() * inv_freq  # [B, T, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    def _masks(self, pos: torch.Tensor, starts: Sequence[int], Lk: int) -> dict[int | None, tuple[int, torch.Tensor]]:
        """Per window size of the model's layers (None = full attention): the first key
        position ``lo`` its layers read and the mask [B, 1, T, Lk - lo] over keys lo..Lk-1.
        Key j is visible to the query at position p iff j <= p, and, in a window w,
        p - w < j (transformers' sliding_window_overlay). A window layer reads no key before
        the earliest query's window: at long context its mask is the smaller one. When exact,
        that first key is rounded down to a multiple of `WINDOW_KEY_BLOCK`, so that a query's
        key blocks do not depend on the other requests in the batch."""
        # padded rows of a short slot may sit past Lk: clamped so that no row is fully masked
        # (a fully masked row is NaN, and its k / v would land in the cache)
        q = pos.clamp(max=Lk - 1)[:, :, None]  # [B, T, 1]
        masks = {}
        for win in set(self.family.windows):
            lo = 0 if win is None else max(0, min(starts) - win + 1)
            if self.exact:
                lo -= lo % WINDOW_KEY_BLOCK
            j = torch.arange(lo, Lk, device=pos.device)[None, None, :]  # [1, 1, Lk - lo]
            visible = j <= q if win is None else (j <= q) & (j > q - win)
            masks[win] = (lo, visible[:, None])  # [B, 1, T, Lk - lo]
        return masks

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                mask: torch.Tensor, chunked: ChunkedMask | None = None) -> torch.Tensor:
        """Attention of q [B, T, H, hd] over keys / vals [B, S, KV, hd] under mask [B, 1, T, S]
        -> [B, T, H * hd]; ``chunked``: the same mask for `chunked_attention` (exact decode /
        verify rows: each row's bits independent of the call)."""
        B, T, H, hd = q.shape
        KV = keys.shape[2]
        fam = self.family
        if fam.attn_softcap is None and chunked is not None:  # exact decode / verify rows
            return chunked_attention(q, keys, vals, chunked, fam.attn_scale)
        if fam.attn_softcap is None:
            out = sdpa(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), mask, fam.attn_scale)
            return out.transpose(1, 2).reshape(B, T, H * hd)  # out: [B, H, T, hd]
        # Soft-capped scores (gemma2): SDPA cannot cap, so the scores are computed here, in
        # query chunks whose scores [B, H, t, S] hold no more entries than the mask; the q heads
        # sharing a kv head are grouped so that keys are never repeated per head.
        G, S, cap = H // KV, keys.shape[1], fam.attn_softcap
        k = keys.permute(0, 2, 3, 1)  # [B, KV, hd, S]
        v = vals.transpose(1, 2)  # [B, KV, S, hd]
        out = q.new_empty(B, T, H, hd)
        step = max(1, T // H)
        for t0 in range(0, T, step):
            t = min(step, T - t0)
            qg = q[:, t0: t0 + t].reshape(B, t, KV, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, G * t, hd)
            s = (qg @ k) * fam.attn_scale  # [B, KV, G * t, S]
            s = torch.tanh(s / cap) * cap
            s = s.view(B, KV, G, t, S).masked_fill(~mask[:, :, None, t0: t0 + t], float("-inf"))
            p = s.softmax(dim=-1, dtype=torch.float32).to(q.dtype).view(B, KV, G * t, S)
            out[:, t0: t0 + t] = (p @ v).view(B, KV, G, t, hd).permute(0, 3, 1, 2, 4).reshape(B, t, H, hd)
        return out.reshape(B, T, H * hd)

    # -- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: bool = False,
                phase: str | None = None) -> Any:
        """``phase``: "prefill" (a prompt) or "decode" (decode / verify rows); None = prefill
        when no logits are asked for. With the rows of the forward it picks the plan's kernel,
        and the kernel the activations' dtype."""
        if phase is None:
            phase = "decode" if any(num_logits) else "prefill"
        if self.exact and phase == "prefill" and len(slots) > 1:
            # each prompt alone, whatever it is batched with: its kernel from its own rows, and
            # SDPA's query blocks (which depend on the number of queries) from its own length
            outs = [self.forward([s], [t], [n], return_hidden=return_hidden, phase=phase)
                    for s, t, n in zip(slots, tokens, num_logits)]
            if return_hidden:
                return tuple(torch.cat(parts) for parts in zip(*outs))
            return torch.cat(outs)
        fb = self._batch(slots, tokens, phase)
        x = F.embedding(fb.ids, self.embed)  # [B, T, D]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        x = x.to(ACT_DTYPE[fb.kernel])
        for key in set(self.family.rope_keys):
            cos, sin = self._rope(x, fb.pos, fb.lengths, key)
            fb.rope[key] = (cos[:, :, None], sin[:, :, None])  # [B, T, 1, rot_dim]
        keep = self.feature_layers
        kept: dict[int, torch.Tensor] = {}
        for i, L in enumerate(self.layers):
            if i in keep:
                kept[i] = x
            x = self._layer(i, L, x, fb)
        if keep:
            if self.n_layers in keep or -1 in keep:  # the last one after the final norm
                kept[self.n_layers] = kept[-1] = self._rms(x, self.norm)
            f_cache = self._kept_features
            f_cache.index_put_(fb.write_idx, torch.cat([kept[i] for i in keep], dim=-1).to(f_cache.dtype))
        for s, e in zip(slots, fb.ends):
            self._lengths[s] = e
        return self._logits(x, tokens, num_logits, return_hidden)

    def _batch(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], phase: str) -> _ForwardBatch:
        """The padded ids, positions, masks and cache indices of one forward, its kernel
        chosen by the plan for its rows; grows the cache to hold it."""
        B, T = len(slots), max(len(t) for t in tokens)
        lengths = [len(t) for t in tokens]
        starts = [self._lengths[s] for s in slots]
        ends = [st + n for st, n in zip(starts, lengths)]
        if self.family.rope == "original" and max(ends) > self.max_context:
            raise ValueError(f"position {max(ends) - 1} is past max_position_embeddings "
                             f"{self.max_context}: beyond it transformers' dynamic RoPE rescales "
                             "statefully, which this runner does not reproduce")
        # keys read: 0..Lk-1, in whole KEY_BLOCKs when exact (see the module docstring)
        Lk = -(-max(ends) // KEY_BLOCK) * KEY_BLOCK if self.exact else max(ends)
        # padded rows write up to start + T - 1: the cache must hold them too
        self._ensure_capacity(max(slots) + 1, max(max(starts) + T, Lk))
        dev = self.device
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]
        slot_t = torch.tensor(slots, device=dev)
        if not self.exact:
            kernel = (self.plan.prefill_kernel if phase == "prefill" else self.plan.decode_kernel)(B * T)
        elif phase == "prefill":  # one kernel for every prompt here (forward split them)
            kernel = self.plan.prefill_kernel(lengths[0])
        else:  # one kernel whatever the rows: a verify row as a 1-row decode computes it
            kernel = self.plan.decode_kernel(1)
        masks = self._masks(pos, starts, Lk)
        exact_decode = self.exact and phase == "decode"
        native = self._native_rows(pos, slot_t, Lk, kernel) if exact_decode else {}
        # (a soft-capped attention, gemma2, computes its scores itself: no chunks)
        chunked = {} if not exact_decode or native or self.family.attn_softcap is not None else {
            win: chunk_mask(m[:, 0], heads=self.n_heads, kv_heads=self.n_kv, dtype=ACT_DTYPE[kernel])
            for win, (_, m) in masks.items()}
        return _ForwardBatch(
            slots=list(slots), lengths=lengths, ends=ends, ids=ids.to(dev), pos=pos, Lk=Lk,
            masks=masks, chunked=chunked, native=native, slot_t=slot_t,
            write_idx=(slot_t[:, None].expand(B, T), pos),
            contiguous=list(slots) == list(range(slots[0], slots[0] + B)), kernel=kernel, phase=phase)

    def _native_rows(self, pos: torch.Tensor, slot_t: torch.Tensor, Lk: int,
                     kernel: str) -> dict[int | None, torch.Tensor]:
        """Per window size, int32 [3, B * T]: each row's cache slot and the first and past-last
        key it sees, for `kernels.cpu_native.attention` (exact decode rows in bf16 on a CPU whose
        build runs it); {} where it cannot run."""
        if (self.device.type != "cpu" or ACT_DTYPE[kernel] != torch.bfloat16
                or self.kv_dtype != torch.bfloat16
                or not cpu_native.attention_supports(self.head_dim, self.n_heads, self.n_kv)):
            return {}
        B, T = pos.shape
        hi = pos.clamp(max=Lk - 1) + 1  # a padded row past Lk reads what the last one does
        out = {}
        for win in set(self.family.windows):
            lo = torch.zeros_like(hi) if win is None else (hi - win).clamp(min=0)
            out[win] = torch.stack([slot_t[:, None].expand(B, T), lo, hi]).reshape(3, B * T).to(torch.int32)
        return out

    def _layer(self, i: int, L: dict[str, Any], x: torch.Tensor, fb: _ForwardBatch) -> torch.Tensor:
        """Decoder layer ``i`` on x [B, T, D]: attention (its k / v written to the cache), MLP."""
        fam, kernel = self.family, fb.kernel
        B, T = fb.ids.shape
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        h = self._rms(x, L["ln_attn"])
        qkv = self._matmul(h, L, "qkv", kernel).view(B, T, H + 2 * KV, hd)
        qk, v = qkv[:, :, : H + KV], qkv[:, :, H + KV:]  # q and k heads together: [B, T, H + KV, hd]
        if fam.qk_norm:
            qk = self._rms(qk, L["qk_norm"])
        cos, sin = fb.rope[fam.rope_keys[i]]
        rd = cos.shape[-1]  # < hd: partial rotary (phi3), the rest passes through
        rot = qk[..., :rd] * cos + _rotate_half(qk[..., :rd]) * sin
        qk = rot if rd == hd else torch.cat([rot, qk[..., rd:]], dim=-1)
        q, k = qk[:, :, :H], qk[:, :, H:]
        kc, vc = self.k_cache[i], self.v_cache[i]
        kc.index_put_(fb.write_idx, k.to(kc.dtype))  # cache layout [S, L, KV, hd]
        vc.index_put_(fb.write_idx, v.to(vc.dtype))
        if fb.native:  # exact decode rows on the C kernel: straight from the cache
            att = cpu_native.attention(q.reshape(B * T, H, hd), kc, vc, fb.native[fam.windows[i]],
                                   hd ** -0.5 if fam.attn_scale is None else fam.attn_scale,
                                   fam.attn_softcap)
            return self._layer_rest(L, x, att.view(B, T, H * hd), fb)
        lo, mask = fb.masks[fam.windows[i]]
        if fb.contiguous:
            s0 = fb.slots[0]
            keys, vals = kc[s0: s0 + B, lo:fb.Lk], vc[s0: s0 + B, lo:fb.Lk]
        else:
            keys = kc.index_select(0, fb.slot_t)[:, lo:fb.Lk]
            vals = vc.index_select(0, fb.slot_t)[:, lo:fb.Lk]
        act = ACT_DTYPE[kernel]
        return self._layer_rest(L, x, self._attend(q, keys.to(act), vals.to(act), mask,
                                                   fb.chunked.get(fam.windows[i])), fb)

    def _layer_rest(self, L: dict[str, Any], x: torch.Tensor, att: torch.Tensor,
                    fb: _ForwardBatch) -> torch.Tensor:
        """The rest of a decoder layer after its attention ``att`` [B, T, H * hd]: the output
        projection, the residual, the MLP."""
        fam, kernel = self.family, fb.kernel
        a = self._matmul(att, L, "o", kernel)  # [B, T, D]
        if fam.gemma_norms:
            a = self._rms(a, L["post_attn"])
        x = x + a
        h = self._rms(x, L["ln_mlp"])
        gate, up = self._matmul(h, L, "gate_up", kernel).chunk(2, dim=-1)
        gate = F.silu(gate) if fam.act == "silu" else F.gelu(gate, approximate="tanh")
        m = self._matmul(gate * up, L, "down", kernel)
        if fam.gemma_norms:
            m = self._rms(m, L["post_mlp"])
        return x + m

    def _logits(self, x: torch.Tensor, tokens: Sequence[Sequence[int]], num_logits: Sequence[int],
                return_hidden: bool) -> Any:
        """Logits only for the rows asked for: the last ``num_logits[b]`` real positions of
        each slot (and their final-normed hidden states with ``return_hidden``)."""
        B, T = x.shape[:2]
        rows = [b * T + len(t) - n + j for b, (t, n) in enumerate(zip(tokens, num_logits)) for j in range(n)]
        idx = torch.tensor(rows, device=x.device, dtype=torch.long)
        hidden = self._rms(x.reshape(B * T, -1).index_select(0, idx), self.norm)
        logits = self._matmul(hidden, self.head, "lm_head", self.plan.lm_head).float()  # [sum num_logits, V]
        fam = self.family
        if fam.final_softcap is not None:
            logits = torch.tanh(logits / fam.final_softcap) * fam.final_softcap
        return (logits, hidden) if return_hidden else logits


@dataclass
class _ForwardBatch:
    """What every layer of one `LeanRunner.forward` shares."""

    slots: list[int]
    lengths: list[int]  # real tokens per row
    ends: list[int]  # each slot's length after this forward
    ids: torch.Tensor  # long [B, T], padded with 0
    pos: torch.Tensor  # long [B, T]: positions
    Lk: int  # keys read: positions 0..Lk-1
    masks: dict[int | None, tuple[int, torch.Tensor]]  # see LeanRunner._masks
    chunked: dict[int | None, ChunkedMask]  # exact decode / verify: the masks for chunked_attention
    native: dict[int | None, torch.Tensor]  # exact decode / verify: rows for cpu_native.attention
    slot_t: torch.Tensor  # long [B]
    write_idx: tuple[torch.Tensor, torch.Tensor]  # (slot, position) [B, T] each: cache rows written
    contiguous: bool  # slots are consecutive: the cache is read by slicing
    kernel: str  # the plan's kernel for this forward's rows
    phase: str = "decode"  # "prefill" or "decode" (see LeanRunner.forward)
    rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


LlamaRunner = LeanRunner  # the old name, kept for callers


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a dense weight or a pack (`weights.packed_matmul`)."""
    y = F.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else packed_matmul(x, weight)
    return y if bias is None or isinstance(weight, torch.Tensor) else y + bias


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
         scale: float | None = None) -> torch.Tensor:
    """Masked SDPA of q [B, H, T, hd] over k / v [B, KV, S, hd] (KV dividing H) -> [B, H, T, hd],
    as every runner attention call makes it. On the CPU a single query goes in twice: the
    kernel's one-query path is 2-3x slower than two queries in a microbenchmark (bf16, 9
    heads: 170 against 79 us per layer at 150 keys, 730 against 260 at 1,000); in the
    embedded model that is 9% of a 1-row forward at 1,000 keys (nothing at 150). (An exact
    runner's decode rows do not come here: `exact_attention.chunked_attention`.)"""
    T = q.shape[2]
    if T == 1 and q.device.type == "cpu":
        B, H, _, hd = q.shape
        q, mask = q.expand(B, H, 2, hd), mask.expand(*mask.shape[:2], 2, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1],
                                         scale=scale)
    return out[:, :, :T]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class HFRunner(Runner):
    """Any transformers causal LM: one DynamicCache per slot, one forward per slot."""

    def __init__(self, model: Any, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device, self.dtype = device, dtype
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
