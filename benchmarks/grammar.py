"""Grammar overhead on JSONSchemaBench, MaskBench-style: compile time per schema and mask time
per token under speculation, for our grammar layer over xgrammar and over outlines-core.

For every schema of ``<split>.jsonl.gz`` in ``--bench-dir`` (as in coverage.py) and each backend:

* **compile**: ``normalize_schema`` -> ``compile_spec(spec, tok, backend=..., timeout_s=...)``
  with the compile cache cleared first (a cold compile: schema -> grammar / regex conversion plus
  the backend's compile), in wall time and in the worker process's CPU time (all its threads:
  xgrammar compiles on several; on a shared machine wall time also counts waiting for a core).
  The per-tokenizer objects (xgrammar's ``GrammarCompiler``, outlines' ``Vocabulary``) are built
  once per worker beforehand, as a server builds them once per model. A schema that fails
  (malformed for our layer, or the backend cannot compile it) or runs past the time limit is
  counted apart and is not in the percentiles. The limit is CPU time (`compile_within`; on a
  shared machine a wall-clock limit mostly measures the other processes), with a wall-clock cap
  of ``WALL_FACTOR`` times it.
* **masks**: every valid test instance, written as the library writes JSON (``JsonLayout``, keys
  in declared order: ``coverage.prepare_tests``), is tokenized with the embedded model's
  tokenizer, an eos appended, and walked the way a speculative step uses the grammar: at each
  position i the matcher is forked, bitmask row 0 filled, then for j = 1..K the fork accepts
  token i+j-1 and fills row j (K+1 rows of one ``[K+1, V/32]`` int32 bitmask; fewer near the
  end); then the real matcher accepts token i. Timed: each row (the fork's accept + the fill:
  "per token", wall time) and the whole step (fork + K accepts + K+1 fills: "K+1 masks", full
  steps only), in wall time and in the thread's CPU time, which leaves out preemption by other
  processes. Outlines builds each DFA state's row on first use (cached on the compiled spec), so
  first visits, as in a first request, are in the numbers. A valid instance the grammar rejects
  (narrowing, see the coverage section) is walked up to the rejection and counted. Percentiles
  pool every row / step of a split.

The budget is one target forward of the embedded model as ``load_model(None)`` runs it
(``--forward-ms``, or measured after the sweep: the fastest of 30 1-token and (K+1)-token
forwards on a 200-token KV cache with ``--threads`` torch threads, i.e. the cost when no other
process takes the core; medians are reported too). One thread by default: with two on a shared
2-core machine most forwards stall waiting for the busy core (medians of a second), so one thread
is what such a machine measures reliably. Share = (K+1 masks, CPU time) / (1-token forward): the
grammar work of one speculative step against the cheapest forward it accompanies.

Each schema runs in a worker process (``--workers``, default: the CPU count) with a per-backend
compile limit; a worker past it is retired, a hung or dead one replaced (``_workers.Pool``, as
in coverage.py).

    python -m benchmarks.grammar                                  # all splits, both backends
    python -m benchmarks.grammar --splits JME,BFCL --limit 20     # a seeded sample per split
    python -m benchmarks.grammar --sample 200 --seed 1 --json benchmarks/out/grammar.json \\
        --write-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, cast

from benchmarks import coverage
from benchmarks._results import write_section
from benchmarks._workers import Pool

BACKENDS = ("xgrammar", "outlines")
K = 5
RESULTS_HEADING = "## Grammar overhead (JSONSchemaBench, MaskBench-style)"
FAILED = ("malformed", "error", "crash")
TIMED_OUT = ("timeout", "hang")
# imported once by the forkserver, so a replaced worker is ready in about a second
WORKER_PRELOAD = ["torch", "constrained_spec.grammar", "constrained_spec.schemas", "xgrammar",
                  "outlines_core", "jsonschema", "tokenizers"]


# --------------------------------------------------------------------------------------------
# pure helpers: percentiles, aggregation, the table
# --------------------------------------------------------------------------------------------

def percentiles(values: Sequence[float] | Any, qs: Iterable[float] = (50, 99)) -> list[float]:
    """Linear-interpolated percentiles of `values` (NaN for each when there are none)."""
    import numpy as np

    arr = np.asarray(values, dtype=np.float64).ravel()
    qs = list(qs)
    if arr.size == 0:
        return [math.nan] * len(qs)
    return [float(v) for v in np.percentile(arr, qs)]


def summarize(records: list[dict],
              backends: Sequence[str] = BACKENDS) -> dict[str, dict[str, dict[str, Any]]]:
    """``{backend: {split | "all": stats}}`` from per-schema records.

    A record is ``{"split", "results": {backend: {"status", "compile_ms", "instances",
    "rejected", "tokens", "row_us", "step_us", "step_cpu_us"}}}`` (only "status" is required;
    the ``_us`` entries are samples). Shares of the forward: `with_shares`.
    """
    import numpy as np

    splits: dict[str, list[dict]] = {}
    for r in records:
        splits.setdefault(r["split"], []).append(r)
        splits.setdefault("all", []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in backends:
        out[backend] = {}
        for split, rows in splits.items():
            res = [r["results"].get(backend, {"status": "crash"}) for r in rows]
            ok = [x for x in res if x.get("status") == "compiled"]
            compile_ms = [x["compile_ms"] for x in ok]
            compile_cpu_ms = [x.get("compile_cpu_ms", math.nan) for x in ok]
            row_us, step_us, step_cpu_us = (
                np.concatenate([np.asarray(x.get(key, ()), dtype=np.float64) for x in ok]
                               or [np.zeros(0)])
                for key in ("row_us", "step_us", "step_cpu_us"))
            s: dict[str, Any] = {
                "schemas": len(res),
                "compiled": len(ok),
                "failed": sum(x.get("status") in FAILED for x in res),
                "timeouts": sum(x.get("status") in TIMED_OUT for x in res),
                "instances": sum(x.get("instances", 0) for x in ok),
                "rejected": sum(x.get("rejected", 0) for x in ok),
                "tokens": sum(x.get("tokens", 0) for x in ok),
                "rows": int(row_us.size),
                "steps": int(step_us.size),
            }
            s["compile_ms_p50"], s["compile_ms_p99"] = percentiles(compile_ms)
            s["compile_ms_max"] = max(compile_ms, default=math.nan)
            s["compile_cpu_ms_p50"], s["compile_cpu_ms_p99"] = percentiles(compile_cpu_ms)
            s["token_us_p50"], s["token_us_p99"] = percentiles(row_us)
            s["step_us_p50"], s["step_us_p99"] = percentiles(step_us)
            s["step_cpu_us_p50"], s["step_cpu_us_p99"] = percentiles(step_cpu_us)
            out[backend][split] = s
    return out


def with_shares(table: dict[str, dict[str, dict[str, Any]]], forward_ms: float | None) -> dict:
    """`table` (a `summarize` result, or one read back from --json) with the shares of the
    forward for `forward_ms`: the CPU time of one step's masks (preemption by other processes
    left out) over the forward."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for backend, by_split in table.items():
        out[backend] = {}
        for split, s in by_split.items():
            s = {k: v for k, v in s.items() if not k.startswith("share_")}
            if forward_ms:
                for q in ("p50", "p99"):
                    cpu = s.get(f"step_cpu_us_{q}")
                    s[f"share_{q}"] = math.nan if cpu is None else cpu / (1000.0 * forward_ms)
            out[backend][split] = {k: (math.nan if v is None else v) for k, v in s.items()}
    return out


