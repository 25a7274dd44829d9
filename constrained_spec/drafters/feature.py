"""Drafters that read the target's hidden states: EAGLE-3 and MTP heads (`heads.DraftHead`).

The target's runner keeps, per slot and position, the hidden states the head reads
(``runner.enable_features``). For each request the drafter keeps the head's own attention
cache (one layer, a slot per request) holding the "true" entries: (target features at p, token
at p + 1) for every position the target has verified. A proposal:

1. catches up: new true entries for the positions verified since the last step (all requests
   in one padded forward; a new request's whole prompt the first time);
2. chains through the tokens already in the proposal (forced tokens pushed before this
   drafter), one batched head step per position, feeding back the head's own output;
3. drafts k tokens the same way. Each draft row is masked by the request's grammar cursor (the
   fork after the drafts before it): greedy requests take the argmax over the draft vocabulary
   masked straight from the target bitmask (`kernels.apply_target_bitmask_to_draft_logits`),
   sampling requests draw from the row processed exactly like the target's
   (`DraftState.draft_logits`) and record it as q.

Draft entries are never kept: the next proposal starts again from the true entries, so
rejected drafts need no rollback. One round per step by default (`FeatureDrafter.resumable`);
when resumable, a later round of the same step chains through the forced tokens pushed after
the drafts and drafts again (at most k model drafts in a row).

On the CPU in bfloat16 the head's linear layers run on the int8 weight-only kernel for few-row
forwards (`heads.quantize_for_drafting`: several times faster per draft step than the dense
bf16 product; drafts need not be exact).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from constrained_spec.drafters.base import Drafter, DrafterSeq, DraftState, fit_width, length_groups, seq_to_extend
from constrained_spec.drafters.heads import DraftHead
from constrained_spec.model.protocols import FeatureSource, feature_source
from constrained_spec.model.slots import SlotAllocator
from constrained_spec.settings import settings


@dataclass(eq=False)
class HeadSeq(DrafterSeq):
    """A request's memory in the head: its cache slot, how many true entries it holds, and the
    output of the last one (what the first draft is predicted from)."""

    true_len: int = 0
    anchor_out: torch.Tensor | None = None


class _HeadCache(SlotAllocator):
    """The head layer's keys and values per slot and position (grown on demand). A slot's
    length is unused: `HeadSeq.true_len` says which of its entries are kept."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k = torch.zeros((0, 0, kv_heads, head_dim), dtype=dtype, device=device)  # [S, L, KV, hd]
        self.v = self.k.clone()

    def ensure(self, slots: int, length: int) -> None:
        grown = self.grown_capacity(slots, length)
        if grown is None:
            return
        S, L = self._cap_slots, self._cap_len
        for name in ("k", "v"):
            new = torch.zeros((*grown, *self.shape), dtype=self.dtype, device=self.device)
            new[:S, :L] = getattr(self, name)
            setattr(self, name, new)
        self._cap_slots, self._cap_len = grown


