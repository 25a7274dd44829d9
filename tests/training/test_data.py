"""Training data for learned drafters: prompts, the target's corpus, stored features, batches.

Everything runs on the tiny random Llama (byte-level BPE for generation, the character
vocabulary for features) and a small JSONSchemaBench-shaped folder written here, so each test
takes well under a second or two.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from cs_testlib import JSONSCHEMABENCH_SAMPLE

from constrained_spec import Generator
from constrained_spec.api import DEFAULT_LAYOUT
from constrained_spec.errors import ConfigError, IncompleteOutputError
from constrained_spec.frontend.prompts import encode_prompt
from constrained_spec.schemas import normalize_schema
from constrained_spec.training import (
    FREE_CHAT,
    FeatureDataset,
    batches,
    build_prompts,
    extract_features,
    generate_corpus,
    load_corpus,
)
from constrained_spec.training import data as data_mod
from constrained_spec.training import features as features_mod

SMALL_INT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SMALL_STR = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
REFUSED = {"type": "object", "properties": {"a": {"$ref": "https://example.com/schema.json"}}}


def _row(rid: str, schema: dict) -> dict:
    return {"id": rid, "description": "", "meta": {}, "tests": [], "schema": schema}


@pytest.fixture()
def bench_dir(tmp_path: Path) -> Path:
    """Two splits: twelve usable schemas, one the library refuses, one too large."""
    folder = tmp_path / "bench"
    folder.mkdir()
    usable = [_row(f"Split_a---thing_{i}", {"type": "object", "title": f"Thing {i}",
                                            "properties": {f"f{i}": {"type": "integer"}}})
              for i in range(8)]
    usable += [_row(f"Split_b---o{i}", {"description": f"A record of kind {i}. It has a name.",
                                        "type": "object",
                                        "properties": {"name": {"type": "string"}}})
               for i in range(4)]
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                            for i in range(100)}}
    rows_a = usable[:8] + [_row("Split_a---refused", REFUSED)]
    rows_b = usable[8:] + [_row("Split_b---too_big", big)]
    for name, rows in (("Split_a", rows_a), ("Split_b", rows_b)):
        with gzip.open(folder / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


# -------------------------------------------------------------------------------------------
# build_prompts
# -------------------------------------------------------------------------------------------
def test_build_prompts_deterministic_for_a_seed(bench_dir):
    a = build_prompts(16, seed=3, bench_dir=bench_dir)
    assert a == build_prompts(16, seed=3, bench_dir=bench_dir)
    assert a != build_prompts(16, seed=4, bench_dir=bench_dir)


def test_prompt_mix_has_both_kinds_with_schemas_attached(bench_dir):
    prompts = build_prompts(16, seed=0, bench_dir=bench_dir, free_share=0.25)
    assert len(prompts) == 16 and len({p["id"] for p in prompts}) == 16
    free = [p for p in prompts if p["schema"] is None]
    structured = [p for p in prompts if p["schema"] is not None]
    assert len(free) == 4 and len(structured) == 12
    kinds = [p["schema"] is None for p in prompts]
    assert kinds != sorted(kinds)  # interleaved, not free chat last
    assert all(p["prompt"] in FREE_CHAT for p in free)
    templates = set()
    for p in structured:
        assert isinstance(p["schema"], dict) and p["schema"]["type"] == "object"
        what = p["schema"].get("title") or p["schema"]["description"]
        assert what in p["prompt"]
        templates.add(p["prompt"].replace(what, "{what}"))
    assert len(templates) > 1  # the instructions vary


def test_refused_and_oversized_schemas_are_left_out(bench_dir):
    prompts = build_prompts(12, seed=0, bench_dir=bench_dir, free_share=0.0)
    ids = {p["id"] for p in prompts}
    assert "Split_a---refused" not in ids and "Split_b---too_big" not in ids
    assert len(ids) == 12  # every usable schema once, no reuse needed


def test_more_prompts_than_schemas_reuse_them_with_other_instructions(bench_dir):
    prompts = build_prompts(30, seed=0, bench_dir=bench_dir, free_share=0.0)
    assert len({p["id"] for p in prompts}) == 30
    assert len({(json.dumps(p["schema"]), p["prompt"]) for p in prompts}) == 30
    assert any(p["id"].endswith("~1") for p in prompts)


def test_free_chat_only_needs_no_bench(tmp_path):
    prompts = build_prompts(10, seed=0, bench_dir=tmp_path / "absent", free_share=1.0)
    assert len(prompts) == 10 and all(p["schema"] is None for p in prompts)


@pytest.mark.parametrize("kwargs, option", [
    ({"n": 4}, "bench_dir"),  # the folder below does not exist
    ({"n": -1}, "n"),
    ({"n": 4, "free_share": 1.5}, "free_share"),
])
def test_bad_prompt_arguments_are_config_errors(tmp_path, kwargs, option):
    with pytest.raises(ConfigError) as err:
        build_prompts(bench_dir=tmp_path / "absent", **kwargs)
    assert err.value.option == option


# -------------------------------------------------------------------------------------------
# generate_corpus
# -------------------------------------------------------------------------------------------
CORPUS_PROMPTS = [
    {"id": "s-int", "prompt": "Generate a JSON object for: a number", "schema": SMALL_INT},
    {"id": "chat-1", "prompt": "Say hello.", "schema": None},
    {"id": "s-str", "prompt": "Fill in an example person as JSON.", "schema": SMALL_STR},
    {"id": "refused", "prompt": "Generate a JSON object for: x", "schema": REFUSED},
    {"id": "chat-2", "prompt": "List three colours.", "schema": None},
]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_corpus_rows_hold_the_engine_prompt_ids_and_outputs(tiny_loaded, tmp_path):
    out = generate_corpus(tiny_loaded, CORPUS_PROMPTS, tmp_path / "c.jsonl", max_tokens=8,
                          progress=False)
    rows = {r["id"]: r for r in load_corpus(out)}
    assert set(rows) == {"s-int", "chat-1", "s-str", "chat-2"}  # the refused schema has no row
    assert "SchemaError" in next(r for r in _rows(out) if r["id"] == "refused")["error"]
    gen = Generator(tiny_loaded, max_tokens=8, max_retries=0)  # one attempt, as the corpus
    usable = [p for p in CORPUS_PROMPTS if p["id"] in rows]
    results = gen.batch([p["prompt"] for p in usable], schemas=[p["schema"] for p in usable],
                        return_result=True)
    for p, res in zip(usable, results):
        spec = normalize_schema(p["schema"], layout=DEFAULT_LAYOUT) if p["schema"] else None
        assert rows[p["id"]]["prompt_ids"] == encode_prompt(tiny_loaded.tokenizer, p["prompt"], spec)
        if spec is not None:  # the schema is described in the system message
            described = json.dumps(spec.json_schema, ensure_ascii=False)
            assert described in tiny_loaded.tokenizer.decode(rows[p["id"]]["prompt_ids"])
        # the same tokens the public API returns (completed or cut by max_tokens)
        if isinstance(res, IncompleteOutputError):
            assert rows[p["id"]]["output_ids"] == res.token_ids
            assert rows[p["id"]]["finish_reason"] == "length"
        elif not isinstance(res, BaseException):
            assert rows[p["id"]]["output_ids"] == res.token_ids
        assert 1 <= len(rows[p["id"]]["output_ids"]) <= 8


@pytest.mark.parametrize("cut", ["whole_line", "half_line"])
def test_corpus_resume_regenerates_only_missing_ids(tiny_loaded, tmp_path, monkeypatch, cut):
    out = tmp_path / "c.jsonl"
    generate_corpus(tiny_loaded, CORPUS_PROMPTS, out, max_tokens=8, batch_size=2, progress=False)
    full = out.read_text()
    lines = full.splitlines(keepends=True)
    last = json.loads(lines[-1])
    kept = "".join(lines[:-1]) + (lines[-1][: len(lines[-1]) // 2] if cut == "half_line" else "")
    out.write_text(kept)  # a run killed while writing its last batch

    asked: list[str] = []
    original = Generator.make_request

    def spy(self, prompt, **kwargs):
        asked.append(prompt)
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Generator, "make_request", spy)
    generate_corpus(tiny_loaded, CORPUS_PROMPTS, out, max_tokens=8, batch_size=2, progress=False)
    prompt_of = {p["id"]: p["prompt"] for p in CORPUS_PROMPTS}
    assert asked == [prompt_of[last["id"]]]
    assert out.read_text() == full  # greedy: the regenerated row is the lost one
    ids = [r["id"] for r in _rows(out)]
    assert sorted(ids) == sorted(prompt_of)  # every prompt once, the refused one included

    asked.clear()
    generate_corpus(tiny_loaded, CORPUS_PROMPTS, out, max_tokens=8, progress=False)
    assert asked == [] and out.read_text() == full


def test_duplicate_prompt_ids_are_a_config_error(tiny_loaded, tmp_path):
    with pytest.raises(ConfigError, match="unique"):
        generate_corpus(tiny_loaded, CORPUS_PROMPTS[:2] * 2, tmp_path / "c.jsonl", progress=False)


# -------------------------------------------------------------------------------------------
# extract_features / FeatureDataset / batches (tiny Llama on the character vocabulary)
# -------------------------------------------------------------------------------------------
LAYERS = [0, 1, 2]  # embeddings, decoder layer 1, decoder layer 2 (the last) after the norm


def _corpus(n: int = 7, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p, o = 3 + i, 2 + (3 * i) % 5  # lengths all differ: batches are padded
        toks = torch.randint(1, 38, (p + o,), generator=g).tolist()
        rows.append({"id": f"r{i}", "prompt_ids": toks[:p], "output_ids": toks[p:]})
    return rows


def test_features_shapes_dtypes_and_masks(tiny_model, tmp_path):
    corpus = _corpus()
    out = extract_features(tiny_model, corpus, LAYERS, tmp_path / "f", max_len=16,
                           batch_tokens=48, progress=False)
    ds = FeatureDataset(out)
    assert len(ds) == len(corpus) and ds.feature_size == 3 * 64
    meta = json.loads((out / "meta.json").read_text())
    assert meta["layers"] == LAYERS and meta["hidden_size"] == 64 and meta["count"] == 7
    seen = set()
    for item in ds:
        row = corpus[item["index"]]
        ids = (row["prompt_ids"] + row["output_ids"])[:16]
        T = len(ids)
        assert item["id"] == row["id"]
        assert item["input_ids"].dtype == torch.int32 and item["input_ids"].tolist() == ids
        assert item["features"].dtype == torch.bfloat16 and item["features"].shape == (T, 192)
        assert item["target_next"].dtype == torch.int32 and item["target_next"].shape == (T,)
        assert item["loss_mask"].dtype == torch.bool
        P = len(row["prompt_ids"])
        assert item["loss_mask"].tolist() == [t >= P for t in range(T)]
        seen.add(item["index"])
    assert seen == set(range(7))


def test_features_equal_a_direct_forward_of_each_sequence(tiny_model, tmp_path):
    corpus = _corpus()
    # one batch for all: the shorter sequences are right-padded to the longest
    out = extract_features(tiny_model, corpus, LAYERS, tmp_path / "f", batch_tokens=10_000,
                           progress=False)
    for item in FeatureDataset(out):
        ids = item["input_ids"].long()[None]
        with torch.inference_mode():
            ref = tiny_model(ids, output_hidden_states=True)
        feats = item["features"].float().view(len(ids[0]), 3, 64)
        for j, layer in enumerate(LAYERS):  # bfloat16 storage: ~3 significant digits
            torch.testing.assert_close(feats[:, j], ref.hidden_states[layer][0], atol=2e-2,
                                       rtol=1e-2)
        assert item["target_next"].tolist() == ref.logits[0].argmax(-1).tolist()


def test_layer_minus_one_is_the_last_hidden_state(tiny_model, tmp_path):
    corpus = _corpus(n=3)
    a = FeatureDataset(extract_features(tiny_model, corpus, [1, -1], tmp_path / "a", progress=False))
    b = FeatureDataset(extract_features(tiny_model, corpus, [1, 2], tmp_path / "b", progress=False))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["features"], y["features"])
    with pytest.raises(ConfigError) as err:  # the same layer twice
        extract_features(tiny_model, corpus, [2, -1], tmp_path / "c", progress=False)
    assert err.value.option == "layers"


def test_features_resume_skips_done_work(tiny_model, tmp_path, monkeypatch):
    corpus = _corpus()
    out = tmp_path / "f"
    # tiny shards: one per forward batch
    extract_features(tiny_model, corpus, LAYERS, out, batch_tokens=24, shard_bytes=1,
                     progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["shards"]) > 2
    lost = meta["shards"].pop()  # killed after writing its last shard, before listing it
    meta["count"] -= len(lost["indices"])
    meta["tokens"] -= lost["tokens"]
    (out / "meta.json").write_text(json.dumps(meta))

    computed: list[int] = []
    original = features_mod.target_features

    def spy(model, seqs, layers):
        computed.extend(len(s) for s in seqs)
        return original(model, seqs, layers)

    monkeypatch.setattr(features_mod, "target_features", spy)
    extract_features(tiny_model, corpus, LAYERS, out, batch_tokens=24, shard_bytes=1,
                     progress=False)
    assert len(computed) == len(lost["indices"])
    indices = [item["index"] for item in FeatureDataset(out)]
    assert sorted(indices) == list(range(7))

    computed.clear()
    extract_features(tiny_model, corpus, LAYERS, out, batch_tokens=24, progress=False)
    assert computed == []
    with pytest.raises(ConfigError, match="layers"):
        extract_features(tiny_model, corpus, [0, 2], out, progress=False)
    with pytest.raises(ConfigError, match="corpus row"):
        extract_features(tiny_model, corpus[::-1], LAYERS, out, progress=False)


@pytest.mark.parametrize("seed", [0, None])
def test_batches_pad_and_mask_every_sequence_once(tiny_model, tmp_path, seed):
    corpus = _corpus(n=9)
    out = extract_features(tiny_model, corpus, LAYERS, tmp_path / "f", batch_tokens=40,
                           shard_bytes=20_000, progress=False)
    ds = FeatureDataset(out)
    assert ds.num_shards > 1
    for k in range(ds.num_shards):  # one forward batch is at most 40 * 393 bytes < 20_000
        data_bytes = sum(len(s["input_ids"]) for s in ds.shard(k)) * (192 * 2 + 9)
        assert data_bytes <= 20_000
        # the file is the tensor data and little else
        assert (out / f"shard_{k:05d}.pt").stat().st_size < data_bytes + 12_000
    stored = {item["index"]: item for item in ds}
    got = list(batches(ds, 40, seed))
    assert sorted(i for b in got for i in b["index"].tolist()) == list(range(9))
    for b in got:
        B, T = b["input_ids"].shape
        assert B * T <= 40 or B == 1
        assert b["features"].shape == (B, T, 192) and b["features"].dtype == torch.bfloat16
        assert b["input_ids"].dtype == b["target_next"].dtype == torch.long
        for r, index in enumerate(b["index"].tolist()):
            item = stored[index]
            n = len(item["input_ids"])
            assert b["attention_mask"][r].tolist() == [t < n for t in range(T)]
            assert torch.equal(b["input_ids"][r, :n], item["input_ids"].long())
            assert torch.equal(b["features"][r, :n], item["features"])
            assert torch.equal(b["target_next"][r, :n], item["target_next"].long())
            assert torch.equal(b["loss_mask"][r, :n], item["loss_mask"])
            assert not b["loss_mask"][r, n:].any() and not b["input_ids"][r, n:].any()
            assert not b["features"][r, n:].any()
    order = [b["index"].tolist() for b in got]
    assert order == [b["index"].tolist() for b in batches(ds, 40, seed)]  # reproducible
    first_shard = json.loads((out / "meta.json").read_text())["shards"][0]["indices"]
    if seed is None:  # stored order: the first shard's sequences come first, shortest first
        head = [i for b in order for i in b][:len(first_shard)]
        assert sorted(head) == sorted(first_shard)
        assert head == sorted(first_shard, key=lambda i: len(stored[i]["input_ids"]))
    else:
        assert order != [b["index"].tolist() for b in batches(ds, 40, seed + 1)]


@pytest.fixture()
def fresh_loaded():
    """A LoadedModel of its own: the runner source enables kept features on its runner."""
    from cs_testlib import tiny_loaded_model

    return tiny_loaded_model(seed=3)


def _loaded_corpus(vocab: int, n: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        p, o = 4 + 2 * i, 3 + (5 * i) % 11
        toks = torch.randint(1, vocab, (p + o,), generator=g).tolist()
        rows.append({"id": f"r{i}", "prompt_ids": toks[:p], "output_ids": toks[p:]})
    return rows


def test_runner_source_gives_the_features_of_a_direct_forward(fresh_loaded, tmp_path):
    """Through the runner (prefill, then chunks of answer tokens, several sequences per
    forward) the stored states are the model's own hidden states at every position."""
    corpus = _loaded_corpus(fresh_loaded.vocab_size - 2)
    out = extract_features(fresh_loaded, corpus, LAYERS, tmp_path / "r", chunk=3, rows=7,
                           progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"] == "runner" and meta["chunk"] == 3 and meta["count"] == len(corpus)
    model = fresh_loaded.model
    for item in FeatureDataset(out):
        ids = item["input_ids"].long()[None]
        with torch.inference_mode():
            ref = model(ids, output_hidden_states=True)
        feats = item["features"].float().view(len(ids[0]), 3, 64)
        for j, layer in enumerate(LAYERS):
            torch.testing.assert_close(feats[:, j], ref.hidden_states[layer][0], atol=2e-2,
                                       rtol=1e-2)
        assert item["target_next"].tolist() == ref.logits[0].argmax(-1).tolist()
        P = len(corpus[item["index"]]["prompt_ids"])
        assert item["loss_mask"].tolist() == [t >= P for t in range(len(ids[0]))]


def test_runner_source_chunking_changes_nothing_and_is_part_of_the_resume_check(fresh_loaded,
                                                                             tmp_path):
    corpus = _loaded_corpus(fresh_loaded.vocab_size - 2, n=4)
    a = FeatureDataset(extract_features(fresh_loaded, corpus, [1, -1], tmp_path / "a", chunk=1,
                                        rows=1, progress=False))
    b = FeatureDataset(extract_features(fresh_loaded, corpus, [1, -1], tmp_path / "b", chunk=6,
                                        rows=12, progress=False))
    by_index = {x["index"]: x for x in a}
    for y in b:
        x = by_index[y["index"]]
        torch.testing.assert_close(x["features"].float(), y["features"].float(), atol=2e-2,
                                   rtol=1e-2)
        assert torch.equal(x["target_next"], y["target_next"])
    # a folder holds one kind of features: another source or chunk size is refused
    for kwargs in ({"source": "hf"}, {"chunk": 2}):
        with pytest.raises(ConfigError) as err:
            extract_features(fresh_loaded, corpus, [1, -1], tmp_path / "a", progress=False,
                             **kwargs)
        assert err.value.option == "out_dir"


@pytest.mark.parametrize("kwargs, option", [({"source": "runner"}, "source"),
                                            ({"source": "dense"}, "source"),
                                            ({"chunk": 0}, "chunk"), ({"rows": True}, "rows")])
def test_bad_feature_source_options_are_config_errors(tiny_model, tmp_path, kwargs, option):
    # a bare transformers model has no runner
    with pytest.raises(ConfigError) as err:
        extract_features(tiny_model, _corpus(), LAYERS, tmp_path / "f", progress=False, **kwargs)
    assert err.value.option == option


def test_empty_corpus_and_bad_layers_are_config_errors(tiny_model, tmp_path):
    with pytest.raises(ConfigError) as err:
        extract_features(tiny_model, [], LAYERS, tmp_path / "f", progress=False)
    assert err.value.option == "corpus"
    for layers in ([], [0, 3], [1, 1], [-2]):
        with pytest.raises(ConfigError) as err:
            extract_features(tiny_model, _corpus(), layers, tmp_path / "f", progress=False)
        assert err.value.option == "layers"
    with pytest.raises(ConfigError):
        FeatureDataset(tmp_path / "nothing")
    with pytest.raises(ConfigError):
        load_corpus(tmp_path / "nothing.jsonl")


def test_default_bench_dir_is_where_the_benchmarks_read_jsonschemabench():
    from benchmarks.coverage import BENCH_DIR

    assert data_mod.BENCH_DIR == BENCH_DIR


def test_real_schemas_make_prompts():
    prompts = build_prompts(12, seed=0, bench_dir=JSONSCHEMABENCH_SAMPLE)
    assert sum(p["schema"] is None for p in prompts) == 3
    assert all(p["prompt"] for p in prompts) and len({p["id"] for p in prompts}) == 12
