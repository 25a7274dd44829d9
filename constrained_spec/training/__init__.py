"""Training data and training for learned drafters (EAGLE-3 head, MTP module, draft model).

Three steps, each resumable, each writing files the next one reads:

    prompts = build_prompts(480, seed=0) + task_prompts(720, seed=0)   # the prompt mix
    generate_corpus(target, prompts, Path("corpus.jsonl"))              # the target's outputs
    extract_features(target, load_corpus(Path("corpus.jsonl")), [2, 15, 27], Path("feat"))
    for batch in batches(FeatureDataset(Path("feat")), 8192, seed=0): ...

``data`` builds JSONSchemaBench / free-chat prompts and the token-id corpus; ``synthetic``
writes task-style prompts (short requests over small schemas); ``features`` stores the target's
hidden states and greedy next tokens per position and serves them as padded batches; ``train``
trains the heads, ``distill`` the draft model. ``python -m constrained_spec.training`` runs it
all in one command.
"""

from constrained_spec.training.data import BENCH_DIR, FREE_CHAT, build_prompts, generate_corpus, load_corpus
from constrained_spec.training.features import FeatureDataset, batches, collate, extract_features
from constrained_spec.training.synthetic import task_prompts

__all__ = ["BENCH_DIR", "FREE_CHAT", "FeatureDataset", "batches", "build_prompts", "collate",
           "extract_features", "generate_corpus", "load_corpus", "task_prompts"]