class FeatureDrafter(Drafter):
    """Drafts with a `DraftHead` over the target's hidden states (``method="eagle3"`` or
    ``"mtp"``).

    Parameters
    ----------
    head:
        The head, on the target's device and in its dtype, in eval mode.
    runner:
        The TARGET's runner, a `protocols.FeatureSource` (else a ConfigError); its features
        for ``head.config.feature_layers`` are enabled here.
    vocab_size:
        The target's logits width (q rows and masks are that wide).
    """

    # One model round per step: forced tokens first, then the head chains through them and
    # drafts k. (Alternating rounds, as the n-gram drafter does, cost ~40% more head steps
    # for ~2% more acceptance on the benchmark tasks.) Set True to alternate.
    resumable = False

    def __init__(self, head: DraftHead, runner: Any, *, vocab_size: int) -> None:
        self.head = head
        self.name = head.config.kind
        self.runner: FeatureSource = feature_source(runner)
        self.vocab_size = int(vocab_size)
        self.layers = tuple(head.config.feature_layers)
        self.runner.enable_features(self.layers)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        c = head.config
        self.cache = _HeadCache(c.num_kv_heads, c.head_dim, p.dtype, p.device)
        self.d2t = head.target_ids().to(self.device)
        self.identity_vocab = c.draft_vocab_size == self.vocab_size and c.kind == "mtp"
        # ablation switch (benchmarks): greedy drafts from the raw head, unmasked; a draft the
        # grammar forbids then ends the proposal there (outputs are unchanged either way)
        self.mask_drafts = True

    # -- per-request memory -----------------------------------------------------------------
    def release(self, drafter_state: Any) -> None:
        """Free a finished request's head cache slot (the engine calls this when it reaps)."""
        seq = drafter_state
        if isinstance(seq, HeadSeq) and seq.slot >= 0:
            self.cache.free_slot(seq.slot)
            seq.slot, seq.anchor_out, seq.last_state = -1, None, None

    # -- the head's layer over cached entries ---------------------------------------------
    def _step(self, slots: Sequence[int], hidden: torch.Tensor, tokens: torch.Tensor,
              starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """Entries (hidden [B, T, D], tokens [B, T]) at positions starts[b]..+lengths[b]-1 of
        each slot (rows past lengths[b] are padding): written to the cache, attending to the
        slot's entries up to their own position. Returns the output hiddens [B, T, D]."""
        head, c = self.head, self.head.config
        B, T = tokens.shape
        dev = self.device
        start_t = torch.tensor(list(starts), device=dev)
        pos = start_t[:, None] + torch.arange(T, device=dev)[None, :]
        self.cache.ensure(max(slots) + 1, int(pos.max()) + 1)
        q, k, v, residual = head.project(hidden, tokens, pos)
        slot_t = torch.tensor(list(slots), device=dev)
        write = (slot_t[:, None].expand(B, T), pos)
        self.cache.k.index_put_(write, k)
        self.cache.v.index_put_(write, v)
        Lk = int(pos.max()) + 1
        keys = self.cache.k.index_select(0, slot_t)[:, :Lk]
        vals = self.cache.v.index_select(0, slot_t)[:, :Lk]
        mask = (torch.arange(Lk, device=dev)[None, None, :] <= pos[:, :, None])[:, None]
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
            enable_gqa=c.num_kv_heads != c.num_heads, scale=1.0 / math.sqrt(c.head_dim))
        attn = attn.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim)
        return head.finish(attn, residual)

    # -- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, states: Sequence[DraftState], k: int) -> None:
        todo: list[tuple[DraftState, HeadSeq]] = []
        for st in states:
            seq = seq_to_extend(st, HeadSeq, self.cache.new_slot)
            if seq is None:
                continue
            if st.cursor.exhausted or st.slot < 0:
                continue
            if len(st.context) + len(st.tokens) + k > self.runner.max_context:
                continue
            todo.append((st, seq))
        if not todo:
            return
        self._catch_up(todo)
        # per request: the hidden the next prediction comes from and the position of its entry
        live: list[tuple[DraftState, HeadSeq]] = []
        cur: dict[int, tuple[torch.Tensor, int]] = {}
        for st, seq in todo:
            if seq.anchor_out is not None:
                live.append((st, seq))
                cur[id(st)] = (seq.anchor_out, seq.true_len)
        # chain through the tokens already in the proposal (forced), then draft k
        chains = {id(st): list(st.tokens) for st, _ in live}
        depth = 0
        while True:
            feed = [(st, seq) for st, seq in live if depth < len(chains[id(st)])]
            if not feed:
                break
            self._advance(feed, [chains[id(st)][depth] for st, _ in feed], cur)
            depth += 1
        drafting = live
        for i in range(k):
            if not drafting:
                break
            logits = self.head.logits(torch.stack([cur[id(st)][0] for st, _ in drafting])).float()
            fed, toks = [], []
            for b, (st, seq) in enumerate(drafting):
                tok, q = self._choose(st, logits[b])
                if tok is not None and st.push(tok, q) and i + 1 < k and not st.cursor.exhausted:
                    fed.append((st, seq))
                    toks.append(tok)
            if fed:
                self._advance(fed, toks, cur)
            drafting = fed
        for st, seq in todo:
            seq.last_state, seq.last_len = st, len(st.tokens)

    def _advance(self, feed: list[tuple[DraftState, HeadSeq]], tokens: list[int],
                 cur: dict[int, tuple[torch.Tensor, int]]) -> None:
        """One batched head step: for each fed request the entry (its current hidden, its
        token) at its next position; its output becomes the current hidden."""
        hidden = torch.stack([cur[id(st)][0] for st, _ in feed])[:, None]
        toks = torch.tensor(tokens, device=self.device)[:, None]
        starts = [cur[id(st)][1] for st, _ in feed]
        out = self._step([seq.slot for _, seq in feed], hidden, toks, starts, [1] * len(feed))
        for b, (st, _) in enumerate(feed):
            cur[id(st)] = (out[b, 0], starts[b] + 1)

    def _catch_up(self, todo: list[tuple[DraftState, HeadSeq]]) -> None:
        """True entries for every verified position not yet in the head's cache."""
        work = []
        for st, seq in todo:
            n = len(st.context)  # positions 0..n-2 are verified (the pending token is last)
            end = min(n - 1, self.runner.length(st.slot))
            if seq.true_len > end:  # (cannot happen in the engine: contexts only grow)
                seq.true_len, seq.anchor_out = end, None
            if end > seq.true_len:
                work.append((st, seq, seq.true_len, end))
            # else: nothing new; anchor_out is the last entry's (None before any: no drafts)
        for group in length_groups([e - s for _, _, s, e in work]):
            self._catch_up_batch([work[i] for i in group])

    def _catch_up_batch(self, work: list[tuple[DraftState, HeadSeq, int, int]]) -> None:
        T = max(e - s for _, _, s, e in work)
        B = len(work)
        D = self.head.config.hidden_size
        nfeat = len(self.layers) * D
        feats = torch.zeros((B, T, nfeat), dtype=self.dtype, device=self.device)
        toks = torch.zeros((B, T), dtype=torch.long, device=self.device)
        for b, (st, _, s, e) in enumerate(work):
            feats[b, : e - s] = self.runner.features(st.slot, s, e, self.layers).to(self.dtype)
            toks[b, : e - s] = torch.as_tensor(st.context[s + 1: e + 1], device=self.device)
        hidden = self.head.fuse(feats)
        out = self._step([seq.slot for _, seq, _, _ in work], hidden, toks,
                         [s for _, _, s, _ in work], [e - s for _, _, s, e in work])
        for b, (_, seq, s, e) in enumerate(work):
            seq.true_len = e
            seq.anchor_out = out[b, e - s - 1]

    def _choose(self, st: DraftState, draft_logits: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
        """The draft for ``st``'s next position and its q (None = point mass), or None when the
        grammar leaves nothing in the draft vocabulary there."""
        from constrained_spec.kernels import apply_target_bitmask_to_draft_logits

        if st.params.greedy and not st.params.guarded:
            x = draft_logits[None].clone()
            if st.cursor.constrained and self.mask_drafts:
                apply_target_bitmask_to_draft_logits(x, st.cursor.row()[None].to(x.device), self.d2t)
            if not bool(torch.isfinite(x).any()):
                return None, None
            return int(self.d2t[int(x.argmax())]), None
        return st.choose(self._to_target(draft_logits))

    def _to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        if self.identity_vocab:
            return fit_width(draft_logits, self.vocab_size)
        out = draft_logits.new_full((self.vocab_size,), float("-inf"))
        ok = self.d2t < self.vocab_size
        out[self.d2t[ok]] = draft_logits[ok]
        return out


# -- construction from SpeculativeConfig(method="eagle3" | "mtp", model=...) -------------------
HEADS_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent / "heads"
# the heads trained for the embedded default model (constrained_spec/heads/<name>/)
SHIPPED = {"eagle3": "eagle3-smollm2-135m", "mtp": "mtp-smollm2-135m"}


def shipped_head(method: str) -> Any:
    """The folder of the head shipped for the embedded model, or None when not shipped."""
    d = HEADS_DIR / SHIPPED[method]
    return d if (d / "config.json").exists() else None


def load_feature_drafter(method: str, source: Any, target: Any) -> FeatureDrafter:
    """A :class:`FeatureDrafter` for ``target`` (a ``LoadedModel``) from ``source``: a
    ``DraftHead``, a folder written by ``DraftHead.save`` or by the training command, a public
    EAGLE-3 checkpoint folder (``method="eagle3"``), a checkpoint whose MTP layer sits beside
    the main model (``method="mtp"``, DeepSeek-V3 layout), or None: the head shipped for the
    embedded default model (for mtp: the target's own MTP layer when its checkpoint has one).
    Raises ConfigError when there is none or it does not fit the target."""
    from pathlib import Path

    from constrained_spec.drafters.checkpoints import load_head
    from constrained_spec.errors import ConfigError

    # a runner that keeps no hidden states (HFRunner) is refused here, before anything below
    # reads its weights
    runner = feature_source(target.runner)
    if source is None:
        own = getattr(target, "path", None)
        if method == "mtp" and own is not None and _has_mtp_layer(Path(own)):
            source = Path(own)
        elif getattr(target, "is_default", False) and shipped_head(method) is not None:
            source = shipped_head(method)
        elif getattr(target, "is_default", False):
            raise ConfigError(f"no {method} head is shipped with this version; pass one as "
                              "speculative.model (see docs/speculative.md: training a drafter)",
                              option="speculative.model")
        else:
            raise ConfigError(f"method {method!r} needs a head trained for this target: pass its "
                              "folder as speculative.model (the shipped heads fit the embedded "
                              "default model only)", option="speculative.model")
    if isinstance(source, DraftHead):
        head = copy.deepcopy(source)  # cast below: the caller's head stays as it is
    else:
        if not Path(source).expanduser().is_dir():
            raise ConfigError(f"{method} head {str(source)!r} is not a local folder (nothing is "
                              "downloaded from a hub)", option="speculative.model")
        head = load_head(Path(source).expanduser(), method, target.model.config, runner.embed,
                         runner.lm_head)
    if head.config.kind != method:
        raise ConfigError(f"the head at {source!s} is an {head.config.kind} head, not {method}",
                          option="speculative.model")
    check_head_fits(head, target.model.config, target.vocab_size)
    head = head.to(device=runner.device, dtype=runner.dtype).eval()
    if runner.device.type == "cpu" and runner.dtype == torch.bfloat16 and quantized_drafters():
        from constrained_spec.drafters.heads import quantize_for_drafting

        head = quantize_for_drafting(head)
    return FeatureDrafter(head, runner, vocab_size=target.vocab_size)


def quantized_drafters() -> bool:
    """Draft heads and draft models run on the int8 weight-only kernel on CPU in bf16 unless
    ``CONSTRAINED_SPEC_INT4`` is off (which also keeps the target dense)."""
    return settings().int4


def check_head_fits(head: DraftHead, target_config: Any, vocab_size: int) -> None:
    from constrained_spec.errors import ConfigError

    c = head.config
    problems = []
    if c.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {c.hidden_size} vs the target's {target_config.hidden_size}")
    n = target_config.num_hidden_layers
    bad = [i for i in c.feature_layers if not (i == -1 or 0 <= i <= n)]
    if bad:
        problems.append(f"feature layers {bad} outside the target's 0..{n}")
    if int(head.target_ids().max()) >= vocab_size:
        problems.append(f"draft vocabulary maps to token id {int(head.target_ids().max())} beyond the "
                        f"target's {vocab_size} logits")
    if problems:
        raise ConfigError("the draft head does not fit the target model: " + "; ".join(problems),
                          option="speculative.model")


def _has_mtp_layer(folder: Any) -> bool:
    from constrained_spec.drafters.checkpoints import find_mtp_layer

    try:
        return find_mtp_layer(folder) is not None
    except Exception:  # noqa: BLE001 (an unreadable folder has no usable MTP layer)
        return False
