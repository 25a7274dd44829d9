"""Target features for learned drafters: hidden states and greedy next tokens, per position.

An EAGLE-3 head reads a few of the target's hidden layers; an MTP module reads its last one;
both learn to predict the target's own next tokens. Running the target once over the corpus
and storing those, position by position, makes training a pass over files that never touches
the target again.

Layer indices are those of transformers' ``hidden_states`` (and of the runner's
``enable_features``, which keeps the same states at decode time): 0 is the embeddings output,
i (1..n-1) the output of the i-th decoder layer (``layers[i - 1]``), n -- or -1 -- the output
of the last one after the final norm (the LM head's input).

On disk (``out_dir``)::

    shard_00000.pt   torch.save of a dict of lists, one entry per sequence (at most ~256 MB):
        index        int       the sequence's position in the corpus list
        id           str       the corpus row's id
        input_ids    int32     [T]        prompt_ids + output_ids, cut to max_len
        features     bfloat16  [T, L*H]   hidden_states[layers[0]] | ... | hidden_states[layers[-1]]
        target_next  int32     [T]        argmax of the target's logits at t: its greedy token t+1
        loss_mask    bool      [T]        True where input_ids[t] is an output token
    meta.json        layers, hidden_size, feature_size, model, max_len, source, chunk, count,
                     tokens, and per shard its file, indices and ids (what a resumed run skips)

Two ways to run the target (``source``):

- ``"runner"`` (the default for a ``LoadedModel``): through the library's own runner, as
  decoding runs it -- the prompt in one prefill forward, the answer in chunks of ``chunk``
  tokens per sequence (``rows`` rows per forward at most), so the features come from the same
  kernels a verification step uses (on CPU bf16: the exact int4 kernel for few-row forwards).
  A head trained on these sees at drafting time what it saw in training.
- ``"hf"``: one padded transformers forward per batch (a bare transformers model; the dense
  weights).

A shard is written whole (temporary file, then renamed) before meta.json lists it, so a killed
run loses at most the shard it was filling.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from constrained_spec.errors import ConfigError
from constrained_spec.model.loading import LoadedModel

logger = logging.getLogger(__name__)

#: Bytes of tensor data per shard at most (unless one forward batch alone is larger).
SHARD_BYTES = 256 << 20
FORMAT_VERSION = 1
_META = "meta.json"


def group_by_tokens(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``lengths`` (positions into it) whose padded size, count x longest,
    stays within ``batch_tokens``; a longer sequence forms a batch of its own."""
    groups: list[list[int]] = []
    group: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if group and (len(group) + 1) * max(longest, n) > batch_tokens:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    if group:
        groups.append(group)
    return groups


@torch.inference_mode()
def target_features(hf_model: Any, seqs: Sequence[Sequence[int]],
                    layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One right-padded forward over ``seqs``: (features, greedy next tokens) per position.

    Returns ``features`` bfloat16 [B, T, len(layers) * H] and ``target_next`` int32 [B, T] on
    the model's device (rows past a sequence's length are padding).
    """
    device = next(hf_model.parameters()).device
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, :len(s)] = 1
    out = hf_model(input_ids=ids.to(device), attention_mask=mask.to(device),
                   output_hidden_states=True, use_cache=False)
    # features: [B, T, L*H]; hidden_states[-1] is hidden_states[n]
    features = torch.cat([out.hidden_states[i] for i in layers], dim=-1).to(torch.bfloat16)
    target_next = out.logits.argmax(dim=-1).to(torch.int32)  # [B, T]
    return features, target_next


@torch.inference_mode()
def runner_features(runner: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                    layers: Sequence[int], *, chunk: int = 4
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Features through the library's runner, position by position as decoding computes them.

    The sequences share the runner's forwards (one slot each): their prompts
    (``seq[:prompt_lens[i]]``) in one batched prefill, then the rest ``chunk`` tokens per
    sequence per forward, the way verification steps feed accepted tokens. Returns per sequence
    (features bfloat16 [T, len(layers) * H], target_next int32 [T]) on the CPU.
    """
    runner.enable_features(layers)
    slots = [runner.new_slot() for _ in seqs]
    feats: list[list[torch.Tensor]] = [[] for _ in seqs]
    nexts: list[list[torch.Tensor]] = [[] for _ in seqs]

    def run(live: list[int], spans: list[tuple[int, int]]) -> None:
        tokens = [list(seqs[i][s:e]) for i, (s, e) in zip(live, spans)]
        logits = runner.forward([slots[i] for i in live], tokens, [len(t) for t in tokens])
        row = 0
        for i, (s, e) in zip(live, spans):
            nexts[i].append(logits[row: row + e - s].argmax(dim=-1).to(torch.int32).cpu())
            feats[i].append(runner.features(slots[i], s, e, layers).to(torch.bfloat16).cpu())
            row += e - s

    try:
        first = [max(1, min(int(n), len(seq))) for n, seq in zip(prompt_lens, seqs)]
        run(list(range(len(seqs))), [(0, n) for n in first])
        done = list(first)
        while True:
            live = [i for i, seq in enumerate(seqs) if done[i] < len(seq)]
            if not live:
                break
            spans = [(done[i], min(done[i] + chunk, len(seqs[i]))) for i in live]
            run(live, spans)
            for i, (_, e) in zip(live, spans):
                done[i] = e
    finally:
        for slot in slots:
            runner.free_slot(slot)
    return [(torch.cat(f), torch.cat(t)) for f, t in zip(feats, nexts)]


