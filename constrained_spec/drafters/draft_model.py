"""The draft-model drafter: a smaller causal LM sharing the target's tokenizer drafts k tokens.

The draft model runs on its own runner (its own KV cache, one slot per request). The cache is
kept in step with the request by prefix, not by bookkeeping of what was accepted: a request's
state remembers the tokens its slot holds; each proposal truncates the slot to the longest
common prefix of those and the request's context (prompt + output + the drafts already in
this step's proposal, e.g. forced tokens) and feeds the rest (the accepted drafts and the new
pending token, at the least) in one batched forward for all requests. Rejected drafts need no
rollback: the next common prefix drops them. Then up to k positions are drafted, one batched
draft forward per position, each masked by the request's grammar cursor (the fork after the
drafts before it) and processed exactly like the target's row there (`DraftState.draft_logits`):
greedy requests draft its argmax (a point mass, q = None), sampling requests draw from it with
their own generator and record that row as q, so rejection sampling stays exact.

Resumable: after forced tokens the next round catches up on them like on any other tokens. A
round only runs when the proposal grew since this drafter last extended it (forced tokens in
between), so the model drafts at most k tokens in a row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from constrained_spec.drafters.base import Drafter, DrafterSeq, DraftState, fit_width, length_groups, seq_to_extend
from constrained_spec.errors import ConfigError, ModelLoadError
from constrained_spec.model.protocols import Runner


@dataclass(eq=False)
class DraftSeq(DrafterSeq):
    """A request's memory in the draft model: its cache slot and the tokens that slot holds."""

    tokens: list[int] = field(default_factory=list)


