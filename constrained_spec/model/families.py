"""The decoder families the lean runner computes: one row each, everything that differs.

The lean runner (`runner.LeanRunner`) runs ONE decoder block for every family, and the light
model (`skeleton.skeleton_model`) lays out every family's parameters without transformers'
modeling code. Both read what differs between families from one table, `FAMILIES`, keyed by
the transformers ``model_type``: the checkpoint's names of the linear layers and norms (and
which are stored fused), where biases sit, q/k norms, Gemma's ``(1 + w)`` norms and scaled
embeddings, the config attribute naming the activation, which layers slide, soft-capping, the
attention scale and how the rotary module is laid out.

`Family.of` reads a transformers model (or a skeleton) against its row and returns the
switches one forward reads (a window per layer, the RoPE mode, the scales), or raises
`UnsupportedModel` for a config switch the lean runner does not implement: that model runs on
transformers' forward (`runner.HFRunner`) instead.

Adding a family is a row here, plus a kernel change in ``runner.py`` only when the family
needs math no row has yet; docs/extending.md has the walkthrough and the tests that follow.
This module imports neither torch nor transformers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Literal

# the activations the runner's MLP computes, by the name a config gives them
ACTIVATIONS: dict[str, Literal["silu", "gelu_tanh"]] = {
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# rope types whose frequencies the rotary module fixes at init (it only rescales them there)
ROPE_FIXED = frozenset({"default", "linear", "llama3", "yarn"})

# the runner's four matrices per decoder layer, in the order it lists them
MATRICES = ("qkv", "o", "gate_up", "down")


class UnsupportedModel(ValueError):
    """The lean runner does not implement something ``model``'s forward does (HFRunner runs it)."""


@dataclass(frozen=True)
class Part:
    """A linear module of a decoder layer as the checkpoint names it, and the row blocks of the
    runner's matrix it holds, in order: ``q`` (heads x head_dim rows), ``k`` / ``v``
    (kv heads x head_dim), ``o`` / ``down`` (hidden size), ``gate`` / ``up`` (intermediate
    size)."""

    path: str  # inside a decoder layer: "self_attn.q_proj"
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """The checkpoint's linear modules of a decoder layer per runner matrix (`MATRICES`): each
    matrix is the concatenation of its parts' rows."""

    qkv: tuple[Part, ...]
    o: tuple[Part, ...]
    gate_up: tuple[Part, ...]
    down: tuple[Part, ...]

    def parts(self, matrix: str) -> tuple[Part, ...]:
        return getattr(self, matrix)


SEPARATE = Layout(
    qkv=(Part("self_attn.q_proj", ("q",)), Part("self_attn.k_proj", ("k",)),
         Part("self_attn.v_proj", ("v",))),
    o=(Part("self_attn.o_proj", ("o",)),),
    gate_up=(Part("mlp.gate_proj", ("gate",)), Part("mlp.up_proj", ("up",))),
    down=(Part("mlp.down_proj", ("down",)),))
# q/k/v and gate/up stored as one module each (phi3)
FUSED = Layout(qkv=(Part("self_attn.qkv_proj", ("q", "k", "v")),), o=SEPARATE.o,
               gate_up=(Part("mlp.gate_up_proj", ("gate", "up")),), down=SEPARATE.down)


@dataclass(frozen=True)
class Norms:
    """The RMSNorm modules of a decoder layer, by where the block applies them."""

    attn_in: str = "input_layernorm"  # before attention
    mlp_in: str = "post_attention_layernorm"  # before the MLP
    attn_out: str | None = None  # on the attention output, before the residual (gemma)
    mlp_out: str | None = None  # on the MLP output, before the residual (gemma)

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.attn_in, self.attn_out, self.mlp_in, self.mlp_out) if n)


GEMMA_NORMS = Norms(attn_in="input_layernorm", attn_out="post_attention_layernorm",
                    mlp_in="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm")

# where a matrix has a bias: always, never, or when this boolean attribute of the config is set
Bias = bool | str


