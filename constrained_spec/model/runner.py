"""Target model runners: they own the KV cache and turn token ids into logits.

The engine knows nothing about tokenization or model internals; it talks to a runner in slots
(one per running request) and positions (the contract: `protocols.Runner`):

- ``forward(slots, tokens, num_logits)`` appends ``tokens[i]`` to slot ``slots[i]`` at the
  positions after its current length, in ONE batched forward for all slots, and returns the
  logits of the last ``num_logits[i]`` appended positions of each slot (fp32, concatenated).
- ``truncate(slot, n)`` keeps the first ``n`` positions. The cache is written by position, so
  rejected draft positions are simply overwritten by the next forward (no rollback copies).

``LeanRunner`` is a lean, batched runner with a per-slot cache indexed by position for the
decoder families in `families.FAMILIES` (llama with its RoPE scalings, mistral, qwen2/2.5,
qwen3, gemma2, gemma3 text, phi3). They are one block with a few switches, one row of that
table each (`families.Family`, read from the transformers config): q/k/v biases, q/k norms,
Gemma's (1 + w) norms with extra norms around attention and MLP, scaled embeddings, gelu-tanh
MLPs, sliding-window layers, logit soft-capping, fused phi3 weights, partial RoPE. RoPE comes
from the model's own rotary module, which applies the config's scaling. Whatever
`families.Family.of` does not recognise (a config switch not implemented here) runs on
``HFRunner``, which wraps any ``transformers`` causal LM with one ``DynamicCache`` per slot:
slower, never wrong (`lean_runner_supports`).

Weights and kernels: every matrix is a `weights.Linear` -- the file's own quantized groups
(`weights.Int4Groups`: exactly ``d * q + m`` in every group of 32 input weights of a row,
from a 4-bit GGUF or found in a checkpoint dequantized from one by `exact_4bit_groups`;
`weights.Q8Groups`: a GGUF's 8-bit groups), or a dense tensor -- and the kernel plan
(`constrained_spec.model.plan`, measured per machine) picks the kernel per phase and rows: fp32
or bf16 dense, torch's int4 kernel on the file's own 4-bit values, int8, or this package's q4 /
q8. The activations take the kernel's dtype; the KV cache has the plan's. Every weight multiply
goes through one method, `LeanRunner._matmul`.

Row invariance (``exact``: the default on a CPU, ``CONSTRAINED_SPEC_EXACT=0`` turns it off):
every row of a forward -- a verify row, a padded batch row, a prompt row -- is computed exactly
as a forward of that row alone at the same position would compute it, so a greedy output does
not depend on speculation or on the other requests in the batch. What it takes: the linears
and the LM head run a kernel whose per-row reduction does not depend on the number of rows
(`weights.ROW_INVARIANT_KERNELS`, measured: torch's int4 and int8 weight-only kernels; bf16 on
oneDNN with a 1-row product padded to 2 rows; this package's q4 and q8; not MKL's fp32 GEMM),
one kernel for every decode / verify forward whatever its rows (`plan.KernelPlan.decode_kernel`);
decode / verify attention is this package's C kernel where it builds
(`kernels.cpu_native.attention`: each row over its own keys, in key order, one instruction
sequence per row), else `attention.chunked_attention`, which calls the CPU flash-attention
kernel in ONE shape (queries in groups of `attention.QUERY_GROUP`, keys in chunks of
`KEY_BLOCK` from position 0) and combines the chunks in a fixed order, so a query's bits depend
on nothing else in the call (SDPA over all of a verify's queries does not give that: its GEMM
shapes follow the number of queries and keys). What that costs against the not-exact path:
benchmarks/RESULTS.md, "Exact runner: its cost with query-invariant chunked attention" and
"Exactness by default". Prompts of a row-invariant runner take the decode / verify path (in
chunks, after their longest cached prefix: `prefix_cache`); prompts with ``phase="prefill"``
run one per forward in a batch, so a prompt's kernel and SDPA's query blocks come from its
own length. RoPE, norms, embeddings and
activations are per row already.

The exact decode / verify rows of a forward whose linears all run packed (``q4`` / ``q8``) on
bf16 activations and the native attention go through the whole layer stack in ONE native call
(`kernels.native_forward`: norms, QKV, RoPE, cache write, attention, O, MLP, residuals, with
every family switch above), rounding to bf16 where the torch layers do and row-invariant like
them; the torch layers stay the reference and the fallback (``LeanRunner.native_forward =
False`` selects them; tests and benchmarks/forward.py compare the two).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.nn.functional as F

from constrained_spec.kernels import cpu_native, native_forward
from constrained_spec.kernels.native_forward import NativeForward
from constrained_spec.model.attention import KEY_CHUNK, ChunkedMask, chunk_mask, chunked_attention
from constrained_spec.model.families import Family, FamilySpec, UnsupportedModel, layer_linears
from constrained_spec.model.plan import KernelPlan, exact_mode
from constrained_spec.model.prefix_cache import Prefiller, prefix_cache_bytes
from constrained_spec.model.protocols import feature_source
from constrained_spec.model.slots import SlotAllocator
from constrained_spec.model.weights import (
    ACT_DTYPE,
    ROW_INVARIANT_KERNELS,
    Int4Groups,
    Linear,
    Q8Groups,
    int4_kernel_available,
    int8_kernel_available,
    packed_matmul,
)
from constrained_spec.plan_syntax import ALL_ROWS

if TYPE_CHECKING:
    from transformers import DynamicCache

logger = logging.getLogger(__name__)

# a linear's quantized groups as a checkpoint holds them (`LeanRunner`'s ``groups``)
Groups = Int4Groups | Q8Groups


def make_runner(model: Any, *, dtype: torch.dtype, device: torch.device,
                groups: Mapping[str, Groups] | None = None, exact: bool | None = None) -> RunnerBase:
    """The fastest runner that supports ``model``'s architecture (``groups`` and ``exact``:
    see `LeanRunner`)."""
    try:
        Family.of(model)
    except UnsupportedModel as e:
        logger.info("%s runs on the transformers forward (HFRunner): %s", type(model).__name__, e)
        return HFRunner(model, dtype=dtype, device=device)
    return LeanRunner(model, dtype=dtype, device=device, groups=groups, exact=exact)


def lean_runner_supports(model: Any) -> bool:
    """Whether `LeanRunner` computes exactly what ``model``'s transformers forward computes
    (`families.Family.of` says why not)."""
    try:
        Family.of(model)
    except UnsupportedModel:
        return False
    return True


# Up to this many rows in a forward (batch x tokens) the packed kernels are faster than the
# dense bf16 GEMM on a CPU with bf16 units (benchmarks/RESULTS.md, "Target forward: dense bf16
# vs exact int4 weights"): the bucket of the plan for an explicit bfloat16 dtype (int4) and for
# draft models and heads (int8). A measured plan finds its own.
FEW_ROWS = 12
# keys an exact forward reads come in whole chunks of this many positions from position 0
# (`attention.chunked_attention` reduces a query chunk by chunk)
KEY_BLOCK = KEY_CHUNK
# ... and a sliding-window layer's first key is a multiple of this (a whole number of chunks,
# and of SDPA's key split on CPU for exact prompts): from any other first key the chunks, hence
# the reduction, would shift with the batch
WINDOW_KEY_BLOCK = 512


@dataclass
class LayerWeights:
    """One decoder layer as the lean runner holds it: the four matrices (q/k/v and gate/up
    concatenated) and the norm weights in the form `LeanRunner._rms` reads (``1 + w`` in
    float32 for a family with ``norm_offset``)."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    attn_in: torch.Tensor  # the norm before attention
    mlp_in: torch.Tensor  # the norm before the MLP
    attn_out: torch.Tensor | None = None  # on the attention output (gemma)
    mlp_out: torch.Tensor | None = None  # on the MLP output (gemma)
    # the q and k norms, one row per q head then per kv head: [H + KV, head_dim] (qwen3, gemma3)
    qk_norm: torch.Tensor | None = None

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


