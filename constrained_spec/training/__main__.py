"""Train a draft head for a target model in one command (CPU is enough; every stage resumes).

    python -m constrained_spec.training eagle3 --work runs/drafters
    python -m constrained_spec.training mtp --work runs/drafters

Stages, each skipped or continued when its output already exists in ``--work``:

1. corpus: the target answers ``--prompts`` prompts (JSONSchemaBench schemas turned into
   instructions, plus free chat), greedy, with the library's defaults (``corpus.jsonl``;
   shared by both kinds);
2. features: the target's hidden states at the layers the head reads and its greedy next
   token at every position (``features-<layers>/``);
3. training: ``--minutes`` / ``--steps`` of the unrolled (training-time-test) objective, a
   progress bar with the loss and the per-step top-1 accuracy; the head is written to
   ``--out`` (default ``<work>/<kind>-head``). Use it with
   ``SpeculativeConfig(method=kind, model=<out>)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m constrained_spec.training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["eagle3", "mtp"])
    ap.add_argument("--model", default=None, help="target model (default: the embedded model)")
    ap.add_argument("--work", type=Path, default=Path("drafter-training"),
                    help="folder for the corpus, the features and the training state")
    ap.add_argument("--out", type=Path, default=None, help="where the head is written")
    ap.add_argument("--prompts", type=int, default=480, help="prompts in the corpus")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps at most")
    ap.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    ap.add_argument("--draft-vocab", type=int, default=6144, help="eagle3: draft vocabulary size")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)

    from constrained_spec.drafters.heads import HeadConfig
    from constrained_spec.models import load_model

    from .data import build_prompts, generate_corpus, load_corpus
    from .features import extract_features
    from .train import train_head

    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model)
    corpus_path = work / "corpus.jsonl"
    prompts = build_prompts(args.prompts, seed=args.seed)
    generate_corpus(target, prompts, corpus_path, max_tokens=args.max_tokens, seed=args.seed)
    corpus = load_corpus(corpus_path)
    layers = HeadConfig.for_target(target.model.config, args.kind).feature_layers
    feat_dir = work / ("features-" + "-".join(str(i) for i in layers))
    extract_features(target.model, corpus, layers, feat_dir)
    out = args.out or work / f"{args.kind}-head"
    train_head(args.kind, target.model, feat_dir, out, draft_vocab_size=args.draft_vocab,
               ttt_steps=args.ttt_steps, lr=args.lr, batch_tokens=args.batch_tokens,
               max_steps=args.steps, max_minutes=args.minutes, seed=args.seed)
    print(f"{args.kind} head written to {out}; use it with "
          f"SpeculativeConfig(method={args.kind!r}, model={str(out)!r})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