def _num(x: float, digits: int = 0) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2f}%"


NAMES = {"xgrammar": "ours over xgrammar", "outlines": "ours over outlines-core"}


def format_table(table: dict[str, dict[str, dict[str, Any]]], k: int = K,
                 split_order: Sequence[str] = ()) -> str:
    """One markdown table per backend: a row per split, then **all**."""
    lines: list[str] = []
    for backend, by_split in table.items():
        order = [s for s in split_order if s in by_split]
        order += sorted(s for s in by_split if s not in order and s != "all")
        order += ["all"] if "all" in by_split else []
        share = any("share_p50" in s for s in by_split.values())
        lines += [f"**{NAMES.get(backend, backend)}**", "",
                  "| split | schemas | compiled | failed / timeouts | compile ms p50 / p99 "
                  "| compile CPU ms p50 / p99 | instances (rejected) | tokens "
                  f"| mask / token µs p50 / p99 | {k + 1} masks µs p50 / p99 "
                  f"| {k + 1} masks CPU µs p50 / p99 |"
                  + (" share of forward p50 / p99 |" if share else ""),
                  "| --- |" + " ---: |" * (10 + share)]
        for split in order:
            s = by_split[split]
            name = f"**{split}**" if split == "all" else split
            lines.append(
                f"| {name} | {s['schemas']} | {s['compiled']} | {s['failed']} / {s['timeouts']} "
                f"| {_num(s['compile_ms_p50'], 1)} / {_num(s['compile_ms_p99'], 1)} "
                f"| {_num(s['compile_cpu_ms_p50'], 1)} / {_num(s['compile_cpu_ms_p99'], 1)} "
                f"| {s['instances']} ({s['rejected']}) | {s['tokens']:,} "
                f"| {_num(s['token_us_p50'], 1)} / {_num(s['token_us_p99'], 1)} "
                f"| {_num(s['step_us_p50'])} / {_num(s['step_us_p99'])} "
                f"| {_num(s['step_cpu_us_p50'])} / {_num(s['step_cpu_us_p99'])} |"
                + (f" {_pct(s.get('share_p50'))} / {_pct(s.get('share_p99'))} |" if share else ""))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------------------------