def _check_layers(layers: Sequence[int], n_layers: int) -> list[int]:
    """``layers`` as a list, checked: distinct indices in -1, 0..n_layers (-1 is n_layers)."""
    out = list(layers)
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or not -1 <= i <= n_layers
                      for i in out) or len({n_layers if i == -1 else i for i in out}) != len(out):
        raise ConfigError(f"must be distinct hidden_states indices in 0..{n_layers} (0: the "
                          f"embeddings, {n_layers} or -1: the last layer after the final norm), "
                          f"got {list(layers)!r}", option="layers")
    return out


def _row_id(corpus: list[dict[str, Any]], index: int) -> str:
    return str(corpus[index].get("id", index))


def _read_meta(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / _META
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _write_meta(out_dir: Path, meta: dict[str, Any]) -> None:
    tmp = out_dir / (_META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(tmp, out_dir / _META)


def extract_features(model: Any, corpus: list[dict[str, Any]], layers: Sequence[int],
                     out_dir: Path, *, source: str | None = None, chunk: int = 4,
                     rows: int = 12, max_len: int = 1024, batch_tokens: int = 4096,
                     shard_bytes: int = SHARD_BYTES, progress: bool = True) -> Path:
    """Run the target over every corpus sequence and store its features in ``out_dir``.

    Parameters
    ----------
    model:
        The target: a ``LoadedModel`` (``load_model``), or a bare transformers causal LM (then
        ``source`` must be ``"hf"``), on the device it should run on. Features are stored in
        bfloat16 whatever its dtype.
    corpus:
        Rows with ``prompt_ids`` and ``output_ids`` (:func:`~.data.load_corpus`); a sequence is
        ``prompt_ids + output_ids`` cut to ``max_len`` tokens, and is known by its position in
        this list.
    layers:
        ``hidden_states`` indices to store, concatenated in this order (0: embeddings, n or -1:
        the last layer after the final norm; see the module docstring).
    source:
        ``"runner"`` (default for a ``LoadedModel``): through the library's runner, as decoding
        computes them; ``"hf"``: one padded transformers forward per batch (see the module
        docstring).
    chunk, rows:
        ``"runner"`` only: answer tokens per sequence per forward, and rows per forward at most
        (``rows // chunk`` sequences share a forward). Keep ``rows`` at or under the runner's
        few-row kernel limit (``runner.FEW_ROWS``) to get the features decoding gets.
    max_len, batch_tokens:
        Longest sequence kept; ``"hf"``: padded tokens per forward (sequences of similar length
        are batched together, right-padded).
    shard_bytes:
        Tensor bytes per shard at most (a shard holds at least one forward batch).

    Resumable: sequences already listed in ``meta.json`` are skipped; a run over another model,
    layer set or max_len, or a corpus whose rows moved, raises :class:`ConfigError`. Returns
    ``out_dir``; the format is in the module docstring.
    """
    from tqdm.auto import tqdm

    loaded, hf_model, source = _target_source(model, source)
    _check_sizes(corpus, chunk=chunk, rows=rows, max_len=max_len, batch_tokens=batch_tokens)
    n_layers = int(hf_model.config.num_hidden_layers)
    layers = _check_layers(layers, n_layers)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh = _fresh_meta(hf_model, layers, max_len=max_len, source=source, chunk=chunk)
    meta, done = _resume(out_dir, fresh, corpus, n_layers)

    seqs = {i: (list(row["prompt_ids"]) + list(row["output_ids"]))[:max_len]
            for i, row in enumerate(corpus) if i not in done}
    # bytes per stored token: bfloat16 features, int32 input_ids and target_next, bool loss_mask
    token_bytes = fresh["feature_size"] * 2 + 9
    shards = _ShardWriter(out_dir, meta, shard_bytes)
    bar = tqdm(total=len(corpus), initial=len(done), desc="features", unit="seq",
               disable=not progress, file=sys.stderr)
    try:
        for batch, results in _features_by_batch(loaded, hf_model, source, corpus, seqs, layers,
                                                 chunk=chunk, rows=rows, batch_tokens=batch_tokens):
            shards.add_batch(sum(len(seqs[i]) for i in batch) * token_bytes)
            for i, (feats, nexts) in zip(batch, results):
                shards.add(i, _row_id(corpus, i), seqs[i], len(corpus[i]["prompt_ids"]), feats, nexts)
            bar.update(len(batch))
        shards.flush()
    finally:
        bar.close()
    return out_dir


def _target_source(model: Any, source: str | None) -> tuple[LoadedModel | None, Any, str]:
    """(the ``LoadedModel`` or None, the transformers model, the source) of an
    `extract_features` call; ConfigError for an unknown source, or ``"runner"`` without a
    ``LoadedModel``."""
    loaded = model if isinstance(model, LoadedModel) else None
    hf_model = loaded.model if loaded is not None else model
    if source is None:
        source = "runner" if loaded is not None else "hf"
    if source not in ("runner", "hf"):
        raise ConfigError(f"must be 'runner' or 'hf', got {source!r}", option="source")
    if source == "runner" and loaded is None:
        raise ConfigError("source='runner' needs a LoadedModel (load_model); a bare transformers "
                          "model runs with source='hf'", option="source")
    return loaded, hf_model, source


def _fresh_meta(hf_model: Any, layers: list[int], *, max_len: int, source: str,
                chunk: int) -> dict[str, Any]:
    """meta.json of a run that has stored nothing yet (see the module docstring)."""
    cfg = hf_model.config
    hidden = int(cfg.hidden_size)
    model_name = str(getattr(cfg, "_name_or_path", "") or type(hf_model).__name__)
    return {"format": FORMAT_VERSION, "model": model_name, "layers": layers,
            "hidden_size": hidden, "feature_size": hidden * len(layers),
            "max_len": max_len, "source": source,
            "chunk": chunk if source == "runner" else None,
            "count": 0, "tokens": 0, "shards": []}


def _features_by_batch(loaded: LoadedModel | None, hf_model: Any, source: str,
                       corpus: list[dict[str, Any]], seqs: dict[int, list[int]],
                       layers: list[int], *, chunk: int, rows: int, batch_tokens: int
                       ) -> Iterator[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]]:
    """The target run over ``seqs`` (corpus position -> sequence) one forward batch at a time,
    longest sequences first: per batch, its corpus positions and per sequence (features,
    target_next) on the CPU, cut to the sequence's length."""
    order = sorted(seqs, key=lambda i: -len(seqs[i]))  # longest first: a too-large batch fails early
    if source == "runner":
        per = max(1, rows // chunk)
        groups = [list(range(g, min(g + per, len(order)))) for g in range(0, len(order), per)]
    else:
        groups = group_by_tokens([len(seqs[i]) for i in order], batch_tokens)
    for group in groups:
        batch = [order[g] for g in group]
        if source == "runner":
            assert loaded is not None  # source 'runner' without a LoadedModel raised before
            results = runner_features(loaded.runner, [seqs[i] for i in batch],
                                      [len(corpus[i]["prompt_ids"]) for i in batch], layers,
                                      chunk=chunk)
        else:
            features, target_next = target_features(hf_model, [seqs[i] for i in batch], layers)
            features, target_next = features.cpu(), target_next.cpu()
            # clone: a slice would save (and load as) a view of the padded batch tensor
            results = [(features[b, :len(seqs[i])].clone(), target_next[b, :len(seqs[i])].clone())
                       for b, i in enumerate(batch)]
        yield batch, results


def _check_sizes(corpus: list[dict[str, Any]], *, chunk: int, rows: int, max_len: int,
                 batch_tokens: int) -> None:
    """ConfigError naming the first bad size option (or an empty corpus)."""
    for name, value, low in (("chunk", chunk, 1), ("rows", rows, 1), ("max_len", max_len, 2),
                             ("batch_tokens", batch_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            want = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise ConfigError(f"must be {want}, got {value!r}", option=name)
        if name == "rows" and not corpus:  # as before: sizes per forward first, then the corpus
            raise ConfigError("the corpus is empty; run generate_corpus first", option="corpus")


def _resume(out_dir: Path, fresh: dict[str, Any], corpus: list[dict[str, Any]],
            n_layers: int) -> tuple[dict[str, Any], set[int]]:
    """(meta, corpus rows done) of ``out_dir``: ``fresh`` when it holds nothing; ConfigError
    when it holds features of another run (model, layers, max_len ...) or another corpus."""
    meta = _read_meta(out_dir) or fresh
    meta.setdefault("source", "hf")  # written before sources existed
    meta.setdefault("chunk", None)
    same = {key: meta.get(key) == fresh[key]
            for key in ("format", "model", "hidden_size", "max_len", "source", "chunk")}
    same["layers"] = [n_layers if i == -1 else i for i in meta.get("layers", [])] == [
        n_layers if i == -1 else i for i in fresh["layers"]]
    for key, ok in same.items():
        if not ok:
            raise ConfigError(f"{out_dir} holds features with {key}={meta.get(key)!r}, this run "
                              f"has {fresh[key]!r}; use another out_dir", option="out_dir")
    done: set[int] = set()
    for shard in meta["shards"]:
        for index, sid in zip(shard["indices"], shard["ids"]):
            if index >= len(corpus) or _row_id(corpus, index) != sid:
                raise ConfigError(f"{out_dir}: corpus row {index} was {sid!r} when its features "
                                  "were stored; pass the same corpus, or use another out_dir",
                                  option="corpus")
            done.add(index)
    return meta, done


class _ShardWriter:
    """Sequences buffered into shards of at most ``shard_bytes`` (unless one forward batch
    alone is larger); each shard written to a temp file and renamed, then listed in meta.json."""

    def __init__(self, out_dir: Path, meta: dict[str, Any], shard_bytes: int) -> None:
        self.out_dir, self.meta, self.shard_bytes = out_dir, meta, shard_bytes
        self.buffer: dict[str, list[Any]] = {k: [] for k in ("index", "id", "input_ids", "features",
                                                             "target_next", "loss_mask")}
        self.buffered = 0
        _write_meta(out_dir, meta)

    def add_batch(self, size: int) -> None:
        """Make room for a forward batch of ``size`` bytes (a shard never splits a batch)."""
        if self.buffered and self.buffered + size > self.shard_bytes:
            self.flush()
        self.buffered += size

    def add(self, index: int, row_id: str, seq: list[int], prompt_len: int,
            features: torch.Tensor, target_next: torch.Tensor) -> None:
        loss_mask = torch.zeros(len(seq), dtype=torch.bool)
        loss_mask[prompt_len:] = True
        for key, value in (("index", index), ("id", row_id),
                           ("input_ids", torch.tensor(seq, dtype=torch.int32)),
                           ("features", features), ("target_next", target_next),
                           ("loss_mask", loss_mask)):
            self.buffer[key].append(value)

    def flush(self) -> None:
        buffer, meta = self.buffer, self.meta
        if not buffer["index"]:
            return
        name = f"shard_{len(meta['shards']):05d}.pt"
        tmp = self.out_dir / (name + ".tmp")
        torch.save(buffer, tmp)
        os.replace(tmp, self.out_dir / name)
        tokens = sum(len(t) for t in buffer["input_ids"])
        meta["shards"].append({"file": name, "indices": list(buffer["index"]),
                               "ids": list(buffer["id"]), "tokens": tokens})
        meta["count"] += len(buffer["index"])
        meta["tokens"] += tokens
        _write_meta(self.out_dir, meta)
        for values in buffer.values():
            values.clear()
        self.buffered = 0


class FeatureDataset(torch.utils.data.IterableDataset):
    """The sequences stored by :func:`extract_features`, one dict per sequence, shard by shard.

    Each item: ``index`` (int), ``id`` (str), ``input_ids`` int32 [T], ``features`` bfloat16
    [T, F], ``target_next`` int32 [T], ``loss_mask`` bool [T].
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        meta = _read_meta(self.path)
        if meta is None:
            raise ConfigError(f"no features in {self.path} ({_META} is missing); run "
                              "extract_features first", option="features")
        self.meta: dict[str, Any] = meta

    @property
    def feature_size(self) -> int:
        return int(self.meta["feature_size"])

    @property
    def num_shards(self) -> int:
        return len(self.meta["shards"])

    def __len__(self) -> int:
        return int(self.meta["count"])

    def shard(self, k: int) -> list[dict[str, Any]]:
        """The sequences of shard ``k``."""
        data = torch.load(self.path / self.meta["shards"][k]["file"], weights_only=True)
        keys = list(data)
        return [dict(zip(keys, values)) for values in zip(*(data[key] for key in keys))]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for k in range(self.num_shards):
            yield from self.shard(k)


def collate(seqs: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad sequences into one batch; padding is zero (False) in every tensor.

    Returns ``input_ids`` long [B, T], ``features`` bfloat16 [B, T, F], ``target_next`` long
    [B, T], ``loss_mask`` bool [B, T] (output positions), ``attention_mask`` bool [B, T] (real
    positions) and ``index`` long [B] (corpus positions).
    """
    B, T = len(seqs), max(len(s["input_ids"]) for s in seqs)
    F = seqs[0]["features"].shape[-1]
    out = {"input_ids": torch.zeros((B, T), dtype=torch.long),
           "features": torch.zeros((B, T, F), dtype=torch.bfloat16),
           "target_next": torch.zeros((B, T), dtype=torch.long),
           "loss_mask": torch.zeros((B, T), dtype=torch.bool),
           "attention_mask": torch.zeros((B, T), dtype=torch.bool),
           "index": torch.tensor([int(s["index"]) for s in seqs], dtype=torch.long)}
    for b, s in enumerate(seqs):
        n = len(s["input_ids"])
        out["input_ids"][b, :n] = s["input_ids"]
        out["features"][b, :n] = s["features"]
        out["target_next"][b, :n] = s["target_next"]
        out["loss_mask"][b, :n] = s["loss_mask"]
        out["attention_mask"][b, :n] = True
    return out


def batches(dataset: FeatureDataset, batch_tokens: int,
            seed: int | None = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Padded batches (:func:`collate`) of at most ``batch_tokens`` padded tokens each.

    One shard is in memory at a time; inside it, sequences of similar length are batched
    together. ``seed``: shards, and batches within a shard, in a seeded random order (``None``:
    stored order, shortest sequences first within a shard). Every sequence appears once.
    """
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ConfigError(f"must be a positive integer, got {batch_tokens!r}", option="batch_tokens")
    rng = random.Random(seed) if seed is not None else None
    shards = list(range(dataset.num_shards))
    if rng is not None:
        rng.shuffle(shards)
    for k in shards:
        seqs = dataset.shard(k)
        tie = [rng.random() if rng is not None else 0.0 for _ in seqs]
        order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]["input_ids"]), tie[i]))
        groups = group_by_tokens([len(seqs[i]["input_ids"]) for i in order], batch_tokens)
        if rng is not None:
            rng.shuffle(groups)
        for group in groups:
            yield collate([seqs[order[g]] for g in group])
