"""Train a draft head for a target model in one command (CPU is enough; every stage resumes).

    python -m constrained_spec.training eagle3 --work runs/drafters
    python -m constrained_spec.training mtp --work runs/drafters
    python -m constrained_spec.training draft_model --work runs/drafters

Stages, each skipped or continued when its output already exists in ``--work``:

1. corpus: the target answers ``--prompts`` prompts (JSONSchemaBench schemas turned into
   instructions, plus free chat) and ``--task-prompts`` task-style requests (short extraction,
   creation, classification and function-call prompts over small schemas,
   `synthetic.task_prompts`), greedy, with the library's defaults (``corpus.jsonl``; shared by
   every kind);
2. features: the target's hidden states at the layers the head reads and its greedy next
   token at every position (``features-<layers>-<source>/``), by default through the library's
   runner as decoding computes them (the prompt in one prefill, the answer ``--chunk`` tokens
   at a time: on CPU bf16 the int4 kernel verification uses);
3. training: ``--minutes`` / ``--steps`` of the unrolled (training-time-test) objective, a
   progress bar with the loss and the per-step top-1 accuracy; the head is written to
   ``--out`` (default ``<work>/<kind>-head``). Use it with
   ``SpeculativeConfig(method=kind, model=<out>)``.

``draft_model`` skips the features: it distils a small causal LM -- the target cut to
``--draft-layers`` of its decoder layers -- on the corpus (``<work>/draft_model``, a
transformers folder with the tokenizer; ``SpeculativeConfig(method="draft_model",
model=<out>)``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m constrained_spec.training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["eagle3", "mtp", "draft_model"])
    ap.add_argument("--model", default=None, help="target model (default: the embedded model)")
    ap.add_argument("--work", type=Path, default=Path("drafter-training"),
                    help="folder for the corpus, the features and the training state")
    ap.add_argument("--out", type=Path, default=None, help="where the head is written")
    ap.add_argument("--prompts", type=int, default=480,
                    help="JSONSchemaBench and free-chat prompts in the corpus")
    ap.add_argument("--task-prompts", type=int, default=720,
                    help="task-style prompts in the corpus (short extraction, creation, "
                         "classification and function-call requests with small schemas)")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=20.0,
                    help="training time budget (the learning rate anneals over it)")
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps at most")
    ap.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training")
    ap.add_argument("--features-from", choices=["runner", "hf"], default="runner",
                    help="run the target through the library's runner (default: the features "
                         "decoding sees) or one dense transformers forward per batch")
    ap.add_argument("--chunk", type=int, default=4,
                    help="answer tokens per sequence per forward when extracting through the runner")
    ap.add_argument("--draft-vocab", type=int, default=6144,
                    help="draft vocabulary: the target's most frequent answer tokens (eagle3: its "
                         "own LM head; mtp: the rows of the shared LM head it drafts over, 0 = all)")
    ap.add_argument("--draft-layers", default="0,1,-1",
                    help="draft_model: the target's decoder layers it keeps (-1: the last)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default 1e-3 for heads, 3e-4 for draft_model)")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--loss-rows", type=int, default=1024,
                    help="answer positions scored per draft step and batch at most (the "
                         "full-vocabulary LM head of mtp and draft_model dominates the cost)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    try:
        keep = [int(x) for x in args.draft_layers.split(",")]
    except ValueError:
        ap.error(f"--draft-layers: comma-separated integers, got {args.draft_layers!r}")

    from constrained_spec.errors import ConstrainedSpecError

    try:
        return _run(args, keep)
    except ConstrainedSpecError as e:  # bad options or inputs: the message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, keep: list[int]) -> int:
    from constrained_spec.drafters.heads import HeadConfig
    from constrained_spec.model.loading import load_model
    from constrained_spec.training.data import build_prompts, generate_corpus, load_corpus
    from constrained_spec.training.distill import check_layers
    from constrained_spec.training.features import extract_features
    from constrained_spec.training.synthetic import task_prompts
    from constrained_spec.training.train import train_head

    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model, full_model=True)  # training reads the weights
    if args.kind == "draft_model":  # before the corpus: a wrong layer list fails in seconds
        check_layers(keep, int(target.model.config.num_hidden_layers))
    corpus_path = work / "corpus.jsonl"
    prompts = build_prompts(args.prompts, seed=args.seed) + task_prompts(args.task_prompts,
                                                                          seed=args.seed)
    generate_corpus(target, prompts, corpus_path, max_tokens=args.max_tokens, seed=args.seed)
    corpus = load_corpus(corpus_path)
    if args.kind == "draft_model":
        from constrained_spec.training.distill import train_draft_model

        out = args.out or work / "draft_model"
        train_draft_model(target.model, corpus, out, layers=keep, lr=args.lr or 3e-4,
                          batch_tokens=args.batch_tokens, max_steps=args.steps,
                          max_minutes=args.minutes, seed=args.seed, tokenizer=target.tokenizer,
                          max_loss_rows=args.loss_rows)
        print(f"draft model written to {out}; use it with SpeculativeConfig(method='draft_model', "
              f"model={str(out)!r})", file=sys.stderr)
        return 0
    layers = HeadConfig.for_target(target.model.config, args.kind).feature_layers
    feat_dir = work / ("features-" + "-".join(str(i) for i in layers) + f"-{args.features_from}")
    extract_features(target, corpus, layers, feat_dir, source=args.features_from, chunk=args.chunk)
    out = args.out or work / f"{args.kind}-head"
    vocab = int(target.model.config.vocab_size)
    train_head(args.kind, target.model, feat_dir, out,
               draft_vocab_size=min(args.draft_vocab or vocab, vocab),
               ttt_steps=args.ttt_steps, lr=args.lr or 1e-3, batch_tokens=args.batch_tokens,
               max_steps=args.steps, max_minutes=args.minutes, seed=args.seed,
               max_loss_rows=args.loss_rows)
    print(f"{args.kind} head written to {out}; use it with "
          f"SpeculativeConfig(method={args.kind!r}, model={str(out)!r})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