@dataclass(frozen=True)
class FamilySpec:
    """One row of `FAMILIES`: how a decoder family's block differs from Llama's."""

    model_type: str
    linears: Layout  # the checkpoint's linear modules per runner matrix (`SEPARATE`, `FUSED`)
    qkv_bias: Bias  # on q, k and v
    o_bias: Bias
    mlp_bias: Bias  # on gate, up and down
    norms: Norms
    # RMSNorm scales by (1 + w) in float32 before the cast (gemma); else cast, then times w
    norm_offset: bool
    qk_norm: bool  # an RMSNorm over head_dim on every q and k head before RoPE (q_norm, k_norm)
    scaled_embeddings: bool  # embeddings times sqrt(hidden_size), rounded to the model dtype
    activation_attr: str  # the config attribute naming the MLP's activation (`ACTIVATIONS`)
    # which layers slide: "every_layer" (config.sliding_window, when set, on all of them),
    # "layer_types" (config.layer_types names them), "none"
    windows: Literal["every_layer", "layer_types", "none"]
    attn_softcap: bool  # tanh soft-capping of attention scores (config.attn_logit_softcapping)
    final_softcap: bool  # tanh soft-capping of the logits (config.final_logit_softcapping)
    # attention scale 1/sqrt(config.query_pre_attn_scalar) (gemma), else 1/sqrt(head_dim)
    query_pre_attn_scalar: bool
    rope_by_layer_type: bool  # config.rope_parameters holds one set per layer type (gemma3)
    # the family's own default RoPE applies config's partial_rotary_factor (phi3)
    partial_rotary: bool

    def bias(self, matrix: str, config: Any) -> bool:
        """Whether the parts of runner matrix ``matrix`` have biases under ``config``."""
        flag = {"qkv": self.qkv_bias, "o": self.o_bias}.get(matrix, self.mlp_bias)
        return bool(getattr(config, flag, False)) if isinstance(flag, str) else flag


# Llama's block, the base every row changes (not a row: its model_type is empty)
_BLOCK = FamilySpec(
    model_type="", linears=SEPARATE, qkv_bias=False, o_bias=False, mlp_bias=False, norms=Norms(),
    norm_offset=False, qk_norm=False, scaled_embeddings=False, activation_attr="hidden_act",
    windows="none", attn_softcap=False, final_softcap=False, query_pre_attn_scalar=False,
    rope_by_layer_type=False, partial_rotary=False)
_GEMMA = replace(_BLOCK, qkv_bias="attention_bias", o_bias="attention_bias", norms=GEMMA_NORMS,
                 norm_offset=True, scaled_embeddings=True, activation_attr="hidden_activation",
                 windows="layer_types", final_softcap=True, query_pre_attn_scalar=True)

# THE table: every family the lean runner and the skeleton cover, each row the base block
# above with what the family changes
FAMILIES: dict[str, FamilySpec] = {f.model_type: f for f in (
    replace(_BLOCK, model_type="llama", qkv_bias="attention_bias", o_bias="attention_bias",
            mlp_bias="mlp_bias"),
    replace(_BLOCK, model_type="mistral", windows="every_layer"),
    replace(_BLOCK, model_type="qwen2", qkv_bias=True, windows="layer_types"),
    replace(_BLOCK, model_type="qwen3", qkv_bias="attention_bias", o_bias="attention_bias",
            qk_norm=True, windows="layer_types"),
    replace(_GEMMA, model_type="gemma2", attn_softcap=True),
    # transformers' gemma3 attention does not pass its attn_logit_softcapping on: neither do we
    replace(_GEMMA, model_type="gemma3_text", qk_norm=True, rope_by_layer_type=True),
    replace(_BLOCK, model_type="phi3", linears=FUSED, windows="every_layer", partial_rotary=True),
)}