def _fused_weight(lins: Sequence[Any]) -> torch.Tensor:
    return lins[0].weight if len(lins) == 1 else torch.cat([lin.weight for lin in lins])


def _fused_weights(spec: FamilySpec, layer: Any) -> dict[str, torch.Tensor]:
    return {name: _fused_weight(lins) for name, lins in layer_linears(spec, layer).items()}


def _fused_biases(spec: FamilySpec, layer: Any) -> dict[str, torch.Tensor | None]:
    """The fused biases (zeros for a part without one), None where no part has one."""
    out: dict[str, torch.Tensor | None] = {}
    for name, lins in layer_linears(spec, layer).items():
        if all(lin.bias is None for lin in lins):
            out[name] = None
        else:
            out[name] = torch.cat([lin.weight.new_zeros(lin.weight.shape[0]) if lin.bias is None
                                   else lin.bias for lin in lins])
    return out


def exact_4bit_groups(model: Any) -> dict[str, Int4Groups] | None:
    """The exact 4-bit groups (`weights.Int4Groups`) of every linear of a ``model`` the lean
    runner supports whose float32 weights are exactly 4-bit, keyed ``"{layer}.{matrix}"`` (the
    runner's ``groups``); None when there are none, the lean runner does not run the model, or
    the CPU kernel is missing. Call before casting to bf16."""
    try:
        spec = Family.of(model).spec
    except UnsupportedModel:
        return None
    if not int4_kernel_available():
        return None
    groups = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name, w in _fused_weights(spec, layer).items():
                g = Int4Groups.from_dense(w.detach()) if w.shape[0] % 16 == 0 else None
                if g is not None:
                    groups[f"{i}.{name}"] = g
    return groups or None


