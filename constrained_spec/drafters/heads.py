"""Learned draft heads that read the target's hidden states: EAGLE-3 and MTP.

Both are ONE decoder layer (attention + MLP, Llama style, its own rotary positions) over a
pair: a hidden state h (the target's at the first draft step, the head's own output after)
and the embedding e of the token that follows it. The layer's output hidden predicts the next
token and is fed back with that token's embedding for the next draft step.

- ``eagle3`` (EAGLE-3): the target's features are the hidden states of a low, a middle and a
  high layer, concatenated and fused by ``fc`` (3D -> D). The layer's attention input is
  ``[input_layernorm(e) ; hidden_norm(h)]`` (2D wide; the residual is h). Its own LM head
  (``norm`` + ``lm_head``) predicts over a compressed draft vocabulary: ``d2t[i]`` is the
  target id of draft id i.
- ``mtp`` (DeepSeek-V3 multi-token prediction): h is the target's final (normed) hidden
  state; ``eh_proj([enorm(e) ; hnorm(h)])`` (2D -> D) enters a standard decoder layer; the
  logits are the TARGET's LM head over ``shared_norm`` of the output (the shared head). A
  trained module may restrict that head to the rows of a frequent-token draft vocabulary
  (``d2t``, as FR-Spec prunes a drafter's LM head): drafting then costs a fraction of the
  full head, and tokens outside it are simply never drafted.

The token embedding (and for mtp the LM head) are the target's, shared, not part of the head.

Positions. An entry at position p of the head's attention holds the pair (hidden at p, token
at p + 1); its output predicts the token at p + 2. Entries made from the target's features
("true" entries) are kept in the head's cache; entries made while drafting attend to the true
entries up to their anchor (the last true position) and to the draft entries after it. Training
reproduces exactly this ("training-time test", `DraftHead.unrolled`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from constrained_spec.model.runner import FEW_ROWS, linear
from constrained_spec.model.weights import int8_pack

HeadKind = Literal["eagle3", "mtp"]
FINAL = -1  # feature layer id: the target's final normed hidden state (the LM head's input)


@dataclass(frozen=True)
class HeadConfig:
    """Shape of a draft head; ``feature_layers`` are the target hidden states it reads, in
    transformers' ``hidden_states`` numbering (0 = embeddings, i = output of decoder layer i-1;
    the last, n or ``FINAL`` = -1, is after the final norm)."""

    kind: HeadKind
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...] = field(default=(FINAL,))

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.kind not in ("eagle3", "mtp"):
            raise ValueError(f"unknown head kind {self.kind!r}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1.."
                             f"{self.target_vocab_size} (the target's vocabulary)")

    @classmethod
    def for_target(cls, target_config: Any, kind: HeadKind, *, draft_vocab_size: int | None = None,
                   feature_layers: tuple[int, ...] | None = None,
                   intermediate_size: int | None = None) -> HeadConfig:
        """A head shaped like one layer of ``target_config`` (a transformers Llama config)."""
        c = target_config
        n = c.num_hidden_layers
        heads = c.num_attention_heads
        if feature_layers is None:
            # EAGLE-3's choice: the inputs of layers 2, n // 2 and n - 3
            feature_layers = (min(2, n), n // 2, max(n - 3, 0)) if kind == "eagle3" else (FINAL,)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        vocab = int(c.vocab_size)
        return cls(kind=kind, hidden_size=c.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   intermediate_size=intermediate_size or c.intermediate_size,
                   rms_norm_eps=float(c.rms_norm_eps), rope_theta=float(theta),
                   target_vocab_size=vocab,
                   draft_vocab_size=int(draft_vocab_size or vocab),
                   feature_layers=tuple(feature_layers))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadConfig:
        fields: dict[str, Any] = {k: (tuple(v) if k == "feature_layers" else v)
                                  for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**fields)


class QuantLinear(nn.Module):
    """A bias-free linear layer that runs forwards of few rows on torch's CPU int8 weight-only
    kernel (`weights.int8_pack`: per-row scales, a re-quantization; bf16 activations) and
    longer ones (a new request's catch-up) on the dense weight, like the target runner. For
    drafting only: a draft head's outputs need not be exact (verification decides), and a
    1-row step runs several times faster than the dense bf16 product on the CPU
    (benchmarks/RESULTS.md, "Speculation on the benchmark tasks": why int8)."""

    def __init__(self, linear: nn.Linear, packed: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.dense = linear
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] > FEW_ROWS:
            return self.dense(x)
        return linear(x.to(torch.bfloat16), self.packed)


def quantize_for_drafting(head: DraftHead) -> DraftHead:
    """``head`` (bf16, CPU) with its linear layers, and an mtp head's shared LM head rows, on
    the int8 weight-only kernel for few-row forwards (in place)."""
    for name, child in list(head.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            packed = int8_pack(child.weight)
            if packed is not None:
                setattr(head, name, QuantLinear(child, packed))
    if head.config.kind == "mtp":
        head.target_head_packed = int8_pack(head.shared_rows())
    return head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: normalise in fp32, scale in the model dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer ``positions`` (plain RoPE, halves rotated)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                        dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DraftHead(nn.Module):
    """An EAGLE-3 or MTP head (see the module docstring); parameter names follow the public
    checkpoints' (EAGLE-3: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``; MTP: ``enorm``,
    ``hnorm``, ``eh_proj``, the block, ``shared_head.norm``)."""

    # buffers, registered in __init__ (d2t: eagle3 and pruned mtp heads; target_head: mtp)
    embed: torch.Tensor
    target_head: torch.Tensor
    d2t: torch.Tensor
    # set by quantize_for_drafting on mtp heads only, hence read with getattr
    target_head_packed: tuple[torch.Tensor, torch.Tensor] | None

    def __init__(self, config: HeadConfig, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        super().__init__()
        c = self.config = config
        D, hd = c.hidden_size, c.head_dim
        eagle = c.kind == "eagle3"
        # shared with the target (not trained, not saved)
        self.register_buffer("embed", embed.detach(), persistent=False)
        if not eagle:
            if lm_head is None:
                raise ValueError("an mtp head needs the target's LM head (shared head)")
            self.register_buffer("target_head", lm_head.detach(), persistent=False)
        attn_in = 2 * D if eagle else D
        if eagle:
            nfeat = len(c.feature_layers)
            self.fc = nn.Linear(nfeat * D, D, bias=False) if nfeat > 1 else None
            self.input_layernorm = RMSNorm(D, c.rms_norm_eps)  # on the token embedding
            self.hidden_norm = RMSNorm(D, c.rms_norm_eps)
            self.norm = RMSNorm(D, c.rms_norm_eps)
            self.lm_head = nn.Linear(D, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.arange(c.draft_vocab_size), persistent=True)
        else:
            self.enorm = RMSNorm(D, c.rms_norm_eps)
            self.hnorm = RMSNorm(D, c.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * D, D, bias=False)
            self.input_layernorm = RMSNorm(D, c.rms_norm_eps)
            self.shared_norm = RMSNorm(D, c.rms_norm_eps)
            if self.pruned:  # the shared head's rows drafted from (target ids)
                self.register_buffer("d2t", torch.arange(c.draft_vocab_size), persistent=True)
        self.q_proj = nn.Linear(attn_in, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(attn_in, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(attn_in, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, D, bias=False)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.gate_proj = nn.Linear(D, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(D, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, D, bias=False)

    @property
    def pruned(self) -> bool:
        """An mtp head that drafts over part of the shared head's rows (``d2t``)."""
        c = self.config
        return c.kind == "mtp" and c.draft_vocab_size < c.target_vocab_size

    def shared_rows(self) -> torch.Tensor:
        """The shared LM head rows an mtp head drafts over [Vd, D]."""
        return self.target_head.index_select(0, self.d2t) if self.pruned else self.target_head

    # -- pieces --------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] -> the head's hidden input [..., D]."""
        if self.config.kind == "eagle3" and self.fc is not None:
            return self.fc(features)
        return features

    def project(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., H, hd], k, v [..., KV, hd] (rotated) and the residual [..., D] for entries
        (hidden, token) at ``positions``."""
        c = self.config
        e = F.embedding(tokens, self.embed).to(hidden.dtype)
        if c.kind == "eagle3":
            x = torch.cat([self.input_layernorm(e), self.hidden_norm(hidden)], dim=-1)
            residual = hidden
        else:
            residual = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
            x = self.input_layernorm(residual)
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(*lead, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(*lead, c.num_kv_heads, c.head_dim)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, q.dtype)
        cos, sin = cos[..., None, :], sin[..., None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [..., H * hd] + residual -> the entry's output hidden [..., D]."""
        x = residual + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] of output hiddens (Vd = V for mtp)."""
        if self.config.kind == "eagle3":
            return self.lm_head(self.norm(hidden))
        h = self.shared_norm(hidden)
        packed = getattr(self, "target_head_packed", None)
        if packed is not None and h.numel() // h.shape[-1] <= FEW_ROWS:
            return linear(h.to(torch.bfloat16), packed)
        return F.linear(h, self.shared_rows().to(hidden.dtype))

    def target_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        if self.config.kind == "eagle3" or self.pruned:
            return self.d2t
        return torch.arange(self.config.target_vocab_size, device=self.embed.device)

    # -- training: all positions, unrolled draft steps -----------------------------------
    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Output hiddens of ``steps`` unrolled draft steps over whole sequences.

        ``features`` [B, T, F] are the target's features at every position, ``tokens`` [B, T]
        the sequence. Step 0's entry at position t is (fuse(features[t]), tokens[t + 1]) and
        predicts the token after ``tokens[t + 1]``; step j's entry at t is (step j-1's output
        at t - 1, tokens[t + 1]): the j-th draft of a proposal anchored at t - j. It attends
        to step 0's entries up to t - j and to steps 1..j's entries at t - j + 1 .. t, the
        inference cache's content at that point. Returns [B, T, D] per step; position t of
        step j is meaningful for t >= j and t + 1 < T.
        """
        c = self.config
        B, T = tokens.shape
        dev = tokens.device
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # tokens[t + 1] (last: dummy)
        pos = torch.arange(T, device=dev).expand(B, T)
        group = c.num_heads // c.num_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        hidden = self.fuse(features)
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for j in range(steps):
            if j:
                hidden = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            q, k, v, residual = self.project(hidden, nxt, pos)
            q = q.transpose(1, 2)  # [B, H, T, hd]
            keys.append(k.transpose(1, 2).repeat_interleave(group, dim=1))
            vals.append(v.transpose(1, 2).repeat_interleave(group, dim=1))
            # step 0's entries up to the anchor t - j
            s0 = torch.matmul(q, keys[0].transpose(-1, -2)) * scale  # [B, H, T, T]
            allowed = torch.arange(T, device=dev)[None, :] <= (torch.arange(T, device=dev)[:, None] - j)
            if j:
                allowed[:j, 0] = True  # queries before any anchor: attend to something (unused)
            s0 = s0.masked_fill(~allowed, float("-inf"))
            diag, dvals = [], []
            for i in range(1, j + 1):  # step i's entry at t - (j - i)
                shift = j - i
                ki = F.pad(keys[i], (0, 0, shift, 0))[:, :, :T]
                vi = F.pad(vals[i], (0, 0, shift, 0))[:, :, :T]
                diag.append((q * ki).sum(-1, keepdim=True) * scale)
                dvals.append(vi)
            scores = torch.cat([s0] + diag, dim=-1).float().softmax(-1).to(q.dtype)
            attn = torch.matmul(scores[..., :T], vals[0])
            for i, vi in enumerate(dvals):
                attn = attn + scores[..., T + i: T + i + 1] * vi
            attn = attn.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim)
            outs.append(self.finish(attn, residual))
        return outs

    # -- files ---------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """``config.json`` (the HeadConfig) + ``model.safetensors`` (trained weights only)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(
            {"constrained_spec_head": asdict(self.config)}, indent=2))
        state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        return out