class DraftModelDrafter(Drafter):
    """Drafts with a smaller causal LM of the same vocabulary (``method="draft_model"``).

    Parameters
    ----------
    runner:
        A `protocols.Runner` over the draft model (``runner.make_runner``), owned by this
        drafter: one slot per request.
    vocab_size:
        The TARGET's logits width: draft logits are cut or padded (-inf) to it, so masks and q
        rows line up with the target's (the two may differ by padding beyond the tokenizer).
    """

    name = "draft_model"
    resumable = True

    def __init__(self, runner: Runner, *, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = int(vocab_size)

    # -- per-request memory -----------------------------------------------------------------
    def release(self, drafter_state: Any) -> None:
        """Free a finished request's draft cache slot (the engine calls this when it reaps)."""
        seq = drafter_state
        if isinstance(seq, DraftSeq) and seq.slot >= 0:
            self.runner.free_slot(seq.slot)
            seq.slot, seq.tokens, seq.last_state = -1, [], None

    # -- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, states: Sequence[DraftState], k: int) -> None:
        # 1. catch up: each draft cache holds the request's context (+ this step's drafts) up to
        #    the token before last; the last token's logits give draft position 0
        todo: list[tuple[DraftState, DraftSeq, list[int]]] = []
        for st in states:
            seq = seq_to_extend(st, DraftSeq, self.runner.new_slot)
            if seq is None:
                continue
            full = st.context + st.tokens
            if st.cursor.exhausted or len(full) + k > self.runner.max_context:
                continue
            n = 0
            limit = min(len(seq.tokens), len(full) - 1)  # feed at least the last token
            while n < limit and seq.tokens[n] == full[n]:
                n += 1
            # (the runner's length too: a runner that fails mid-batch may have advanced a slot)
            n = min(n, self.runner.length(seq.slot))
            self.runner.truncate(seq.slot, n)
            del seq.tokens[n:]
            todo.append((st, seq, full[n:]))
        if not todo:
            return
        rows: list[torch.Tensor] = [None] * len(todo)  # type: ignore[list-item]
        for chunk in length_groups([len(fed) for _, _, fed in todo]):
            out = self.runner.forward([todo[i][1].slot for i in chunk], [todo[i][2] for i in chunk],
                                      [1] * len(chunk))  # [len(chunk), V_draft]
            for j, i in enumerate(chunk):
                todo[i][1].tokens.extend(todo[i][2])
                rows[i] = out[j]
        # 2. draft: one token per request per position, one batched draft forward per position
        live = [(st, seq, row) for (st, seq, _), row in zip(todo, rows)]
        for pos in range(k):
            fed: list[tuple[DraftState, DraftSeq, int]] = []
            for st, seq, row in live:
                tok, q = self._choose(st, row)
                if tok is not None and st.push(tok, q) and pos + 1 < k and not st.cursor.exhausted:
                    fed.append((st, seq, tok))
            if not fed:
                break
            out = self.runner.forward([seq.slot for _, seq, _ in fed], [[t] for _, _, t in fed],
                                      [1] * len(fed))
            for _, seq, tok in fed:
                seq.tokens.append(tok)
            live = [(st, seq, out[j]) for j, (st, seq, _) in enumerate(fed)]
        for st, seq, _ in todo:
            seq.last_state, seq.last_len = st, len(st.tokens)

    def _choose(self, st: DraftState, logits: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
        """The draft for ``st``'s next position and its q (None = point mass), or None when the
        grammar (or the draft vocabulary) leaves nothing to draft there."""
        return st.choose(fit_width(logits, self.vocab_size))


# -- construction from SpeculativeConfig(method="draft_model", model=...) ----------------------
def load_draft_model(model: Any, target: Any) -> DraftModelDrafter:
    """A :class:`DraftModelDrafter` for ``model`` (a checkpoint folder, a ``.gguf`` file, a
    ``(transformers_model, tokenizer)`` pair or a ``LoadedModel``) drafting for ``target`` (the
    target's ``LoadedModel``). Raises ConfigError when there is no draft model, its path does
    not exist or its tokenizer is not the target's; ModelLoadError when it cannot be loaded."""
    from constrained_spec.model.loading import load_model
    from constrained_spec.model.runner import make_runner

    if model is None:
        raise ConfigError("method 'draft_model' needs a draft model: a checkpoint folder, a .gguf "
                          "file or a (model, tokenizer) pair sharing the target's tokenizer",
                          option="speculative.model")
    options: dict[str, Any] = {}
    if isinstance(model, (str, os.PathLike)):
        if not Path(model).expanduser().exists():
            raise ConfigError(f"draft model {str(model)!r} is not a local path: give a checkpoint "
                              "folder or a .gguf file (nothing is downloaded from a hub)",
                              option="speculative.model")
        dtype = str(target.dtype).removeprefix("torch.")  # the target's, on the target's device
        options = {"device": target.device,
                   "dtype": dtype if dtype in ("float32", "bfloat16", "float16") else "auto"}
    try:
        draft = load_model(model, **options)
    except ModelLoadError as e:
        raise ModelLoadError(f"could not load the draft model (speculative.model): {e}") from e
    check_same_tokenizer(target.tokenizer, draft.tokenizer, draft.name)
    runner = make_runner(draft.model, dtype=draft.dtype, device=draft.device,
                         groups=getattr(draft, "weight_groups", None))
    from constrained_spec.drafters.feature import quantized_drafters

    if hasattr(runner, "quantize_for_drafting") and quantized_drafters():
        runner.quantize_for_drafting()  # CPU bf16: its linears and LM head on the int8 kernel
    return DraftModelDrafter(runner, vocab_size=target.vocab_size)


def check_same_tokenizer(target_tok: Any, draft_tok: Any, draft_name: str = "") -> None:
    """Raise ConfigError naming the first token id where the two vocabularies differ.

    Same tokenizer = the same token -> id map (added and special tokens included). The models'
    logits widths may still differ: ids beyond the tokenizer are padding."""
    if target_tok is draft_tok:
        return
    try:
        a, b = dict(target_tok.get_vocab()), dict(draft_tok.get_vocab())
    except Exception as e:  # not a transformers tokenizer: nothing to compare
        raise ConfigError(f"cannot compare the draft model's tokenizer with the target's "
                          f"({type(e).__name__}: {e})", option="speculative.model") from e
    if a == b:
        return
    ia, ib = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
    first = next(i for i in sorted(set(ia) | set(ib)) if ia.get(i) != ib.get(i))
    name = f" {draft_name!r}" if draft_name else ""
    raise ConfigError(
        f"the draft model{name} does not share the target's tokenizer: token id {first} is "
        f"{ia.get(first)!r} for the target and {ib.get(first)!r} for the draft model "
        f"({len(a)} vs {len(b)} tokens); method 'draft_model' needs a model with the target's "
        "tokenizer (e.g. a smaller model of the same family)", option="speculative.model")
