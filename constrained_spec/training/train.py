"""Training an EAGLE-3 head or an MTP module on the target's own outputs (CPU is enough).

Data: `data.generate_corpus` (the target answering structured-output and free-chat prompts)
then `features.extract_features` (the target's hidden states at the layers the head reads and
its greedy next token at every position). The head learns to predict the TARGET's next token
(the one it wrote, under the grammar: what greedy verification accepts) from features one
position behind, unrolled
for ``ttt_steps`` draft steps exactly as drafting runs (`DraftHead.unrolled`: step j reads
its own step j-1 output, "training-time test"). Loss: cross-entropy on the positions of
generated tokens, step j weighted ``0.8 ** j``.

Resumable: ``train_state.pt`` in the output folder (head, optimizer, step, elapsed time) is
written every ``save_every`` steps and at the end; a rerun continues from it. The head itself
is written with `DraftHead.save` (config.json + model.safetensors) and loads with
``SpeculativeConfig(method=kind, model=folder)``.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from constrained_spec.drafters.heads import DraftHead, HeadConfig, HeadKind

STEP_DECAY = 0.8


def draft_vocabulary(target_next: Iterable[torch.Tensor], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` target tokens most often predicted in the data (sorted ids): EAGLE-3's
    compressed draft vocabulary. Ties and unseen tokens fill up by id."""
    counts: Counter[int] = Counter()
    for t in target_next:
        counts.update(t.reshape(-1).tolist())
    chosen = [tok for tok, _ in counts.most_common() if 0 <= tok < vocab_size][:size]
    if len(chosen) < size:
        have = set(chosen)
        chosen += [i for i in range(vocab_size) if i not in have][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def new_head(kind: HeadKind, target: Any, *, draft_vocab: torch.Tensor | None = None,
             feature_layers: tuple[int, ...] | None = None) -> DraftHead:
    """A head for ``target`` (a transformers Llama), initialised from it where that helps: the
    MTP block from the target's last decoder layer and its shared norm from the final norm, the
    EAGLE-3 LM head from the target's LM head rows of the draft vocabulary."""
    cfg = HeadConfig.for_target(target.config, kind, feature_layers=feature_layers,
                                draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    inner = target.model
    embed = inner.embed_tokens.weight.detach().float()
    lm_head = target.get_output_embeddings().weight.detach().float()
    head = DraftHead(cfg, embed, lm_head)
    last = inner.layers[-1]
    with torch.no_grad():
        if kind == "eagle3":
            assert draft_vocab is not None
            head.d2t.copy_(draft_vocab)
            head.lm_head.weight.copy_(lm_head[draft_vocab])
            head.norm.weight.copy_(inner.norm.weight.float())
        else:
            if draft_vocab is not None:  # drafts over the shared head's most frequent rows
                head.d2t.copy_(draft_vocab)
            D = cfg.hidden_size
            head.eh_proj.weight.zero_()
            head.eh_proj.weight[:, D:].copy_(torch.eye(D))  # start by passing h through
            head.shared_norm.weight.copy_(inner.norm.weight.float())
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(head, name).weight.copy_(getattr(last.self_attn, name).weight.float())
            head.input_layernorm.weight.copy_(last.input_layernorm.weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            src = getattr(last.mlp, name).weight.float()
            if getattr(head, name).weight.shape == src.shape:
                getattr(head, name).weight.copy_(src)
        head.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
    return head


def head_loss(head: DraftHead, batch: dict[str, torch.Tensor], steps: int,
              t2d: torch.Tensor | None, *, max_rows: int | None = None,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted cross-entropy over ``steps`` unrolled draft steps, and (correct, counted) per
    step. ``batch``: ``input_ids``, ``features``, ``target_next``, ``loss_mask``,
    ``attention_mask`` [B, T] (`features.collate`);
    ``t2d``: [V] draft id of each target id (-1 outside the draft vocabulary) or None.
    ``max_rows``: score at most this many random positions per step (the LM head over a full
    vocabulary dominates the cost otherwise)."""
    ids, feats = batch["input_ids"], batch["features"].float()
    B, T = ids.shape
    outs = head.unrolled(feats, ids, steps)
    # the entry at t predicts the target's choice after ids[t + 1]: the token the target
    # actually wrote next (under the grammar: what verification accepts) where there is one,
    # else its unconstrained greedy choice there
    label = torch.cat([batch["target_next"][:, 1:], batch["target_next"][:, -1:]], dim=1).long()
    lengths = batch["attention_mask"].sum(1)
    written = torch.cat([ids[:, 2:], ids.new_zeros(B, 2)], dim=1)
    has_next = torch.arange(T)[None, :] + 2 < lengths[:, None]
    label = torch.where(has_next, written, label)
    usable = torch.cat([batch["loss_mask"][:, 1:] & batch["attention_mask"][:, 1:],
                        torch.zeros(B, 1, dtype=torch.bool)], dim=1)
    if t2d is not None:
        label = t2d[label]
    total = feats.new_zeros(())
    stats = []
    weight_sum = 0.0
    for j, out in enumerate(outs):
        m = usable.clone()
        m[:, :j] = False
        if not bool(m.any()):
            stats.append((0, 0))
            continue
        rows, y = out[m], label[m]
        if max_rows is not None and rows.shape[0] > max_rows:
            pick = torch.randperm(rows.shape[0], generator=generator)[:max_rows]
            rows, y = rows[pick], y[pick]
        logits = head.logits(rows).float()
        inside = y >= 0
        n = int(y.shape[0])
        correct = int((logits.argmax(-1) == y).sum())  # outside the vocabulary: never right
        stats.append((correct, n))
        if bool(inside.any()):
            ce = F.cross_entropy(logits[inside], y[inside], reduction="sum") / n
            total = total + STEP_DECAY ** j * ce
        weight_sum += STEP_DECAY ** j
    return total / max(weight_sum, 1e-9), stats


def train_head(kind: HeadKind, target: Any, data_dir: Path, out: Path, *,
               draft_vocab_size: int = 6144, ttt_steps: int = 3, lr: float = 1e-3,
               batch_tokens: int = 4096, max_steps: int = 2000, max_minutes: float = 40.0,
               save_every: int = 50, seed: int = 0, progress: bool = True,
               threads: int | None = None, max_loss_rows: int | None = 1024) -> Path:
    """Train a ``kind`` head for ``target`` (a transformers Llama) on the features in
    ``data_dir``; writes the head to ``out`` and returns it. Stops after ``max_steps``
    optimizer steps or ``max_minutes`` of training (summed over resumed runs)."""
    from constrained_spec.training.features import FeatureDataset, batches

    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = FeatureDataset(data_dir)
    # the head reads the layers the features were extracted at
    want = tuple(int(i) for i in data.meta["layers"])
    n = target.config.num_hidden_layers
    if kind == "mtp" and _final(want, n) != (n,):
        raise ValueError(f"the features in {data_dir} are of layers {want}; an mtp head reads the "
                         "final hidden state only: extract them with layers (-1,)")
    state_path = out / "train_state.pt"
    resumed = torch.load(state_path, weights_only=True) if state_path.exists() else None
    torch.manual_seed(seed)
    draft_vocab = None
    V = int(target.config.vocab_size)
    if kind == "eagle3" or draft_vocab_size < V:  # an mtp head may draft over part of V too
        # the tokens the target writes (and would write next) in its answers
        draft_vocab = (resumed["d2t"] if resumed else draft_vocabulary(
            (torch.cat([s["input_ids"][s["loss_mask"]], s["target_next"][s["loss_mask"]]])
             for s in data), draft_vocab_size, V))
    head = new_head(kind, target, draft_vocab=draft_vocab, feature_layers=want)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, elapsed = 0, 0.0
    if resumed:
        head.load_state_dict(resumed["module"])
        opt.load_state_dict(resumed["opt"])
        step, elapsed = resumed["step"], resumed["elapsed"]
    t2d = None
    if draft_vocab is not None:
        t2d = torch.full((V,), -1, dtype=torch.long)
        t2d[head.d2t] = torch.arange(len(head.d2t))
    fit(head, params, opt,
        lambda batch, gen: head_loss(head, batch, ttt_steps, t2d, max_rows=max_loss_rows,
                                     generator=gen),
        lambda epoch: batches(data, batch_tokens, seed=seed + epoch),
        state_path=state_path, start=(step, elapsed),
        extra_state={"d2t": draft_vocab}, lr=lr,
        max_steps=max_steps, max_minutes=max_minutes, save_every=save_every, seed=seed,
        desc=f"train {kind}", progress=progress)
    head.eval()
    head.save(out)
    return out


def fit(module: torch.nn.Module, params: list[torch.nn.Parameter],
        opt: torch.optim.Optimizer,
        loss_fn: Callable[[dict[str, torch.Tensor], torch.Generator],
                          tuple[torch.Tensor, list[tuple[int, int]]]],
        epoch_batches: Callable[[int], Iterable[dict[str, torch.Tensor]]], *,
        state_path: Path, start: tuple[int, float], extra_state: dict[str, Any], lr: float,
        max_steps: int, max_minutes: float, save_every: int, seed: int, desc: str,
        progress: bool) -> None:
    """The training loop shared by the drafters: warm-up then a cosine learning rate that
    reaches its floor when the step or the time budget is spent (whichever first), gradient
    clipping at 1, a progress bar with the loss and the running top-1 accuracy per scored
    step, ``state_path`` (``module``'s state, the optimizer, the step, the elapsed time and
    ``extra_state``) written every ``save_every`` steps and at the end. ``start``: (step,
    elapsed seconds) of a resumed run; stops at ``max_steps`` or ``max_minutes`` in all.
    ``loss_fn(batch, generator)`` returns the loss and (correct, counted) per scored step;
    ``epoch_batches(epoch)`` the batches of one pass (reshuffled per epoch)."""
    from tqdm import tqdm

    step, elapsed = start
    warmup = min(50, max_steps // 10)

    def lr_at(s: int) -> float:
        if s < warmup:
            return lr * (s + 1) / warmup
        # the cosine follows whichever budget runs out first: steps or minutes
        frac = max((s - warmup) / max(1, max_steps - warmup), elapsed / max(max_minutes * 60, 1e-9))
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def save_state() -> None:
        torch.save({"module": module.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed, **extra_state}, state_path)

    bar = tqdm(total=max_steps, initial=step, desc=desc, file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    module.train()
    epoch = step  # reshuffle per pass, deterministic across resumes
    rows_gen = torch.Generator().manual_seed(seed + step)
    ema = None
    while step < max_steps and elapsed < max_minutes * 60:
        trained = 0
        for batch in epoch_batches(epoch):
            if step >= max_steps or elapsed >= max_minutes * 60:
                break
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, stats = loss_fn(batch, rows_gen)
            if not loss.requires_grad:
                # no scored position in this batch (every prompt filled max_len and was cut
                # before its output): nothing to learn from, and no gradient to step with
                elapsed += time.perf_counter() - t0
                continue
            trained += 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            elapsed += time.perf_counter() - t0
            acc = [c / n if n else 0.0 for c, n in stats]
            ema = acc if ema is None else [0.9 * e + 0.1 * a for e, a in zip(ema, acc)]
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc="/".join(f"{a:.2f}" for a in ema),
                            min=f"{elapsed / 60:.1f}")
            if step % save_every == 0:
                save_state()
        if not trained and step < max_steps and elapsed < max_minutes * 60:
            raise ValueError(f"{desc}: no batch of the corpus has an output position to learn "
                             "from (every prompt fills the training length); raise max_len or "
                             "use shorter prompts")
        epoch += 1
    bar.close()
    save_state()
    module.eval()


def _final(layers: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(n if i == -1 else i for i in layers)
