"""A small draft model distilled from the target (``method="draft_model"``).

The draft model is the target cut down to a few of its decoder layers -- by default its first
two and its last, with its embeddings, final norm and LM head -- and trained on the target's
own corpus (`data.generate_corpus`) to predict the token the target wrote next (under the
grammar: what greedy verification accepts). Cutting layers keeps the tokenizer, the vocabulary
and the residual stream the kept layers were trained on, so training starts from a model that
already drafts something; only the kept decoder layers and the final norm are trained (the
embeddings, tied to the LM head in the embedded model, stay the target's).

    python -m constrained_spec.training draft_model --work runs/drafters

writes a transformers checkpoint folder (config, weights, tokenizer) usable as
``SpeculativeConfig(method="draft_model", model=<folder>)``. Resumable like the heads
(``train_state.pt`` in the output folder).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from constrained_spec.errors import ConfigError
from constrained_spec.training.features import group_by_tokens

#: The target's decoder layers the draft model keeps by default (-1: the last).
DEFAULT_LAYERS = (0, 1, -1)


def check_layers(layers: Sequence[int], n: int) -> list[int]:
    """``layers`` as indices into the target's ``n`` decoder layers (-1 is the last), checked:
    distinct and increasing; else ConfigError."""
    out = [n - 1 if i == -1 else i for i in layers]
    if not out or any(isinstance(i, bool) or not isinstance(i, int) for i in layers) or any(
            not 0 <= i < n for i in out) or len(set(out)) != len(out) or out != sorted(out):
        raise ConfigError(f"must be distinct increasing decoder layer indices in 0..{n - 1} (-1: "
                          f"the last), got {list(layers)!r}", option="layers")
    return out


def new_draft_model(target: Any, layers: Sequence[int] = DEFAULT_LAYERS) -> Any:
    """A float32 copy of ``target`` (a transformers Llama-family causal LM) that keeps only the
    decoder ``layers``, in order; embeddings, final norm and LM head are the target's."""
    n = int(target.config.num_hidden_layers)
    keep = check_layers(layers, n)
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(keep)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    draft = type(target)(cfg).float().eval()
    src, dst = target.model, draft.model
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight.float())
        dst.norm.weight.copy_(src.norm.weight.float())
        for j, i in enumerate(keep):
            dst.layers[j].load_state_dict({k: v.float() for k, v in src.layers[i].state_dict().items()})
        if not getattr(cfg, "tie_word_embeddings", False):
            draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight.float())
    return draft


def token_batches(corpus: Sequence[dict[str, Any]], batch_tokens: int, *, max_len: int = 1024,
                  seed: int | None = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches of corpus sequences (``prompt_ids + output_ids`` cut to
    ``max_len``), at most ``batch_tokens`` padded tokens each, sequences of similar length
    together, batches in a seeded order. Yields ``input_ids`` long [B, T], ``attention_mask`` and
    ``loss_mask`` (answer positions) bool [B, T]."""
    rng = random.Random(seed)
    seqs = [(list(r["prompt_ids"]) + list(r["output_ids"]))[:max_len] for r in corpus]
    tie = [rng.random() for _ in seqs]
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), tie[i]))
    groups = group_by_tokens([len(seqs[i]) for i in order], batch_tokens)
    rng.shuffle(groups)
    for group in groups:
        idx = [order[g] for g in group]
        T = max(len(seqs[i]) for i in idx)
        out = {"input_ids": torch.zeros((len(idx), T), dtype=torch.long),
               "attention_mask": torch.zeros((len(idx), T), dtype=torch.bool),
               "loss_mask": torch.zeros((len(idx), T), dtype=torch.bool)}
        for b, i in enumerate(idx):
            n, p = len(seqs[i]), len(corpus[i]["prompt_ids"])
            out["input_ids"][b, :n] = torch.tensor(seqs[i])
            out["attention_mask"][b, :n] = True
            out["loss_mask"][b, p:n] = True
        yield out


def draft_model_loss(draft: Any, batch: dict[str, torch.Tensor], *, max_rows: int | None = None,
                     generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Cross-entropy of the draft's prediction at t for the token written at t + 1, over answer
    tokens (``max_rows`` random ones at most: the full-vocabulary LM head dominates the cost),
    and [(correct, counted)]."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    hidden = draft.model(input_ids=ids, attention_mask=attn.long()).last_hidden_state
    scored = batch["loss_mask"][:, 1:]  # position t predicts ids[t + 1], an answer token
    rows, y = hidden[:, :-1][scored], ids[:, 1:][scored]
    if max_rows is not None and rows.shape[0] > max_rows:
        pick = torch.randperm(rows.shape[0], generator=generator)[:max_rows]
        rows, y = rows[pick], y[pick]
    if not rows.shape[0]:
        return hidden.sum() * 0.0, [(0, 0)]
    logits = draft.get_output_embeddings()(rows).float()
    return F.cross_entropy(logits, y), [(int((logits.argmax(-1) == y).sum()), int(y.shape[0]))]


def train_draft_model(target: Any, corpus: Sequence[dict[str, Any]], out: Path, *,
                      layers: Sequence[int] = DEFAULT_LAYERS, lr: float = 3e-4,
                      batch_tokens: int = 4096, max_steps: int = 1500, max_minutes: float = 40.0,
                      save_every: int = 50, seed: int = 0, progress: bool = True,
                      max_loss_rows: int | None = 1024, tokenizer: Any = None) -> Path:
    """Distil a draft model of ``target``'s ``layers`` on ``corpus`` and write it to ``out``
    (a transformers folder, with ``tokenizer`` when given). Stops after ``max_steps`` optimizer
    steps or ``max_minutes`` of training (summed over resumed runs); resumes from
    ``out/train_state.pt``."""
    from constrained_spec.training.train import fit

    if not corpus:
        raise ConfigError("the corpus is empty; run generate_corpus first", option="corpus")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "train_state.pt"
    resumed = torch.load(state_path, weights_only=True) if state_path.exists() else None
    keep = check_layers(layers, int(target.config.num_hidden_layers))
    if resumed and resumed.get("layers") != keep:
        raise ConfigError(f"{out} holds a draft model of layers {resumed.get('layers')}, this run "
                          f"asks for {keep}; use another output folder", option="layers")
    torch.manual_seed(seed)
    draft = new_draft_model(target, keep)
    # the embeddings (and a tied LM head) stay the target's
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = (0, 0.0)
    if resumed:
        draft.load_state_dict(resumed["module"])
        opt.load_state_dict(resumed["opt"])
        start = (resumed["step"], resumed["elapsed"])
    fit(draft, params, opt,
        lambda batch, gen: draft_model_loss(draft, batch, max_rows=max_loss_rows, generator=gen),
        lambda epoch: token_batches(corpus, batch_tokens, seed=seed + epoch),
        state_path=state_path, start=start, extra_state={"layers": keep}, lr=lr,
        max_steps=max_steps, max_minutes=max_minutes, save_every=save_every, seed=seed,
        desc="train draft_model", progress=progress)
    draft.to(next(target.parameters()).dtype).save_pretrained(out)  # in the target's dtype
    draft.float()
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
