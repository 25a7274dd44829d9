"""Reading draft heads from disk: ours, public EAGLE-3 checkpoints, DeepSeek-V3-style MTP layers.

- Ours (`DraftHead.save`): ``config.json`` = ``{"constrained_spec_head": HeadConfig}`` and
  ``model.safetensors`` with the head's own parameter names.
- EAGLE-3 (e.g. the checkpoints of the EAGLE authors, SpecForge, vLLM's speculators):
  ``config.json`` of a ``LlamaForCausalLMEagle3`` (hidden_size, heads, intermediate_size,
  vocab_size = the target's, ``draft_vocab_size``, rope_theta, optionally
  ``eagle_config.eagle_aux_hidden_state_layer_ids``) and weights ``fc.weight``,
  ``midlayer.{input_layernorm, hidden_norm, self_attn.*, post_attention_layernorm, mlp.*}``,
  ``norm.weight``, ``lm_head.weight``, ``d2t`` (offsets: target id = draft id + d2t[id]) and
  ``t2d`` (a [V] bool mask, redundant with d2t). An ``embed_tokens.weight`` there, if any,
  replaces the target's embedding for the head.
- MTP (DeepSeek-V3 layout): the model's own checkpoint holds, after its ``num_hidden_layers``
  decoder layers, the MTP layer ``model.layers.{N}.*``: ``enorm``, ``hnorm``, ``eh_proj``, a
  decoder block (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``,
  ``mlp.*``), ``shared_head.norm`` and ``shared_head.head`` (and possibly ``embed_tokens``).
  Llama-style blocks only (q/k/v/o and gate/up/down projections); DeepSeek's MLA attention and
  MoE experts are refused with a ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from constrained_spec.drafters.heads import FINAL, DraftHead, HeadConfig
from constrained_spec.errors import ConfigError, ModelLoadError

_BLOCK = {  # public block names -> DraftHead names (after the layer prefix)
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}


def read_weights(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder (``*.safetensors`` shards, else ``*.bin``) whose names
    start with ``prefix`` (safetensors files are read tensor by tensor: an MTP layer is read
    without the rest of the model)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    try:
        if files:
            for f in files:
                with safe_open(str(f), "pt") as fh:
                    for key in fh.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                        if key.startswith(prefix):
                            out[key] = fh.get_tensor(key)
        else:
            for f in sorted(folder.glob("*.bin")):
                out.update({k: v for k, v in torch.load(f, map_location="cpu", weights_only=True).items()
                            if k.startswith(prefix)})
    except Exception as e:
        raise ModelLoadError(f"could not read the weights in {folder}: {type(e).__name__}: {e}") from e
    if not out:
        raise ConfigError(f"no weights (*.safetensors or *.bin) in {folder}", option="speculative.model")
    return out


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise ConfigError(f"{folder} has no config.json", option="speculative.model")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}", option="speculative.model") from e


def load_head(folder: Path, method: str, target_config: Any, embed: torch.Tensor,
              lm_head: torch.Tensor) -> DraftHead:
    """The head in ``folder`` (any of the three formats above), for a target with
    ``target_config``, its token embedding ``embed`` and LM head ``lm_head``."""
    cfg = _config(folder)
    if "constrained_spec_head" in cfg:
        config = HeadConfig.from_dict(cfg["constrained_spec_head"])
        state = read_weights(folder)
        return _build(config, state, embed, lm_head, folder)
    if method == "eagle3":
        config, state, emb = read_eagle3(cfg, read_weights(folder), target_config)
        return _build(config, state, embed if emb is None else emb, lm_head, folder)
    layer = find_mtp_layer(folder, cfg)
    if layer is None:
        raise ConfigError(f"{folder} holds neither a constrained_spec head nor an MTP layer "
                          "(model.layers.{num_hidden_layers}.eh_proj.weight)", option="speculative.model")
    config, state, emb, head = read_mtp(cfg, read_weights(folder, f"model.layers.{layer}."), layer,
                                        target_config)
    return _build(config, state, embed if emb is None else emb, lm_head if head is None else head, folder)


def _build(config: HeadConfig, state: dict[str, torch.Tensor], embed: torch.Tensor,
           lm_head: torch.Tensor, folder: Path) -> DraftHead:
    try:
        head = DraftHead(config, embed, lm_head)
    except ValueError as e:
        raise ConfigError(f"bad head config in {folder}: {e}", option="speculative.model") from e
    own = head.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ConfigError(f"the head weights in {folder} do not match its config: missing "
                          f"{missing[:6]}, unexpected {extra[:6]}", option="speculative.model")
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        k = bad[0]
        raise ConfigError(f"head weight {k} in {folder} has shape {tuple(state[k].shape)}, expected "
                          f"{tuple(own[k].shape)}", option="speculative.model")
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return head


def read_eagle3(cfg: dict, weights: dict[str, torch.Tensor], target_config: Any
                ) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """(config, DraftHead state, embedding or None) of a public EAGLE-3 checkpoint."""
    from constrained_spec.kernels import d2t_from_offsets

    need = ["fc.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "norm.weight"]
    absent = [k for k in need if k not in weights]
    if absent:
        raise ConfigError(f"not an EAGLE-3 checkpoint: no {', '.join(absent)}", option="speculative.model")
    D = int(cfg.get("hidden_size", weights["norm.weight"].shape[0]))
    heads = int(cfg["num_attention_heads"])
    draft_vocab = int(weights["lm_head.weight"].shape[0])
    n = target_config.num_hidden_layers
    eagle_cfg = cfg.get("eagle_config") or {}
    layers = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)
    if weights["fc.weight"].shape[1] != len(layers) * D:
        raise ConfigError(f"EAGLE-3 fc takes {weights['fc.weight'].shape[1]} features, expected "
                          f"{len(layers)} layers x {D}", option="speculative.model")
    rope = cfg.get("rope_parameters") or {}
    config = HeadConfig(
        kind="eagle3", hidden_size=D, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or D // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        target_vocab_size=int(cfg.get("vocab_size", target_config.vocab_size)),
        draft_vocab_size=draft_vocab, feature_layers=tuple(int(i) for i in layers))
    state = {"fc.weight": weights["fc.weight"], "norm.weight": weights["norm.weight"],
             "lm_head.weight": weights["lm_head.weight"],
             "input_layernorm.weight": weights["midlayer.input_layernorm.weight"],
             "hidden_norm.weight": weights["midlayer.hidden_norm.weight"]}
    for src, dst in _BLOCK.items():
        if src == "input_layernorm.weight":
            continue
        if f"midlayer.{src}" not in weights:
            raise ConfigError(f"EAGLE-3 checkpoint has no midlayer.{src}", option="speculative.model")
        state[dst] = weights[f"midlayer.{src}"]
    if "d2t" in weights:
        state["d2t"] = d2t_from_offsets(weights["d2t"])
    elif draft_vocab == config.target_vocab_size:
        state["d2t"] = torch.arange(draft_vocab)
    else:
        raise ConfigError("EAGLE-3 checkpoint with a compressed vocabulary but no d2t",
                          option="speculative.model")
    return config, state, weights.get("embed_tokens.weight")


def find_mtp_layer(folder: Path, cfg: dict | None = None) -> int | None:
    """The index N of the MTP layer ``model.layers.{N}`` in a checkpoint folder, if any."""
    cfg = cfg if cfg is not None else _config(folder)
    n = cfg.get("num_hidden_layers")
    if n is None:
        return None
    key = f"model.layers.{n}.eh_proj.weight"
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return int(n) if key in json.loads(index.read_text()).get("weight_map", {}) else None
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if key in fh.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                return int(n)
    return None


def read_mtp(cfg: dict, weights: dict[str, torch.Tensor], layer: int, target_config: Any
             ) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """(config, DraftHead state, embedding or None, LM head or None) of the MTP layer
    ``model.layers.{layer}`` of a DeepSeek-V3-layout checkpoint."""
    p = f"model.layers.{layer}."
    if any(k.startswith((p + "self_attn.kv_a_proj", p + "mlp.experts")) for k in weights):
        raise ConfigError("this MTP layer uses MLA attention or MoE experts; only Llama-style "
                          "blocks (q/k/v/o, gate/up/down) are supported", option="speculative.model")
    names = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "eh_proj.weight": "eh_proj.weight", "shared_norm.weight": "shared_head.norm.weight"}
    names.update({dst: src for src, dst in _BLOCK.items()})
    absent = [p + src for src in names.values() if p + src not in weights]
    if absent:
        raise ConfigError(f"the MTP layer lacks {', '.join(absent)}", option="speculative.model")
    state = {dst: weights[p + src] for dst, src in names.items()}
    D = int(state["enorm.weight"].shape[0])
    heads = int(cfg.get("num_attention_heads", target_config.num_attention_heads))
    rope = cfg.get("rope_parameters") or {}
    vocab = int(cfg.get("vocab_size", target_config.vocab_size))
    config = HeadConfig(
        kind="mtp", hidden_size=D, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or D // heads),
        intermediate_size=int(state["gate_proj.weight"].shape[0]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        target_vocab_size=vocab, draft_vocab_size=vocab, feature_layers=(FINAL,))
    return config, state, weights.get(p + "embed_tokens.weight"), weights.get(p + "shared_head.head.weight")