# the measurement (in a worker)
# --------------------------------------------------------------------------------------------

def walk(matcher: Any, ids: Sequence[int], k: int, bitmask: Any, clock: Any = time.perf_counter_ns,
         cpu_clock: Any = time.thread_time_ns) -> tuple[list[float], list[float], list[float], int | None]:
    """Speculative-step mask work along `ids` (the last one a stop token).

    Returns per-row µs, per-full-step µs ((k+1) rows) in wall time and in this thread's CPU time
    (which leaves out time the thread was preempted by other processes), and the index of the
    first token the matcher rejected (None if all were accepted).
    """
    rows: list[float] = []
    steps: list[float] = []
    steps_cpu: list[float] = []
    n = len(ids)
    for i in range(n):
        r = min(k + 1, n - i)
        c_step = cpu_clock()
        t_step = clock()
        fork = matcher.fork()
        t = clock()
        fork.fill_bitmask(bitmask, 0)
        now = clock()
        rows.append((now - t) / 1e3)
        done = 1
        for j in range(1, r):
            t = now
            if not fork.accept(ids[i + j - 1]):
                break  # the real matcher will reject it when it gets there
            fork.fill_bitmask(bitmask, j)
            now = clock()
            rows.append((now - t) / 1e3)
            done += 1
        if done == k + 1:
            steps_cpu.append((cpu_clock() - c_step) / 1e3)
            steps.append((now - t_step) / 1e3)
        if not matcher.accept(ids[i]):
            return rows, steps, steps_cpu, i
    return rows, steps, steps_cpu, None


class Context:
    """Per-worker state: grammar tokenizer data, the text tokenizer, warmed-up backends."""

    def __init__(self, vocab: tuple, tokenizer_file: str, backends: Sequence[str]) -> None:
        from tokenizers import Tokenizer

        from constrained_spec.grammar import clear_compile_cache, compile_spec
        from constrained_spec.schemas import normalize_schema

        self.tok = coverage.tokenizer_from_vocab(vocab)
        self.text_tok = Tokenizer.from_file(tokenizer_file)
        self.eos = self.tok.eos_token_ids[0]
        # build the per-tokenizer objects (compiler, outlines Vocabulary) outside the timings
        warm = normalize_schema({"type": "object", "properties": {"a": {"type": "string"}}})
        for backend in backends:
            compile_spec(warm, self.tok, backend=cast("Literal['xgrammar', 'outlines']", backend), timeout_s=None)
        clear_compile_cache()

    def encode(self, text: str) -> tuple[list[int], bool]:
        """Token ids of `text` (no special tokens) and whether they decode back to it."""
        ids = self.text_tok.encode(text, add_special_tokens=False).ids
        return ids, b"".join(self.tok.decoded[i] for i in ids) == text.encode("utf-8")


WALL_FACTOR = 6  # a compile gives up after this many times its CPU limit in wall time too


