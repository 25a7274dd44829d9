"""The distilled draft model: cut from the target, trained on its outputs, loaded as a drafter.

A tiny three-layer Llama over a byte-level BPE is the target; the draft keeps two of its
layers. The draft must reproduce the target when it keeps every layer, learn the target's
choices, resume, and load through ``SpeculativeConfig(method="draft_model", model=folder)``
into a drafter whose greedy output equals speculation off.
"""

from __future__ import annotations

import pytest
import torch
from cs_testlib import byte_level_bpe, greedy_outputs, tiny_llama

from constrained_spec.config import SpeculativeConfig
from constrained_spec.drafters import make_drafter
from constrained_spec.errors import ConfigError
from constrained_spec.model.loading import load_model
from constrained_spec.model.runner import LeanRunner
from constrained_spec.training.distill import (
    draft_model_loss,
    new_draft_model,
    token_batches,
    train_draft_model,
)


@pytest.fixture(scope="module")
def target():
    tok = byte_level_bpe()
    model = tiny_llama(vocab_size=len(tok) + 2, seed=5, layers=3, max_positions=1024)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = cfg.eos_token_id = tok.eos_token_id
    return load_model((model, tok))


@pytest.fixture(scope="module")
def corpus(target):
    """The target's own greedy continuations of random prompts."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        prompt = torch.randint(1, len(target.tokenizer), (5 + i % 4,), generator=g).tolist()
        with torch.no_grad():
            out = target.model.generate(torch.tensor([prompt]), max_new_tokens=20,
                                        do_sample=False, pad_token_id=0)
        rows.append({"id": f"r{i}", "prompt_ids": prompt, "output_ids": out[0, len(prompt):].tolist()})
    return rows


def _loss_and_acc(draft, corpus):
    with torch.no_grad():
        batch = next(token_batches(corpus, 100_000, seed=None))
        loss, [(correct, n)] = draft_model_loss(draft, batch)
    return float(loss), correct / n


def test_keeping_every_layer_is_the_target(target):
    draft = new_draft_model(target.model, (0, 1, 2))
    ids = torch.tensor([[5, 9, 30, 41, 7]])
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, target.model(ids).logits.float())
    assert draft.config.num_hidden_layers == 3
    assert new_draft_model(target.model, (0, -1)).config.num_hidden_layers == 2


def test_batches_cover_the_corpus_with_answer_masks(corpus):
    seen = []
    for batch in token_batches(corpus, 64, seed=3):
        assert batch["input_ids"].numel() <= 64 or batch["input_ids"].shape[0] == 1
        for row, mask, attn in zip(batch["input_ids"], batch["loss_mask"], batch["attention_mask"]):
            n = int(attn.sum())
            match = [r for r in corpus if r["prompt_ids"] + r["output_ids"] == row[:n].tolist()]
            assert len(match) == 1
            p = len(match[0]["prompt_ids"])
            assert mask.tolist() == [p <= t < n for t in range(len(row))]
            seen.append(match[0]["id"])
    assert sorted(seen) == sorted(r["id"] for r in corpus)


def test_draft_learns_resumes_and_drafts_losslessly(target, corpus, tmp_path):
    torch.manual_seed(0)
    before = _loss_and_acc(new_draft_model(target.model, (0, -1)), corpus)
    out = tmp_path / "draft"
    kw = {"layers": (0, -1), "lr": 3e-3, "batch_tokens": 100_000, "max_minutes": 5,
          "save_every": 10, "progress": False, "tokenizer": target.tokenizer}
    train_draft_model(target.model, corpus, out, max_steps=30, **kw)
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 30
    train_draft_model(target.model, corpus, out, max_steps=60, **kw)  # resumes at 30
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 60
    with pytest.raises(ConfigError) as err:  # another layer set is not a resume
        train_draft_model(target.model, corpus, out, max_steps=70, **{**kw, "layers": (1, 2)})
    assert err.value.option == "layers"

    spec = SpeculativeConfig(method="draft_model", model=out, num_speculative_tokens=3)
    drafter = make_drafter(spec, target)
    from transformers import AutoModelForCausalLM

    after = _loss_and_acc(AutoModelForCausalLM.from_pretrained(out).float(), corpus)
    assert after[0] < 0.7 * before[0], (before, after)
    assert after[1] > before[1] + 0.2, (before, after)

    from constrained_spec.grammar import compile_spec
    from constrained_spec.schemas import normalize_schema

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    compiled = compile_spec(normalize_schema(schema), target.tokenizer_data)
    prompts = [r["prompt_ids"] for r in corpus[:3]]

    def runner():
        return LeanRunner(target.model, dtype=torch.float32, device=torch.device("cpu"))

    assert greedy_outputs(runner(), compiled, prompts, spec, drafter) == \
        greedy_outputs(runner(), compiled, prompts)


def test_bad_draft_layers_are_config_errors(target, corpus, tmp_path):
    for layers in ((), (0, 0), (2, 1), (0, 3), (True,)):
        with pytest.raises(ConfigError) as err:
            train_draft_model(target.model, corpus, tmp_path / "d", layers=layers, max_steps=1,
                              progress=False)
        assert err.value.option == "layers"
    with pytest.raises(ConfigError) as err:
        train_draft_model(target.model, [], tmp_path / "d", max_steps=1, progress=False)
    assert err.value.option == "corpus"