def _default_plan(dtype: torch.dtype, int4: bool) -> KernelPlan:
    if dtype == torch.float32:
        return KernelPlan.uniform("fp32")
    return KernelPlan(prefill="bf16", decode=[(FEW_ROWS, "int4" if int4 else "bf16"),
                                             (ALL_ROWS, "bf16")], lm_head="bf16")


class RunnerBase(SlotAllocator):
    """What the runners share: their slots (`slots.SlotAllocator`). Each is a
    `protocols.Runner`; `LeanRunner` is a `protocols.FeatureSource` too."""

    vocab_size: int
    max_context: int

    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[int]:
        """Append prompt ``tokens[i]`` to empty slot ``slots[i]`` (no logits); per slot, the
        tokens computed (`LeanRunner` reads cached prefixes: `prefix_cache`)."""
        if slots:
            self.forward(slots, tokens, [0] * len(slots))
        return [len(t) for t in tokens]

    def enable_features(self, layers: Sequence[int]) -> None:
        feature_source(self)  # raises the ConfigError: this runner keeps no hidden states


class LeanRunner(RunnerBase):
    """Batched forward of the decoder families in `families.FAMILIES` with a position-indexed
    KV cache per slot (every layer keeps every position, sliding-window layers included: only
    their mask differs).

    ``groups``: the checkpoint's quantized groups by ``"{layer}.{matrix}"`` (matrix: one of
    `families.MATRICES`), and ``"lm_head"``: `weights.Int4Groups` (exactly 4-bit, from a 4-bit
    GGUF or `exact_4bit_groups`) or `weights.Q8Groups` (a GGUF's 8-bit groups); on a CPU those
    linears keep their groups, every other one is dense in ``dtype``.

    ``exact`` (default: `plan.exact_mode`, on for a CPU unless ``CONSTRAINED_SPEC_EXACT=0``):
    every row is computed as it would be alone (the module docstring says how); it holds on
    the row-invariant kernels (`weights.ROW_INVARIANT_KERNELS`), which a plan chosen for an
    exact runner keeps to, and on the CPU only (its attention is a CPU kernel).
    """

    def __init__(self, model: Any, *, dtype: torch.dtype, device: torch.device,
                 groups: Mapping[str, Groups] | None = None, exact: bool | None = None) -> None:
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
        held = groups if groups is not None and device.type == "cpu" else {}
        # as transformers: the factor rounded to the model dtype, then a product in that dtype
        self.embed_scale = None if fam.embed_scale is None else \
            torch.tensor(fam.embed_scale).to(device=device, dtype=dtype)
        self.head, self._embed = self._head_and_embedding(model, held.get("lm_head"))
        self.norm = self._norm(inner.norm.weight)
        self.layers = [self._layer_weights(i, layer, held) for i, layer in enumerate(inner.layers)]
        # linears held as quantized groups (after `quantize_for_drafting`: on the int8 kernel)
        self.quantized_linears = sum(lin.dense is None for lin in self.linears())
        four_bit = any(lin.int4 is not None for lin in self.linears())
        self.vocab_size, self.hidden_size = self.head.shape
        # which kernel runs each phase (constrained_spec.model.plan); until a plan is chosen, as
        # before plans: the 4-bit kernel for few rows where exact, dense in `dtype` otherwise
        self.plan = _default_plan(dtype, four_bit and device.type == "cpu")
        self.kv_dtype = torch.float32 if self.plan.kv == "fp32" else torch.bfloat16
        self._cap_slots, self._cap_len = 0, 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # hidden states kept per slot and position for drafters that read them (EAGLE-3, MTP)
        self.feature_layers: tuple[int, ...] = ()
        self.f_cache: torch.Tensor | None = None
        # exact decode / verify rows on the one-call native layer stack (`_native_stack`) where
        # it runs; False: the torch path (the reference, which tests and benchmarks compare)
        self._native_forward = True
        # the native stack's 4-bit products on int8 activations (`cpu_native.int8_activations`;
        # row-invariant, not bit-equal to the bf16 products: decode and verify rows both take
        # it, so speculation on stays = off). None: as the plan says (``act``, by default int8:
        # CONSTRAINED_SPEC_ACTIVATIONS); True / False: on / off whatever the plan says
        self._int8_activations: bool | None = None
        self._native_stacks: dict[str, NativeForward | None] = {}
        # prompts on the row-invariant path after their longest cached prefix
        self.prefiller = Prefiller(self, prefix_cache_bytes())

    def _head_and_embedding(self, model: Any, head_q8: Groups | None) -> tuple[Linear, torch.Tensor | None]:
        """The LM head (with the file's 8-bit groups for the q8 kernel when ``groups`` brings
        them, under "lm_head") and the dense embedding, or None for a tied embedding that the
        loader left on the meta device because it is those groups dequantized
        (`loading._embedding_in_head`): its rows are then gathered from the head's groups
        (`embed_rows`), and the head's pack is the one copy of both."""
        q8 = head_q8 if isinstance(head_q8, Q8Groups) else None
        embed = model.model.embed_tokens.weight
        if embed.is_meta and q8 is not None and model.get_output_embeddings().weight is embed:
            return Linear(q8=q8, float_out=True), None
        head = Linear(dense=self._weight(model.get_output_embeddings().weight), q8=q8, float_out=True)
        return head, self._weight(embed)

    @property
    def embed(self) -> torch.Tensor:
        """The embedding weight [V, D] (model dtype): drafters share its rows. Built from the
        LM head's groups when the runner holds the embedding only there."""
        return self._embed if self._embed is not None else self.head.dequantized(self.dtype)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows of ``ids`` [B, T] -> [B, T, D] (model dtype)."""
        if self._embed is not None:
            return F.embedding(ids, self._embed)
        return self.head.rows(ids, self.dtype)

    def _weight(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def _norm(self, t: torch.Tensor) -> torch.Tensor:
        """A norm weight as `_rms` reads it: ``1 + w`` in float32 for a family with
        ``norm_offset`` (Gemma), else in the runner's dtype."""
        if self.family.norm_offset:
            return 1.0 + t.detach().to(device=self.device, dtype=torch.float32)
        return self._weight(t)

    def _layer_weights(self, i: int, layer: Any, groups: Mapping[str, Groups]) -> LayerWeights:
        """Decoder layer ``i`` of the model as the runner holds it (`LayerWeights`)."""
        spec = self.family.spec
        norms = spec.norms
        biases = _fused_biases(spec, layer)
        linears: dict[str, Linear] = {}
        for name, lins in layer_linears(spec, layer).items():
            g = groups.get(f"{i}.{name}")
            # quantized weights keep their groups (their dense parts are meta tensors: a
            # torch.cat of those would import torch._dynamo, triton and sympy); the rest
            # stay dense in the runner's dtype (bf16 by default: half the bytes)
            if isinstance(g, Q8Groups):  # the file's 8-bit groups (Q8_0, Q5_x)
                linears[name] = Linear(q8=g, bias=biases[name])
            elif g is not None:
                linears[name] = Linear(int4=g, bias=biases[name])
            else:
                linears[name] = Linear(dense=self._weight(_fused_weight(lins)), bias=biases[name])
        qk_norm = None
        if spec.qk_norm:  # one weight row per q and k head: one norm call over [B, T, H + KV, hd]
            a, (H, KV, hd) = layer.self_attn, (self.n_heads, self.n_kv, self.head_dim)
            qk_norm = self._norm(torch.cat([a.q_norm.weight.expand(H, hd), a.k_norm.weight.expand(KV, hd)]))

        def norm(name: str | None) -> torch.Tensor | None:
            return None if name is None else self._norm(getattr(layer, name).weight)

        attn_in, mlp_in = norm(norms.attn_in), norm(norms.mlp_in)
        assert attn_in is not None and mlp_in is not None
        return LayerWeights(**linears, attn_in=attn_in, mlp_in=mlp_in, attn_out=norm(norms.attn_out),
                            mlp_out=norm(norms.mlp_out), qk_norm=qk_norm)

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head weight [V, D] (model dtype, on the device): drafters share its rows.
        Built from the q8 pack when the plan dropped the dense copy (`set_plan`)."""
        dense = self.head.dense
        return self.head.dequantized(self.dtype) if dense is None else dense

    @property
    def lm_head_weight(self) -> Linear:
        return self.head

    def quantize_for_drafting(self) -> int:
        """Run every linear and the LM head on the weight-only quantized kernels for few-row
        forwards (`weights.int8_pack`; those on exact 4-bit weights stay on int4): for a DRAFT
        model only, whose tokens the target verifies (its drafts may change, the output does
        not). CPU bf16 only (elsewhere nothing changes). Returns the number of matrices on a
        quantized kernel."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not int8_kernel_available():
            return 0
        self.plan = KernelPlan(prefill="bf16", decode=[(FEW_ROWS, "int8"), (ALL_ROWS, "bf16")],
                               lm_head="int8", source="drafting")
        # a draft model's rows change drafts only, never the output: its buckets may switch
        self.exact = False
        self._native_stacks = {}
        linears = self.linears() + [self.lm_head_weight]
        for lin in linears:
            lin.prepare({self._kernel(lin, "int8"), "bf16"}, resident=lin.int4 is None)
        self.quantized_linears = len(linears) - 1
        return len(linears)

    # -- kernels --------------------------------------------------------------------------
    def linears(self) -> list[Linear]:
        """Every decoder layer's matrices, layer by layer (the LM head is `lm_head_weight`)."""
        return [lin for L in self.layers for lin in L.linears()]

    def supports_kernel(self, kernel: str) -> bool:
        """Whether ``kernel`` runs any of this runner's linears (the others fall back; "q4"
        and "q8" stand for the native kernels, each weight on the one its groups fit)."""
        if kernel in ("q4", "q8"):
            return any(lin.supports("q4") or lin.supports("q8") for lin in self.linears())
        return any(lin.supports(kernel) for lin in self.linears())

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

    def set_plan(self, plan: KernelPlan) -> None:
        """Use ``plan`` from now on: build the packs and resident copies its kernels need, drop
        the rest, and put the KV cache in its dtype (every slot's cache is dropped)."""
        self.plan = plan
        self._native_stacks = {}  # their packs may change
        decode = {k for _, k in plan.decode}
        # dense forms a decode step uses stay resident (a per-step dequantization would cost
        # more than the step); a prefill's too unless the plan is lean on memory
        resident_for = decode if plan.memory == "lean" else plan.kernels()
        for lin in self.linears():
            lin.prepare({self._kernel(lin, k) for k in plan.kernels()},
                        resident=any(self._kernel(lin, d) in ("fp32", "bf16") for d in resident_for))
        head = self._kernel(self.lm_head_weight, plan.lm_head)
        self.lm_head_weight.prepare({head}, resident=True)
        dense = self.head.dense
        if head == "q8" and dense is not None and (self._embed is None
                                                   or dense.data_ptr() != self._embed.data_ptr()):
            self.head.drop_dense()  # an untied head run packed: the pack is its one copy
        self.reset_cache()

    def prefill(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[int]:
        return self.prefiller.prefill(slots, tokens)

    @property
    def row_invariant(self) -> bool:
        """Whether a decode / verify row's bits are its own whatever else the forward holds:
        exact, on a row-invariant decode kernel (not float32's GEMM). Where they are, what
        runs beside a row (other requests, drafts, a prompt) cannot change it."""
        return bool(self.exact) and self.plan.decode_kernel(1) in ROW_INVARIANT_KERNELS

    # switching either changes how a prompt's keys and values are computed, and the prefix
    # cache is keyed by tokens only: its blocks from the other setting are dropped
    @property
    def native_forward(self) -> bool:
        return self._native_forward

    @native_forward.setter
    def native_forward(self, on: bool) -> None:
        self._switch("_native_forward", on)

    @property
    def int8_activations(self) -> bool | None:
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, on: bool | None) -> None:
        self._switch("_int8_activations", on)

    def _switch(self, name: str, value: Any) -> None:
        if getattr(self, name) != value:
            self.prefiller.cache.clear()
        setattr(self, name, value)

    def reset_cache(self) -> None:
        """Drop every slot's cache (lengths too) and the prefix cache, and reallocate it in the
        plan's KV dtype."""
        self.prefiller.cache.clear()
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
        total = sum(lin.nbytes() for lin in self.linears() + [self.lm_head_weight])
        head, embed = self.head.dense, self._embed
        if embed is not None and (head is None or embed.data_ptr() != head.data_ptr()):
            total += embed.numel() * embed.element_size()
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
            self.prefiller.cache.clear()  # its blocks hold no hidden states of these layers
            if self._cap_slots:
                self._alloc_features()

    def _alloc_features(self) -> torch.Tensor:
        D = self.hidden_size
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
        D = self.hidden_size
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
    def _matmul(self, x: torch.Tensor, lin: Linear, kernel: str) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for the linear ``lin`` with the phase's ``kernel`` (from the
        plan): EVERY weight multiply of the forward (qkv, o, gate_up, down, lm_head) goes
        through here."""
        return lin(x, self._kernel(lin, kernel), row_invariant=self.exact)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim as the family's transformers module computes it."""
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.family.norm_offset:  # Gemma: (x * (1 + w)) in fp32, then cast (weight holds 1 + w)
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
    @overload
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: Literal[False] = False,
                phase: str | None = None) -> torch.Tensor: ...

    @overload
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: Literal[True],
                phase: str | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: bool = False,
                phase: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``phase``: "prefill" (a prompt) or "decode" (decode / verify rows); None = prefill
        when no logits are asked for. With the rows of the forward it picks the plan's kernel,
        and the kernel the activations' dtype. ``return_hidden``: the final-normed hidden
        states of the same rows too, as ``(logits, hidden)``."""
        if phase is None:
            phase = "decode" if any(num_logits) else "prefill"
        if self.exact and phase == "prefill" and len(slots) > 1:
            # each prompt alone, whatever it is batched with: its kernel from its own rows, and
            # SDPA's query blocks (which depend on the number of queries) from its own length
            rows = list(zip(slots, tokens, num_logits))
            if return_hidden:
                pairs = [self.forward([s], [t], [n], return_hidden=True, phase=phase) for s, t, n in rows]
                return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
            return torch.cat([self.forward([s], [t], [n], phase=phase) for s, t, n in rows])
        fb = self._batch(slots, tokens, phase)
        x = self.embed_rows(fb.ids)  # [B, T, D]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        x = x.to(ACT_DTYPE[fb.kernel])
        for key in set(self.family.rope_keys):
            cos, sin = self._rope(x, fb.pos, fb.lengths, key)
            fb.rope[key] = (cos[:, :, None], sin[:, :, None])  # [B, T, 1, rot_dim]
        keep = self.feature_layers
        kept: dict[int, torch.Tensor] = {}
        stack = self._native_stack(fb)
        if stack is not None:  # every layer in one native call
            x = self._native_layers(stack, x, fb, kept)
        else:
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

    def _native_stack(self, fb: _ForwardBatch) -> NativeForward | None:
        """The one-call native layer stack (`kernels.native_forward`) for this forward, or None
        where the torch layers run: not exact decode rows on the native attention
        (``fb.native`` empty), `native_forward` off, or a linear of the plan's kernel that is not
        packed q4 / q8. Built once per decode kernel (dropped with the plan)."""
        if not (self.native_forward and fb.native):
            return None
        asked = self.plan.act == "int8" if self.int8_activations is None else self.int8_activations
        int8 = asked and cpu_native.int8_activations()
        key = fb.kernel + ("|int8" if int8 else "")
        if key not in self._native_stacks:
            self._native_stacks[key] = self._build_native_stack(fb.kernel, int8=int8)
        return self._native_stacks[key]

    def act_choices(self, kernel: str) -> tuple[str, ...]:
        """The activations (`plan.KernelPlan.act`) decode rows on ``kernel`` can take: "int8"
        too where they run on the native layer stack (exact, `native_forward` on, every
        linear packed) with a 4-bit product among them."""
        if not (self.exact and self.native_forward and self.device.type == "cpu"
                and cpu_native.int8_activations() and native_forward.available()):
            return ("bf16",)
        kinds = {self._kernel(lin, kernel) for lin in self.linears()}
        return ("bf16", "int8") if kinds <= {"q4", "q8"} and "q4" in kinds else ("bf16",)

    def _build_native_stack(self, kernel: str, *, int8: bool = False) -> NativeForward | None:
        if not native_forward.available():
            return None
        fam = self.family
        kinds = {self._kernel(lin, kernel) for lin in self.linears()}
        if not kinds <= {"q4", "q8"}:
            logger.info("decode rows on the torch layers: kernels %s are not all native", sorted(kinds))
            return None
        ropes, windows = self._native_tables()

        def lin(w: Linear) -> native_forward.NativeLinear:
            return native_forward.NativeLinear(w._pack(self._kernel(w, kernel)), w.bias)

        def norm(w: torch.Tensor) -> torch.Tensor:  # the values `_rms` multiplies by
            return w.float() if fam.norm_offset else w.to(torch.bfloat16).float()

        def opt(w: torch.Tensor | None) -> torch.Tensor | None:
            return None if w is None else norm(w)

        layers = [native_forward.NativeLayer(
            lin(L.qkv), lin(L.o), lin(L.gate_up), lin(L.down), attn_in=norm(L.attn_in), mlp_in=norm(L.mlp_in),
            attn_out=opt(L.attn_out), mlp_out=opt(L.mlp_out), qk_norm=opt(L.qk_norm),
            rope=ropes.index(fam.rope_keys[i]), window=windows.index(fam.windows[i]))
            for i, L in enumerate(self.layers)]
        try:
            stack = NativeForward(
                layers, heads=self.n_heads, kv_heads=self.n_kv, head_dim=self.head_dim, eps=self.eps,
                scale=self.head_dim ** -0.5 if fam.attn_scale is None else fam.attn_scale,
                softcap=fam.attn_softcap, norm_offset=fam.norm_offset, gelu=fam.act != "silu",
                int8_activations=int8)
        except ValueError as e:
            logger.info("decode rows on the torch layers: %s", e)
            return None
        return stack

    def _native_tables(self) -> tuple[list[str | None], list[int | None]]:
        """The model's RoPE keys and window sizes, each once: a native layer's ``rope`` and
        ``window`` index them."""
        return list(dict.fromkeys(self.family.rope_keys)), list(dict.fromkeys(self.family.windows))

    def _native_layers(self, stack: NativeForward, x: torch.Tensor, fb: _ForwardBatch,
                       kept: dict[int, torch.Tensor]) -> torch.Tensor:
        """Every decoder layer on x [B, T, D] in one native call; each kept layer's input into
        ``kept`` (as the torch layers keep them)."""
        B, T, D = x.shape
        # only the real rows run: a batch of requests with different draft lengths is padded
        # to its longest, and a padded row would cost what a real one does (each row is
        # computed alone, so leaving the padding out changes no real row's bits)
        real = None if all(n == T for n in fb.lengths) else torch.tensor(
            [b * T + j for b, n in enumerate(fb.lengths) for j in range(n)], dtype=torch.long)

        def rows(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return t if real is None else t.index_select(dim, real)

        R = B * T if real is None else len(real)
        keep = [torch.empty(R, D, dtype=x.dtype) if i in self.feature_layers else None
                for i in range(self.n_layers)]
        ropes, windows = self._native_tables()
        rope = [(rows(fb.rope[key][0].reshape(B * T, -1)).contiguous(),
                 rows(fb.rope[key][1].reshape(B * T, -1)).contiguous()) for key in ropes]
        write = rows(torch.stack([t.reshape(B * T) for t in fb.write_idx]), 1).contiguous()
        out = stack(rows(x.reshape(B * T, D)).contiguous(), write, self.k_cache, self.v_cache, rope,
                    [rows(fb.native[w], 1).contiguous() for w in windows], keep)

        def padded(t: torch.Tensor) -> torch.Tensor:  # [R, D] -> [B, T, D], zeros in the padding
            if real is None:
                return t.view(B, T, D)
            full = torch.zeros(B * T, D, dtype=t.dtype)
            full[real] = t
            return full.view(B, T, D)

        kept.update({i: padded(t) for i, t in enumerate(keep) if t is not None})
        return padded(out)

    def _layer(self, i: int, L: LayerWeights, x: torch.Tensor, fb: _ForwardBatch) -> torch.Tensor:
        """Decoder layer ``i`` on x [B, T, D]: attention (its k / v written to the cache), MLP."""
        fam, kernel = self.family, fb.kernel
        B, T = fb.ids.shape
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        h = self._rms(x, L.attn_in)
        qkv = self._matmul(h, L.qkv, kernel).view(B, T, H + 2 * KV, hd)
        qk, v = qkv[:, :, : H + KV], qkv[:, :, H + KV:]  # q and k heads together: [B, T, H + KV, hd]
        if L.qk_norm is not None:
            qk = self._rms(qk, L.qk_norm)
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

    def _layer_rest(self, L: LayerWeights, x: torch.Tensor, att: torch.Tensor,
                    fb: _ForwardBatch) -> torch.Tensor:
        """The rest of a decoder layer after its attention ``att`` [B, T, H * hd]: the output
        projection, the residual, the MLP."""
        fam, kernel = self.family, fb.kernel
        a = self._matmul(att, L.o, kernel)  # [B, T, D]
        if L.attn_out is not None:
            a = self._rms(a, L.attn_out)
        x = x + a
        h = self._rms(x, L.mlp_in)
        gate, up = self._matmul(h, L.gate_up, kernel).chunk(2, dim=-1)
        gate = F.silu(gate) if fam.act == "silu" else F.gelu(gate, approximate="tanh")
        m = self._matmul(gate * up, L.down, kernel)
        if L.mlp_out is not None:
            m = self._rms(m, L.mlp_out)
        return x + m

    def _logits(self, x: torch.Tensor, tokens: Sequence[Sequence[int]], num_logits: Sequence[int],
                return_hidden: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits only for the rows asked for: the last ``num_logits[b]`` real positions of
        each slot (and their final-normed hidden states with ``return_hidden``)."""
        B, T = x.shape[:2]
        rows = [b * T + len(t) - n + j for b, (t, n) in enumerate(zip(tokens, num_logits)) for j in range(n)]
        idx = torch.tensor(rows, device=x.device, dtype=torch.long)
        hidden = self._rms(x.reshape(B * T, -1).index_select(0, idx), self.norm)
        logits = self._matmul(hidden, self.head, self.plan.lm_head).float()  # [sum num_logits, V]
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


