"""``python -m constrained_spec.training``: the one-command recipe, end to end on a tiny target.

A tiny random Llama saved as a checkpoint folder is the target; every stage runs on a handful of
prompts and a few optimizer steps, and what the command writes must load as the drafter its
message names.
"""

from __future__ import annotations

import json

import pytest
import torch
from cs_testlib import JSONSCHEMABENCH_SAMPLE, tiny_loaded_model

from constrained_spec.config import SpeculativeConfig
from constrained_spec.drafters import make_drafter
from constrained_spec.model.loading import load_model
from constrained_spec.training import data as data_mod
from constrained_spec.training.__main__ import main


@pytest.fixture(autouse=True)
def bench_sample(monkeypatch):
    """The command reads JSONSchemaBench from the library's default folder, outside the
    repository; here it reads the sample in the repository."""
    monkeypatch.setattr(data_mod, "BENCH_DIR", JSONSCHEMABENCH_SAMPLE)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    loaded = tiny_loaded_model(seed=7)
    folder = tmp_path_factory.mktemp("target")
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


def _run(kind, target_dir, work, *extra):
    args = [kind, "--model", str(target_dir), "--work", str(work), "--prompts", "3",
            "--task-prompts", "3", "--max-tokens", "12", "--steps", "2", "--minutes", "2",
            "--threads", "1", *extra]
    assert main(args) == 0


@pytest.mark.parametrize("kind", ["eagle3", "draft_model"])
def test_command_writes_a_drafter_that_loads(kind, target_dir, tmp_path):
    work = tmp_path / "work"
    extra = ("--draft-vocab", "64", "--draft-layers", "0")  # the tiny target has two layers
    _run(kind, target_dir, work, *extra)
    rows = [json.loads(line) for line in (work / "corpus.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and sum(r["id"].startswith("task-") for r in rows) == 3
    out = work / ("draft_model" if kind == "draft_model" else "eagle3-head")
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 2
    if kind == "eagle3":
        feats = [p for p in work.iterdir() if p.name.startswith("features-")]
        assert len(feats) == 1 and feats[0].name.endswith("-runner")
        meta = json.loads((feats[0] / "meta.json").read_text())
        assert meta["source"] == "runner" and meta["count"] == len(rows)
    target = load_model(str(target_dir), dtype="float32")
    drafter = make_drafter(SpeculativeConfig(method=kind, model=out), target)
    assert drafter is not None
    # a rerun resumes every stage: nothing is regenerated and training goes on from step 2
    _run(kind, target_dir, work, *extra, "--steps", "3")
    assert len((work / "corpus.jsonl").read_text().splitlines()) == 6
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 3


def test_bad_draft_layers_exit_with_a_usage_error(target_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["draft_model", "--model", str(target_dir), "--work", str(tmp_path / "w"),
              "--draft-layers", "0,x", "--prompts", "0", "--task-prompts", "0"])
    assert err.value.code == 2
    assert "--draft-layers" in capsys.readouterr().err
    # layers the target does not have: refused before any corpus is generated
    work = tmp_path / "w2"
    assert main(["draft_model", "--model", str(target_dir), "--work", str(work),
                 "--draft-layers", "0,5"]) == 2
    assert "layers" in capsys.readouterr().err and not (work / "corpus.jsonl").exists()
