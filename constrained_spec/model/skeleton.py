"""A transformers-shaped causal LM without transformers' modeling code, for the lean runner.

`runner.LeanRunner` and `families.Family` read a causal LM's config, its modules' weights and its
rotary (RoPE) module; they never call its forward. Building the transformers model just to
have those objects imports ``transformers.modeling_utils`` (every ``modeling_<family>.py``
pulls it in, and with it torch.distributed, dynamo / inductor, sympy, scipy...: resident
memory, benchmarks/RESULTS.md, "Memory: one copy of the 4-bit weights, the auto memory mode")
for a process that never runs it. `skeleton_model` builds the same object
graph from a config and a state dict -- the same module and parameter names and shapes as the
family's transformers model (its row of `families.FAMILIES` names them),
``model.model.{embed_tokens, layers, norm, rotary_emb}``,
``lm_head`` / ``get_output_embeddings()``, ``config``, ``generation_config`` -- with only the
light parts of transformers (``modeling_rope_utils``, ``GenerationConfig``). Its config is a
`LightConfig`: the attributes of the family's transformers config, as that class resolved
them once (`light_config` keeps them in the converted folder), without importing the class --
a transformers config module imports ``transformers.activations`` and through it
torch.distributed and sympy (benchmarks/RESULTS.md, "Memory: what a lean load no longer
holds").

`RotaryEmbedding` computes what the family's transformers rotary module computes, bit for bit
(tests compare the runner's logits on both): the frequencies come from transformers' own
``ROPE_INIT_FUNCTIONS`` (the family's ``compute_default_rope_parameters`` for
``rope_type="default"``, copied: phi3 applies ``partial_rotary_factor`` there, the others do
not: the row's ``partial_rotary``), and the forward repeats its arithmetic:
``pos[..., None].float() * inv_freq`` in float32, cos / sin of the frequencies twice over,
times ``attention_scaling``, cast to the input's dtype. longrope picks its long factors when
the call's last position is past ``original_max_position_embeddings`` (transformers'
``dynamic_rope_update``); dynamic NTK equals its init frequencies up to
``max_position_embeddings``, and past it transformers rescales statefully, which this module
refuses (so does the runner).

A parameter missing from the state dict is a meta tensor of its shape, as on a transformers
model built on the meta device: the 4-bit matrices of a converted GGUF, which the runner takes
as groups instead (``loading._open_lean`` checks that every one is).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from constrained_spec.errors import ModelLoadError
from constrained_spec.model.families import FAMILIES, MATRICES, head_dim

# the resolved attributes of a converted folder's transformers config (`light_config`)
LIGHT_CONFIG = "light_config.json"


class LightConfig:
    """A transformers config's attributes (its ``to_dict()``, defaults resolved) as plain
    attributes, with the few methods the skeleton's readers call: ``to_dict``,
    ``get_text_config`` and what ``modeling_rope_utils`` calls (``standardize_rope_params``: the
    values are standardized already; ``per_layer_config``: none, as transformers raises)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> LightConfig:
        return self

    def standardize_rope_params(self) -> None:
        return None

    @property
    def per_layer_config(self) -> Any:
        raise ValueError(f"{self.__dict__.get('model_type')} has no per-layer config")

    def __repr__(self) -> str:
        return f"LightConfig(model_type={self.__dict__.get('model_type')!r})"


def light_config(folder: Path) -> Any:
    """The config of the checkpoint in ``folder``: a `LightConfig` from ``light_config.json``
    when it was written by this transformers version, else transformers' own (whose resolved
    attributes are then written there for the next load; a read-only folder just loads it
    again next time)."""
    import transformers

    path = Path(folder) / LIGHT_CONFIG
    try:
        values = json.loads(path.read_text())
        if values.get("transformers_version") == transformers.__version__ and \
                values.get("model_type") in FAMILIES:
            return LightConfig(values)
    except (OSError, ValueError, AttributeError):
        pass
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    if getattr(config, "model_type", None) in FAMILIES:
        values = config.to_dict()
        values["transformers_version"] = transformers.__version__
        from constrained_spec.cache import write_cached_json

        write_cached_json(path, values)
    return config


def parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The parameters (state-dict names, shapes) of ``config``'s transformers causal LM, laid
    out from its row of `families.FAMILIES` (raises ModelLoadError for a family without one)."""
    mt = getattr(config, "model_type", None)
    spec = FAMILIES.get(mt) if isinstance(mt, str) else None
    if spec is None:
        raise ModelLoadError(f"no light model layout for model_type {mt!r} (known: "
                             f"{', '.join(FAMILIES)}); load it with transformers")
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    H = config.num_attention_heads
    KV = getattr(config, "num_key_value_heads", None) or H
    hd = head_dim(config)
    rows = {"q": H * hd, "k": KV * hd, "v": KV * hd, "o": D, "gate": F, "up": F, "down": D}
    inputs = {"qkv": D, "o": H * hd, "gate_up": D, "down": F}  # per runner matrix
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for matrix in MATRICES:
            biased = spec.bias(matrix, config)
            for part in spec.linears.parts(matrix):
                out = sum(rows[b] for b in part.blocks)
                shapes[p + part.path + ".weight"] = (out, inputs[matrix])
                if biased:
                    shapes[p + part.path + ".bias"] = (out,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (hd,)
        for name in spec.norms.names():
            shapes[p + name + ".weight"] = (D,)
    shapes["model.norm.weight"] = (D,)
    shapes["lm_head.weight"] = (V, D)
    return shapes


class WeightHolder(nn.Module):
    """A linear layer, an embedding or a norm as the runner reads it: ``weight`` and (None for
    all but biased linears) ``bias``. It has no forward."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class _Node(nn.Module):
    """A container module (attention, MLP, decoder layer): named children only."""


class SkeletonModel(nn.Module):
    """``model.model``: embeddings, decoder layers, final norm, rotary module."""

    def __init__(self, embed_tokens: WeightHolder, layers: nn.ModuleList, norm: WeightHolder,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = embed_tokens, layers, norm, rotary_emb


class SkeletonForCausalLM(nn.Module):
    """What the lean runner reads of a transformers causal LM (`skeleton_model` builds it).
    Calling it is an error: it holds weights, not transformers' forward."""

    def __init__(self, config: Any, model: SkeletonModel, lm_head: WeightHolder,
                 generation_config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = lm_head
        self.generation_config = generation_config

    def get_input_embeddings(self) -> WeightHolder:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> WeightHolder:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelLoadError(
            "this model was opened for the lean runner and has no transformers forward; load it "
            "with load_model(..., full_model=True) to call it")


def skeleton_model(config: Any, state: Mapping[str, torch.Tensor]) -> SkeletonForCausalLM:
    """The lean runner's view of ``config``'s causal LM over the tensors of ``state``
    (transformers parameter names; memory-mapped tensors stay mapped). A parameter ``state``
    lacks is a meta tensor of its shape; with ``config.tie_word_embeddings`` the LM head is the
    embedding (as transformers ties it). Raises ModelLoadError for a family without a layout
    here, a tensor of the wrong shape, or a tensor the model has no parameter for."""
    shapes = parameter_shapes(config)
    unexpected = sorted(set(state) - set(shapes))
    if unexpected:
        raise ModelLoadError(f"{len(unexpected)} tensors that a {config.model_type} model has no "
                             f"parameter for: {unexpected[:4]}; load it with transformers")
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        t = state.get(name)
        if t is None:
            t = torch.empty(shape, device="meta")
        elif tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}; the config "
                                 f"({config.model_type}) makes it {shape}")
        tensors[name] = t

    def holder(prefix: str) -> WeightHolder:
        return WeightHolder(tensors[prefix + ".weight"], tensors.get(prefix + ".bias"))

    layers = nn.ModuleList()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = _Node()
        for part in ("self_attn", "mlp"):
            node = _Node()
            for name in shapes:
                if name.startswith(p + part + ".") and name.endswith(".weight"):
                    child = name[len(p + part) + 1: -len(".weight")]
                    node.add_module(child, holder(name.removesuffix(".weight")))
            layer.add_module(part, node)
        for name in shapes:
            if name.startswith(p) and name.count(".") == 4:  # model.layers.{i}.{norm}.weight
                layer.add_module(name.split(".")[3], holder(name.removesuffix(".weight")))
        layers.append(layer)
    embed = holder("model.embed_tokens")
    inner = SkeletonModel(embed, layers, holder("model.norm"), RotaryEmbedding(config))
    head = embed if getattr(config, "tie_word_embeddings", False) else holder("lm_head")
    return SkeletonForCausalLM(config, inner, head, _generation_config(config))


def release_copied_weights(model: SkeletonForCausalLM, kept: Iterable[torch.Tensor]) -> int:
    """Turn every decoder-layer weight and bias of ``model`` whose storage none of ``kept``
    shares into a meta tensor of its shape, and return the bytes released. Call it with the
    tensors a runner built from ``model`` holds: the parts it fused into one matrix (q/k/v,
    gate/up) or cast to another dtype are copies there, and holding both doubles those layers
    (benchmarks/RESULTS.md, "Memory: what a lean load no longer holds"). Embeddings, the LM
    head and the final norm stay (drafters and head training read them)."""
    ptrs = {t.untyped_storage().data_ptr() for t in kept if not t.is_meta}
    released = 0
    for holder in model.model.layers.modules():
        if not isinstance(holder, WeightHolder):
            continue
        for name in ("weight", "bias"):
            p = getattr(holder, name)
            if p is None or p.is_meta or p.untyped_storage().data_ptr() in ptrs:
                continue
            released += p.numel() * p.element_size()
            setattr(holder, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                               requires_grad=False))
    return released


