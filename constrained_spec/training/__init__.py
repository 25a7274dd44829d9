"""Training data for learned drafters (EAGLE-3 head, MTP module), shared by both.

Three steps, each resumable, each writing files the next one reads:

    prompts = build_prompts(2000, seed=0)                       # schema prompts + free chat
    generate_corpus(target, prompts, Path("corpus.jsonl"))      # the target's own outputs
    extract_features(target.model, load_corpus(Path("corpus.jsonl")), [2, 15, 27], Path("feat"))
    for batch in batches(FeatureDataset(Path("feat")), 8192, seed=0): ...

``data`` builds prompts and the token-id corpus; ``features`` stores the target's hidden
states and greedy next tokens per position, and serves them as padded batches.
"""

from .data import BENCH_DIR, FREE_CHAT, build_prompts, generate_corpus, load_corpus
from .features import FeatureDataset, batches, collate, extract_features

__all__ = ["BENCH_DIR", "FREE_CHAT", "FeatureDataset", "batches", "build_prompts", "collate",
           "extract_features", "generate_corpus", "load_corpus"]