def compile_within(spec: Any, tok: Any, backend: str, cpu_limit: float, poll_s: float = 0.05) -> Any:
    """``compile_spec`` that gives up (TimeoutError) once this process has spent `cpu_limit`
    seconds of CPU time on it, or after ``WALL_FACTOR * cpu_limit`` seconds of wall time.

    CPU time, because on a shared machine a wall-clock limit would mostly measure the other
    processes. ``compile_spec`` keeps a timed-out compile running and pending in its cache, so
    asking again every `poll_s` waits for the same compile; it returns as soon as it is done.
    """
    from constrained_spec.errors import SchemaError
    from constrained_spec.grammar import compile_spec

    t0, c0 = time.perf_counter(), time.process_time()
    while True:
        try:
            return compile_spec(spec, tok, backend=cast("Literal['xgrammar', 'outlines']", backend), timeout_s=poll_s)
        except SchemaError as exc:
            if "took longer than" not in str(exc):
                raise
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        if cpu > cpu_limit or wall > WALL_FACTOR * cpu_limit:
            raise TimeoutError(f"gave up after {cpu:.1f} s CPU, {wall:.1f} s wall")


def measure(ctx: Context, schema: Any, instances: list[list[int]], backend: str,
            time_limit: float, k: int) -> dict:
    """Cold compile of `schema` on `backend`, then the speculative walk of every instance."""
    import numpy as np
    import torch

    from constrained_spec.errors import SchemaError
    from constrained_spec.grammar import clear_compile_cache
    from constrained_spec.schemas import normalize_schema

    clear_compile_cache()
    try:
        spec = normalize_schema(schema)
    except SchemaError as exc:
        return {"status": "malformed", "error": coverage._short(exc)}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        compiled = compile_within(spec, ctx.tok, backend, time_limit)
    except (SchemaError, TimeoutError) as exc:
        return {"status": "timeout" if isinstance(exc, TimeoutError) else "error",
                "error": coverage._short(exc), "compile_ms": 1e3 * (time.perf_counter() - t0),
                "compile_cpu_ms": 1e3 * (time.process_time() - c0)}
    compile_ms = 1e3 * (time.perf_counter() - t0)
    compile_cpu_ms = 1e3 * (time.process_time() - c0)
    bitmask = torch.empty((k + 1, (ctx.tok.vocab_size + 31) // 32), dtype=torch.int32)
    rows: list[float] = []
    steps: list[float] = []
    steps_cpu: list[float] = []
    rejected = tokens = 0
    t1 = time.perf_counter()
    for ids in instances:
        r, s, c, at = walk(compiled.new_matcher(), ids + [ctx.eos], k, bitmask)
        rows += r
        steps += s
        steps_cpu += c
        tokens += len(ids) + 1 if at is None else at
        rejected += at is not None
    walk_s = time.perf_counter() - t1
    clear_compile_cache()
    return {"status": "compiled", "compile_ms": compile_ms, "compile_cpu_ms": compile_cpu_ms,
            "walk_s": walk_s,
            "instances": len(instances), "rejected": rejected, "tokens": tokens,
            **{key: np.asarray(v, dtype=np.float32) for key, v in
               (("row_us", rows), ("step_us", steps), ("step_cpu_us", steps_cpu))}}


def _worker_main(conn: Any, vocab: tuple, tokenizer_file: str, backends: tuple[str, ...],
                 limits: dict[str, float], k: int, quiet_stderr: bool) -> None:
    import warnings

    import torch

    if quiet_stderr:  # xgrammar's C++ warnings about dropped keywords
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ctx = Context(vocab, tokenizer_file, backends)
    conn.send(("ready", None, None, None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, row = msg
        retire = False
        instances: list[list[int]] = []
        mismatched = 0
        try:
            for t in coverage.prepare_tests(row["schema"], row["tests"]):
                if t["valid"]:
                    ids, same = ctx.encode(t["text"])
                    instances.append(ids)
                    mismatched += not same
        except Exception:  # noqa: BLE001 - an instance the layout helpers cannot write: compile time only
            instances = []
        for backend in backends:
            try:
                result = measure(ctx, row["schema"], instances, backend, limits[backend], k)
            except Exception as exc:  # noqa: BLE001 - a bug in a backend / in this script: recorded
                result = {"status": "crash", "error": coverage._short(exc)}
            result["untokenizable"] = mismatched
            retire |= result.get("status") == "timeout"
            conn.send(("part", index, backend, result))
        conn.send(("done", index, None, retire))
        if retire:  # an abandoned compile thread would keep a core busy: start afresh
            conn.close()
            os._exit(0)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

def select_rows(splits: list[str], *, limit: int | None = None, sample: int | None = None,
                seed: int = 0, bench_dir: Path = coverage.BENCH_DIR) -> list[dict]:
    """The schemas to run: every split's rows (a seeded `limit` per split), then a seeded
    `sample` of all of them (file order kept)."""
    rows = [{**row, "split": split} for split in splits
            for row in coverage.sample_rows(coverage.load_split(split, bench_dir), limit, seed)]
    if sample is not None and sample < len(rows):
        picked = sorted(random.Random(seed).sample(range(len(rows)), sample))
        rows = [rows[i] for i in picked]
    return rows


def tokenizer_file() -> Path:
    """The embedded model's ``tokenizer.json`` (fetching / converting the model once if needed)."""
    from constrained_spec.model.embedded import converted_default_dir

    return converted_default_dir(quiet=False) / "tokenizer.json"


def run(rows: list[dict], *, backends: tuple[str, ...] = BACKENDS, k: int = K,
        limits: dict[str, float], workers: int | None = None, progress: bool = True,
        loads: list[float] | None = None) -> list[dict]:
    """Measure every row on every backend; one record per schema, in the order of `rows`.
    `loads` gets the 1-minute load average as each schema finishes."""
    from tqdm.auto import tqdm

    tok_file = tokenizer_file()
    vocab = coverage.tokenizer_vocab("embedded")
    tasks = list(enumerate(rows))
    records: list[dict | None] = [None] * len(rows)
    bar = tqdm(total=len(rows), desc="schemas", unit="schema", disable=not progress, file=sys.stderr)

    def on_done(task: tuple[int, dict], parts: dict) -> None:
        index, row = task
        records[index] = {"id": row["id"], "split": row["split"],
                          "results": {b: parts.get(b, {"status": "crash", "error": "no result"})
                                      for b in backends}}
        if loads is not None:
            loads.append(os.getloadavg()[0])
        bar.update(1)

    pool = Pool(min(workers or os.cpu_count() or 1, max(1, len(rows))), _worker_main,
                (vocab, str(tok_file), backends, limits, k, True), backends,
                hard_limit=WALL_FACTOR * sum(limits[b] for b in backends) + 120.0,
                preload=WORKER_PRELOAD)
    try:
        pool.run(tasks, on_done)
    finally:
        pool.close()
        bar.close()
    return [r for r in records if r is not None]


def measure_forward(k: int, threads: int, context: int = 200, repeats: int = 30) -> dict[str, Any]:
    """ms of a 1-token and a (k+1)-token target forward of the embedded model: the median, and
    the minimum (``ms_1``, ``ms_{k+1}``: what it costs when no other process takes the cores)."""
    import statistics

    import torch

    from constrained_spec.model.loading import load_model

    torch.set_num_threads(threads)
    model = load_model(None, quiet=True)
    runner = model.runner
    slot = runner.new_slot()
    runner.forward([slot], [list(range(1000, 1000 + context))], [1])
    out: dict[str, Any] = {"dtype": str(model.dtype).removeprefix("torch."), "threads": threads,
                           "context": context, "repeats": repeats,
                           "int4": getattr(model, "_int4", None) is not None}
    for n in (1, k + 1):
        times = []
        for _ in range(repeats + 3):
            runner.truncate(slot, context)
            t0 = time.perf_counter()
            runner.forward([slot], [[1234] * n], [n])
            times.append(time.perf_counter() - t0)
        out[f"ms_{n}"] = 1e3 * min(times[3:])
        out[f"ms_{n}_median"] = 1e3 * statistics.median(times[3:])
    runner.free_slot(slot)
    return out


def _strip_arrays(records: list[dict]) -> list[dict]:
    """Records for the --json file: per-schema percentiles instead of the sample arrays."""
    out = []
    for r in records:
        results = {}
        for backend, x in r["results"].items():
            x = dict(x)
            row_us, step_us = x.pop("row_us", ()), x.pop("step_us", ())
            step_cpu_us = x.pop("step_cpu_us", ())
            if x.get("status") == "compiled":
                x["token_us_p50"], x["token_us_p99"] = percentiles(row_us)
                x["step_us_p50"], x["step_us_p99"] = percentiles(step_us)
                x["step_cpu_us_p50"], x["step_cpu_us_p99"] = percentiles(step_cpu_us)
                x["rows"], x["steps"] = len(row_us), len(step_us)
            results[backend] = x
        out.append({**r, "results": results})
    return out


def _no_nan(value: Any) -> Any:
    """`value` with NaN floats as None (JSON has no NaN)."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def render(meta: dict[str, Any], table: dict, forward: dict[str, Any]) -> str:
    """The RESULTS.md section: how it was run, on what, then the tables."""
    k = meta["k"]
    load = meta["load"]
    if forward["source"] == "measured":
        fwd = (f"{forward['ms_1']:.1f} ms for 1 token, {forward[f'ms_{k + 1}']:.1f} ms for {k + 1} "
               f"(fastest of {forward['repeats']}; medians {forward['ms_1_median']:.1f} / "
               f"{forward[f'ms_{k + 1}_median']:.1f} ms; {forward['dtype']}"
               f"{' with exact int4 weights' if forward.get('int4') else ''}, {forward['threads']} "
               f"thread{'s' if forward['threads'] != 1 else ''}, {forward['context']}-token KV cache, load average "
               f"{forward['load']:.1f} when measured)")
    else:
        fwd = f"{forward['ms_1']:.1f} ms (given: --forward-ms)"
    notes = (
        f"`{meta['command']}` — {meta['n']} schemas ({meta['chosen']}) from "
        f"{', '.join(meta['splits'])}; K = {k} ({k + 1} masks per step); compile limit "
        f"{meta['limits']['xgrammar']:g} s xgrammar, {meta['limits']['outlines']:g} s outlines-core "
        f"(CPU time; wall-clock cap {WALL_FACTOR}x); {meta['workers']} worker processes; "
        f"wall time {meta['wall_s'] / 60:.1f} min; "
        f"1-minute load average during the run {_num(load[1], 1)} (median; "
        f"{_num(load[0], 1)}-{_num(load[2], 1)}) on {meta['cpus']} CPUs.\n\n"
        f"Hardware: {meta['processor']}, {meta['cpus']} CPUs; "
        + ", ".join(f"{name} {v}" for name, v in meta["versions"].items())
        + f"; tokenizer: {meta['tokenizer']}. Target forward: {fwd}; share = {k + 1} masks (CPU) "
        "/ 1-token forward.\n\n"
        "Compile: normalize + `compile_spec` on a cleared cache, in wall time and in the worker "
        "process's CPU time (all its threads); failed = malformed for our layer or the backend "
        "cannot compile it, timeouts = past the limit; neither is in the percentiles. Per token: "
        f"one row (the fork's accept + `fill_bitmask`). {k + 1} masks: fork + {k} accepts + "
        f"{k + 1} fills of one step, full steps only; CPU = the thread's CPU time (leaves out "
        "preemption by other processes). Percentiles pool every row / step of a split. "
        "Instances: the valid test instances walked (rejected: the grammar refused one of its "
        "tokens; walked up to there). Rules in the script's docstring.")
    return notes + "\n\n" + format_table(table, k, coverage.SPLITS)


def _shown_command(argv: list[str]) -> str:
    """The command as run, less where its outputs went (no machine paths in RESULTS.md)."""
    shown, skip = [], False
    for a in argv:
        if skip or a.split("=")[0] in ("--json", "--write-results", "--from-json"):
            skip = not skip and "=" not in a
            continue
        shown.append(a)
    return " ".join(["python -m benchmarks.grammar", *shown])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", default=",".join(coverage.SPLITS),
                        help="comma-separated splits (default: all nine)")
    parser.add_argument("--limit", type=int, default=None,
                        help="a seeded sample of N schemas per split (default: all)")
    parser.add_argument("--sample", type=int, default=None,
                        help="a seeded sample of N schemas over the chosen splits")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (--limit, --sample)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated subset of xgrammar,outlines")
    parser.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=K,
                        help=f"draft length K: K+1 masks per step (default: {K})")
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="per-schema compile limit in CPU seconds, xgrammar (default: 10)")
    parser.add_argument("--outlines-time-limit", type=float, default=5.0,
                        help="the same for outlines-core (default: 5; its Index builds that do not "
                             "finish in seconds often run for minutes)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: CPUs)")
    parser.add_argument("--forward-ms", type=float, default=None,
                        help="the 1-token target forward in ms (default: measured after the sweep)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the forward measurement (default: 1; with 2 on a "
                             "shared 2-core machine most forwards stall on the busy core)")
    parser.add_argument("--bench-dir", type=Path, default=coverage.BENCH_DIR)
    parser.add_argument("--json", type=Path, default=None,
                        help="write the run's summary and per-schema records here")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="no sweep: render an earlier --json file, with the forward measured "
                             "now (or --forward-ms)")
    parser.add_argument("--write-results", type=Path, default=None,
                        help="replace this benchmark's section of a markdown file (RESULTS.md)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    def save(forward: dict | None) -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_no_nan({
            "meta": meta, "forward": forward, "summary": table, "records": records,
        }), ensure_ascii=False, indent=1), encoding="utf-8")

    if args.from_json:
        saved = json.loads(args.from_json.read_text(encoding="utf-8"))
        meta, table = saved["meta"], saved["summary"]
    else:
        meta, table, records = sweep(parser, args, sys.argv[1:] if argv is None else argv)
        records = _strip_arrays(records)
        if args.json:  # before the forward is measured: the sweep is the long part
            save(None)
    if args.forward_ms:
        forward: dict[str, Any] = {"ms_1": args.forward_ms, "source": "--forward-ms"}
    else:
        forward = {**measure_forward(meta["k"], args.threads), "source": "measured",
                   "load": os.getloadavg()[0]}
    table = with_shares(table, forward["ms_1"])
    body = render(meta, table, forward)
    print(body)
    if args.json and not args.from_json:
        save(forward)
    if args.write_results:
        write_section(args.write_results, RESULTS_HEADING, body)
    return 0


def sweep(parser: argparse.ArgumentParser, args: argparse.Namespace,
          argv: list[str]) -> tuple[dict[str, Any], dict, list[dict]]:
    """Run the measurement the arguments ask for: (meta, summary table, records)."""
    from importlib.metadata import version

    import torch

    splits = [s for s in args.splits.split(",") if s]
    unknown = [s for s in splits if not (args.bench_dir / f"{s}.jsonl.gz").exists()]
    if unknown:
        parser.error(f"no data for splits {unknown} in {args.bench_dir}")
    backends = tuple(b for b in args.backends.split(",") if b)
    if not backends or any(b not in BACKENDS for b in backends):
        parser.error(f"--backends: choose from {', '.join(BACKENDS)}")
    if args.k < 0:
        parser.error("-k must be >= 0")
    rows = select_rows(splits, limit=args.limit, sample=args.sample, seed=args.seed,
                       bench_dir=args.bench_dir)
    limits = {"xgrammar": args.time_limit, "outlines": args.outlines_time_limit}
    workers = min(args.workers or os.cpu_count() or 1, max(1, len(rows)))
    loads: list[float] = []
    t0 = time.perf_counter()
    records = run(rows, backends=backends, k=args.k, limits=limits, workers=workers,
                  progress=not args.quiet, loads=loads)
    wall = time.perf_counter() - t0
    picks = [f"a seeded sample of {args.limit} per split" if args.limit else "",
             f"a seeded sample of {args.sample}" if args.sample else ""]
    meta = {
        "command": _shown_command(argv), "n": len(records), "splits": splits, "k": args.k,
        "chosen": ", ".join(filter(None, picks)) + f" (seed {args.seed})" if any(picks)
        else "all schemas",
        "limits": limits, "workers": workers, "wall_s": wall,
        "load": percentiles(loads, (0, 50, 100)), "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "versions": {"python": platform.python_version(), "xgrammar": version("xgrammar"),
                     "outlines-core": version("outlines_core"), "torch": torch.__version__},
        "tokenizer": coverage.tokenizer_vocab("embedded")[0],
    }
    return meta, summarize(records, backends), records


if __name__ == "__main__":
    sys.exit(main())