def family_of(config: Any) -> FamilySpec:
    """The row of ``config``'s model type; UnsupportedModel when the table has none."""
    mt = getattr(config, "model_type", None)
    if mt not in FAMILIES:
        raise UnsupportedModel(f"model_type {mt!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[mt]


def layer_linears(spec: FamilySpec, layer: Any) -> dict[str, list[Any]]:
    """Decoder ``layer``'s linear modules per runner matrix (`MATRICES`), in the row's layout:
    the runner concatenates each list's weights (q/k/v, gate/up) into one matrix. Raises
    AttributeError when the layer lacks one."""
    return {m: [operator.attrgetter(p.path)(layer) for p in spec.linears.parts(m)] for m in MATRICES}


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Family:
    """What one forward of the lean runner reads of a model: its row of `FAMILIES` and the
    switches its config sets (`Family.of`)."""

    spec: FamilySpec
    # the family's embedding factor sqrt(hidden_size) (scaled_embeddings), else None
    embed_scale: float | None
    act: Literal["silu", "gelu_tanh"]
    attn_scale: float  # 1/sqrt(head_dim), or gemma's 1/sqrt(query_pre_attn_scalar)
    attn_softcap: float | None  # tanh soft-capping of attention scores
    final_softcap: float | None  # tanh soft-capping of the logits
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

    @property
    def model_type(self) -> str:
        return self.spec.model_type

    @property
    def qk_norm(self) -> bool:
        return self.spec.qk_norm

    @property
    def norm_offset(self) -> bool:
        return self.spec.norm_offset

    @classmethod
    def of(cls, model: Any) -> Family:
        """The switches of ``model`` (a transformers causal LM, or a skeleton); raises
        UnsupportedModel for anything the lean runner does not compute exactly as its
        transformers forward does."""
        cfg = model.config
        spec = family_of(cfg)
        inner = getattr(model, "model", None)
        if not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
            raise UnsupportedModel("no model.model.{layers, embed_tokens, norm, rotary_emb}")
        assert inner is not None
        head = model.get_output_embeddings()
        if getattr(head, "weight", None) is None or getattr(head, "bias", None) is not None:
            raise UnsupportedModel("the LM head is not a bias-free linear layer")
        act_name = getattr(cfg, spec.activation_attr)
        if act_name not in ACTIVATIONS:
            raise UnsupportedModel(f"activation {act_name!r}")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModel("bidirectional attention")
        n = cfg.num_hidden_layers
        if len(inner.layers) != n:
            raise UnsupportedModel(f"{len(inner.layers)} decoder layers for num_hidden_layers {n}")
        try:
            layer_linears(spec, inner.layers[0])
        except AttributeError as e:
            raise UnsupportedModel(f"decoder layer without the expected linear layers ({e})") from None
        if spec.qk_norm and not hasattr(inner.layers[0].self_attn, "q_norm"):
            raise UnsupportedModel("no q_norm / k_norm on the attention")
        windows, types = _windows(spec, cfg)
        rope_keys, rope = _rope(inner.rotary_emb.rope_type, types)
        scale = cfg.query_pre_attn_scalar if spec.query_pre_attn_scalar else head_dim(cfg)
        return cls(
            spec=spec, embed_scale=cfg.hidden_size ** 0.5 if spec.scaled_embeddings else None,
            act=ACTIVATIONS[act_name], attn_scale=scale ** -0.5,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if spec.attn_softcap else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if spec.final_softcap else None,
            windows=windows, rope_keys=rope_keys, rope=rope)


def _windows(spec: FamilySpec, cfg: Any) -> tuple[tuple[int | None, ...], list[str]]:
    """Per layer, its sliding window or None, and its layer type."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or None
    if spec.windows == "every_layer":
        types = ["sliding_attention" if window else "full_attention"] * n
    elif spec.windows == "layer_types":
        types = list(cfg.layer_types)
    else:
        types = ["full_attention"] * n
    if set(types) - {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"layer types {sorted(set(types))}")
    if "sliding_attention" in types and not window:
        raise UnsupportedModel("sliding_attention layers without a sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types), types


def _rope(rope_type: str | dict[str, str], types: list[str]
          ) -> tuple[tuple[str | None, ...], Literal["batched", "per_slot", "original"]]:
    """The rotary module's key per layer (gemma3: its layer type) and the runner's RoPE mode,
    from the module's ``rope_type`` (gemma3: a dict by layer type)."""
    rope_keys = tuple(types) if isinstance(rope_type, dict) else (None,) * len(types)
    kinds = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
    if kinds - ROPE_FIXED - {"dynamic", "longrope"}:
        raise UnsupportedModel(f"rope type {sorted(kinds - ROPE_FIXED)}")
    if {"dynamic", "longrope"} <= kinds:
        raise UnsupportedModel("dynamic and longrope RoPE in one model")
    return rope_keys, "original" if "dynamic" in kinds else "per_slot" if "longrope" in kinds else "batched"