def linear(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a dense weight or a weight-only pack (`weights.int8_pack`,
    `weights.Int4Groups.int4_pack`: bf16 out, `weights.packed_matmul`)."""
    y = F.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else packed_matmul(x, weight)
    return y if bias is None or isinstance(weight, torch.Tensor) else y + bias


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
         scale: float | None = None) -> torch.Tensor:
    """Masked SDPA of q [B, H, T, hd] over k / v [B, KV, S, hd] (KV dividing H) -> [B, H, T, hd],
    as every runner attention call makes it. On the CPU a single query goes in twice: the
    kernel's one-query path is slower than two queries (benchmarks/RESULTS.md, "Decode
    attention: one query sent twice, and the exact runner's cost after it"). (An exact
    runner's decode rows do not come here: `attention.chunked_attention`.)"""
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


class HFRunner(RunnerBase):
    """Any transformers causal LM: one DynamicCache per slot, one forward per slot."""

    def __init__(self, model: Any, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device, self.dtype = device, dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        self._caches: dict[int, DynamicCache] = {}
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

    @overload
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *, return_hidden: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int], *,
                return_hidden: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], num_logits: Sequence[int],
                *, return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One transformers forward per slot (`protocols.Runner.forward`); ``return_hidden``: as
        `LeanRunner.forward`."""
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
