"""Training learned drafters end to end on a tiny random Llama: corpus -> features -> head.

The head must learn (the loss on a fixed set of sequences falls and its top-1 accuracy on the
target's own choices rises), resume where it stopped, and load back through
``SpeculativeConfig(method=..., model=folder)`` into a drafter whose greedy output equals
speculation off.
"""

from __future__ import annotations

import pytest
import torch
from cs_testlib import CHARS, greedy_outputs, tiny_llama

from constrained_spec.config import SpeculativeConfig
from constrained_spec.drafters import make_drafter
from constrained_spec.drafters.heads import DraftHead
from constrained_spec.training import FeatureDataset, batches, extract_features
from constrained_spec.training.train import (
    draft_vocabulary,
    head_loss,
    new_head,
    train_head,
)

ID = {c: i for i, c in enumerate(CHARS)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def _corpus(n: int = 24, seed: int = 0) -> list[dict]:
    """Sequences the tiny target itself continues greedily (its own outputs, as in training)."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = torch.randint(1, len(CHARS), (6 + i % 5,), generator=g).tolist()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)
        rows.append({"id": f"r{i}", "prompt_ids": prompt, "output_ids": out[0, len(prompt):].tolist()})
    return rows


@pytest.fixture(scope="module")
def feature_dirs(target, tmp_path_factory):
    corpus = _corpus()
    root = tmp_path_factory.mktemp("features")
    n = target.config.num_hidden_layers
    return {"eagle3": extract_features(target, corpus, (0, 1, n), root / "eagle3", progress=False),
            "mtp": extract_features(target, corpus, (-1,), root / "mtp", progress=False)}


def _loss_and_acc(head, data, t2d):
    losses, correct, total = [], 0, 0
    with torch.no_grad():
        for batch in batches(data, 10_000, seed=None):
            loss, stats = head_loss(head, batch, 2, t2d)
            losses.append(float(loss))
            correct += stats[0][0]
            total += stats[0][1]
    return sum(losses) / len(losses), correct / total


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_head_learns_the_targets_choices(kind, target, feature_dirs):
    data = FeatureDataset(feature_dirs[kind])
    n = target.config.num_hidden_layers
    layers = (0, 1, n) if kind == "eagle3" else (-1,)
    vocab = draft_vocabulary((s["target_next"] for s in data), 40, target.config.vocab_size) \
        if kind == "eagle3" else None
    torch.manual_seed(0)
    head = new_head(kind, target, draft_vocab=vocab, feature_layers=layers)
    t2d = None
    if kind == "eagle3":
        t2d = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
        t2d[head.d2t] = torch.arange(len(head.d2t))
    before, acc_before = _loss_and_acc(head, data, t2d)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(60):
        for batch in batches(data, 10_000, seed=0):
            loss, _ = head_loss(head, batch, 2, t2d)
            opt.zero_grad()
            loss.backward()
            opt.step()
    after, acc_after = _loss_and_acc(head, data, t2d)
    assert after < 0.6 * before, (before, after)
    assert acc_after > max(0.5, acc_before + 0.2), (acc_before, acc_after)


@pytest.mark.parametrize("kind, draft_vocab", [("eagle3", 40), ("mtp", 40), ("mtp", 24)],
                         ids=["eagle3", "mtp", "mtp-pruned"])
def test_train_resume_and_load(kind, draft_vocab, target, feature_dirs, tmp_path, tiny_tok):
    out = tmp_path / f"{kind}-head"
    kw = {"draft_vocab_size": draft_vocab, "ttt_steps": 2, "lr": 3e-3, "batch_tokens": 4096,
          "max_minutes": 5, "save_every": 2, "progress": False}
    train_head(kind, target, feature_dirs[kind], out, max_steps=4, **kw)
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 4
    train_head(kind, target, feature_dirs[kind], out, max_steps=6, **kw)  # resumes at 4
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 6
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()

    class Loaded:  # what make_drafter needs of a LoadedModel
        def __init__(self):
            from constrained_spec.model.runner import LeanRunner

            self.model = target
            self.runner = LeanRunner(target, dtype=torch.float32, device=torch.device("cpu"))
            self.vocab_size = len(CHARS) + 2
            self.is_default = False
            self.path = None

    loaded = Loaded()
    spec = SpeculativeConfig(method=kind, model=out, num_speculative_tokens=3)
    drafter = make_drafter(spec, loaded)
    assert isinstance(drafter.head, DraftHead) and drafter.head.config.kind == kind
    assert drafter.head.config.draft_vocab_size == draft_vocab
    if draft_vocab < len(CHARS) + 2:  # the most frequent targets, as counted in training
        state = torch.load(out / "train_state.pt", weights_only=False)
        assert torch.equal(drafter.head.target_ids().cpu(), state["d2t"])
        assert not drafter.identity_vocab
    from constrained_spec.grammar import compile_spec
    from constrained_spec.schemas import normalize_schema

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    compiled = compile_spec(normalize_schema(schema), tiny_tok)
    prompts = [[ID[c] for c in "abcab"], [ID[c] for c in "ddd"]]

    from constrained_spec.model.runner import LeanRunner

    fresh = LeanRunner(target, dtype=torch.float32, device=torch.device("cpu"))
    assert greedy_outputs(drafter.runner, compiled, prompts, spec, drafter) == \
        greedy_outputs(fresh, compiled, prompts)