def release_lm_head(model: SkeletonForCausalLM, kept: Iterable[torch.Tensor]) -> int:
    """Turn ``model``'s LM head weight into a meta tensor when none of ``kept`` (the runner's
    tensors) shares its storage and it is not the embedding (an untied head the runner holds
    only as its q8 pack: `runner.LeanRunner.set_plan`); the bytes released."""
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    ptrs = {t.untyped_storage().data_ptr() for t in kept if not t.is_meta}
    if head.is_meta or head.untyped_storage().data_ptr() in ptrs \
            or head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr():
        return 0
    model.lm_head.weight = nn.Parameter(torch.empty(head.shape, dtype=head.dtype, device="meta"),
                                        requires_grad=False)
    return head.numel() * head.element_size()


def _generation_config(config: Any) -> Any:
    """What transformers' model init sets: ``GenerationConfig.from_model_config(config)``."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_model_config(config)
    except NotImplementedError:
        return GenerationConfig()


class RotaryEmbedding(nn.Module):
    """cos / sin of the family's transformers rotary module, bit for bit (module docstring).

    Attributes as transformers': ``rope_type`` (gemma3: a dict by layer type),
    ``inv_freq`` / ``original_inv_freq`` buffers and ``attention_scaling`` (gemma3: each
    prefixed ``"{layer_type}_"``), ``max_seq_len_cached`` / ``original_max_seq_len``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type: str | dict[str, str]
        self.spec = FAMILIES[config.model_type]
        if self.spec.rope_by_layer_type:  # one set of frequencies per layer type (gemma3)
            self.rope_type = {}
            for layer_type in sorted(set(config.layer_types)):
                params = config.rope_parameters[layer_type]
                if params is not None:
                    self.rope_type[layer_type] = params["rope_type"]
                    self._init_frequencies(params["rope_type"], layer_type)
        else:
            rope_type: str = config.rope_parameters["rope_type"]
            self.rope_type = rope_type
            self._init_frequencies(rope_type, None)

    def _init_frequencies(self, rope_type: str, layer_type: str | None) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type == "default":
            inv_freq, scaling = self._default_frequencies(layer_type)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, None, **kwargs)
        prefix = "" if layer_type is None else f"{layer_type}_"
        self.register_buffer(prefix + "inv_freq", inv_freq, persistent=False)
        self.register_buffer(prefix + "original_inv_freq", inv_freq.clone(), persistent=False)
        setattr(self, prefix + "attention_scaling", scaling)
        if rope_type == "longrope":  # what dynamic_rope_update computes on first use
            params = self._params(layer_type)
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](
                self.config, None, seq_len=params["original_max_position_embeddings"] + 1, **kwargs)
            self.register_buffer(prefix + "long_inv_freq", long_inv_freq, persistent=False)

    def _params(self, layer_type: str | None) -> dict[str, Any]:
        params = self.config.rope_parameters
        return params if layer_type is None else params[layer_type]

    def _default_frequencies(self, layer_type: str | None) -> tuple[torch.Tensor, float]:
        """The family's ``compute_default_rope_parameters``, copied: the base of the layer
        type (gemma3), a partial rotary dimension (the families whose row says so: phi3)."""
        params = self._params(layer_type)
        base = params["rope_theta"]
        dim = head_dim(self.config)
        if self.spec.partial_rotary:
            dim = int(dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, rot_dim] in ``x``'s dtype at ``position_ids`` [B, T]."""
        prefix = "" if layer_type is None else f"{layer_type}_"
        inv_freq = getattr(self, prefix + "inv_freq")
        rope_type = self.rope_type
        if isinstance(rope_type, dict):  # gemma3, whose buffers are found by layer type only
            assert layer_type is not None
            rope_type = rope_type[layer_type]
        if "dynamic" in rope_type or rope_type == "longrope":
            seq_len = torch.max(position_ids) + 1
            if "dynamic" in rope_type and seq_len > self.original_max_seq_len:
                raise ValueError(f"position {int(seq_len) - 1} is past max_position_embeddings "
                                 f"{self.original_max_seq_len}: beyond it transformers' dynamic RoPE "
                                 "rescales statefully, which this module does not reproduce")
            if rope_type == "longrope":  # the long factors past the original length
                original = self._params(layer_type)["original_max_position_embeddings"]
                inv_freq = torch.where(seq_len > original, getattr(self, prefix + "long_inv_freq"),
                                       getattr(self, prefix + "original_inv_freq"))
        scaling = getattr(self, prefix + "attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
