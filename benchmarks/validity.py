"""End-to-end validity: generate with the embedded model for real-world JSON Schemas.

A seeded sample of JSONSchemaBench schemas (``--bench-dir``, as in coverage.py; the same
rows as ``coverage.py --limit``) is run through the public API exactly as a user would:
``Generator.batch`` with the library's defaults (default speculation, schema mode "default",
the default schema system message, greedy decoding) and the prompt

    Generate a JSON object for: <the schema's description, else its title, else its name>

Every schema ends in exactly one of:

* **valid**: a completed output, returned by the library, that also passes an independent
  jsonschema check here (the schema's draft, format checking);
* **incomplete**: ``IncompleteOutputError`` (``max_tokens`` ran out first; nothing truncated);
* **refused**: a typed error before any generation: ``SchemaError`` (pre-flight refused the
  schema in default mode, or it did not compile in time) or ``PromptTooLongError``;
* **invalid (declared)**: ``OutputValidationError`` where every violation is on a keyword the
  pre-flight report declared as not enforced (the rule of ``coverage.py``);
* **invalid (silent)**: ``OutputValidationError`` otherwise, or a returned value that fails the
  independent check -- a bug;
* **crash**: any other exception -- a bug.

Requests run ``--batch-size`` at a time in one engine batch (one target forward per step for
all of them); if a batch raises, its schemas are rerun one by one so the crash is attributed.

    python -m benchmarks.validity --limit 30                 # quick look
    python -m benchmarks.validity --limit 300 --out /tmp/validity.jsonl \\
        --write-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from benchmarks._results import write_section
from benchmarks.coverage import BENCH_DIR, SPLITS, Declarations, load_split, make_validator

RESULTS_HEADING = "## End-to-end validity"
OUTCOMES = ("valid", "incomplete", "refused", "invalid_declared", "invalid_silent", "crash")


def sample_schemas(n: int, seed: int, splits: list[str], bench_dir: Path = BENCH_DIR) -> list[dict]:
    """`n` rows drawn (seeded) from the union of `splits`, in a stable order."""
    import random

    rows = [{**row, "split": split} for split in splits for row in load_split(split, bench_dir)]
    picked = sorted(random.Random(seed).sample(range(len(rows)), min(n, len(rows))))
    return [rows[i] for i in picked]


def prompt_for(row: dict) -> str:
    """"Generate a JSON object for: ..." with the schema's description / title / name."""
    schema = row["schema"] if isinstance(row["schema"], dict) else {}
    what = schema.get("description") or schema.get("title")
    if not isinstance(what, str) or not what.strip():
        name = row["id"].split("---")[-1]
        what = re.sub(r"_[0-9a-f]{8}$", "", name).replace("_", " ")
    return f"Generate a JSON object for: {what.strip()}"


def classify_error(row: dict, exc: BaseException, pointers: list[str]) -> str:
    from constrained_spec.errors import (
        ConfigError,
        IncompleteOutputError,
        OutputValidationError,
        PromptTooLongError,
        SchemaError,
    )

    if isinstance(exc, IncompleteOutputError):
        return "incomplete"
    if isinstance(exc, (SchemaError, PromptTooLongError)):
        return "refused"
    if isinstance(exc, OutputValidationError):
        try:
            value = json.loads(exc.text)
        except ValueError:
            return "invalid_silent"
        errors = list(make_validator(row["schema"]).iter_errors(value))
        decl = Declarations(row["schema"], pointers)
        return "invalid_declared" if errors and all(decl.explains(e) for e in errors) else "invalid_silent"
    if isinstance(exc, ConfigError):
        return "refused"
    return "crash"


def check_value(row: dict, text: str) -> list[str]:
    """Independent check of a returned output: jsonschema errors (empty = valid)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return [f"not JSON: {exc}"]
    return [f"{'/'.join(map(str, e.absolute_path)) or '/'}: {e.message}"
            for e in make_validator(row["schema"]).iter_errors(value)]


def declared_pointers(schema: Any) -> list[str]:
    """The pre-flight report's issue pointers (xgrammar, the default backend)."""
    from constrained_spec.schemas import normalize_schema, preflight

    try:
        return [i.pointer for i in preflight(normalize_schema(schema), "xgrammar").issues]
    except Exception:
        return []


def record(row: dict, outcome: str, *, text: str | None = None, error: BaseException | None = None,
           stats: Any = None, seconds: float = 0.0) -> dict:
    rec: dict[str, Any] = {"id": row["id"], "split": row["split"], "outcome": outcome,
                           "seconds": round(seconds, 2)}
    if text is not None:
        rec["text"] = text
    if error is not None:
        rec["error_type"] = type(error).__name__
        rec["error"] = str(error)[:500]
        for attr in ("partial_text", "text"):
            if isinstance(getattr(error, attr, None), str):
                rec["text"] = getattr(error, attr)
        if outcome == "crash":
            rec["traceback"] = "".join(traceback.format_exception(error))[-3000:]
    if stats is not None:
        rec["emitted_tokens"] = getattr(stats, "emitted_tokens", None)
        rec["target_forwards"] = getattr(stats, "target_forwards", None)
    return rec


def run_batch(gen: Any, rows: list[dict], max_tokens: int) -> list[dict]:
    """One engine batch; every item classified (see the module docstring)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SchemaWarning per ignored keyword: the report has them
        results = gen.batch([prompt_for(r) for r in rows], schemas=[r["schema"] for r in rows],
                            return_result=True, max_tokens=max_tokens)
    seconds = (time.perf_counter() - t0) / max(1, len(rows))
    out = []
    for row, res in zip(rows, results):
        if isinstance(res, BaseException):
            outcome = classify_error(row, res, declared_pointers(row["schema"]))
            out.append(record(row, outcome, error=res, stats=getattr(res, "stats", None),
                              seconds=seconds))
            continue
        problems = check_value(row, res.text)
        rec = record(row, "valid" if not problems else "invalid_silent", text=res.text,
                     stats=res.stats, seconds=seconds)
        if problems:
            rec["error"] = "; ".join(problems)[:500]
        out.append(rec)
    return out


def run(rows: list[dict], *, max_tokens: int = 256, batch_size: int = 8, out: Path | None = None,
        progress: bool = True) -> list[dict]:
    from tqdm.auto import tqdm

    from constrained_spec import Generator
    from constrained_spec.model.loading import load_model

    loaded = load_model(None, quiet=not progress)
    gen: Generator[Any] = Generator(loaded, schema=None, max_tokens=max_tokens)
    records: list[dict] = []
    sink = out.open("w", encoding="utf-8") if out else None
    bar = tqdm(total=len(rows), desc="schemas", unit="schema", disable=not progress, file=sys.stderr)
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            try:
                recs = run_batch(gen, chunk, max_tokens)
            except Exception:  # a batch-level crash: rerun one by one to find the culprit
                recs = []
                for row in chunk:
                    try:
                        recs += run_batch(gen, [row], max_tokens)
                    except Exception as exc:  # noqa: BLE001 - recorded as a crash (a bug)
                        recs.append(record(row, "crash", error=exc))
            for rec in recs:
                records.append(rec)
                if sink:
                    sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    sink.flush()
            bar.update(len(chunk))
    finally:
        bar.close()
        if sink:
            sink.close()
    return records


def summarize(records: list[dict]) -> dict[str, Any]:
    n = len(records)
    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    completed = counts["valid"] + counts["invalid_declared"] + counts["invalid_silent"]
    return {"n": n, **counts, "completed": completed,
            "valid_of_completed": 100.0 * counts["valid"] / completed if completed else 0.0,
            "tokens": sum(r.get("emitted_tokens") or 0 for r in records),
            "seconds": sum(r.get("seconds") or 0 for r in records)}


def format_summary(records: list[dict], *, max_tokens: int, seed: int, batch_size: int,
                   wall_s: float) -> str:
    s = summarize(records)
    by_split: dict[str, list[dict]] = {}
    for r in records:
        by_split.setdefault(r["split"], []).append(r)
    lines = [
        f"Seeded sample of {s['n']} JSONSchemaBench schemas (seed {seed}, drawn from all splits), "
        "embedded model (SmolLM2-135M-Instruct), library defaults (default speculation, schema "
        f"mode default, greedy), max_tokens {max_tokens}, prompt \"Generate a JSON object for: "
        "<description / title / name>\" with the default schema system message; "
        f"`python -m benchmarks.validity --limit {s['n']}` (batches of {batch_size}).",
        "",
        "| split | schemas | valid | incomplete | refused (typed, before generating) "
        "| invalid, declared | invalid, silent | crash |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for split in [x for x in SPLITS if x in by_split] + ["all"]:
        rows = records if split == "all" else by_split[split]
        c = summarize(rows)
        name = "**all**" if split == "all" else split
        lines.append(f"| {name} | {c['n']} | {c['valid']} | {c['incomplete']} | {c['refused']} "
                     f"| {c['invalid_declared']} | {c['invalid_silent']} | {c['crash']} |")
    refused: dict[str, int] = {}
    for r in records:
        if r["outcome"] == "refused":
            refused[r.get("error_type", "?")] = refused.get(r.get("error_type", "?"), 0) + 1
    lines += [
        "",
        f"Completed outputs: {s['completed']}, of which {s['valid']} valid "
        f"({s['valid_of_completed']:.1f}%); incomplete (IncompleteOutputError): {s['incomplete']}; "
        f"refused: {s['refused']} ({', '.join(f'{k} {v}' for k, v in sorted(refused.items())) or 'none'}); "
        f"crashes: {s['crash']}. {s['tokens']:,} tokens in {wall_s / 60:.1f} min wall "
        f"({s['tokens'] / wall_s if wall_s else 0:.1f} tok/s overall, prefill included) on "
        f"{platform.machine()}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=300, help="schemas in the sample (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR)
    parser.add_argument("--out", type=Path, default=None, help="per-schema records as JSONL")
    parser.add_argument("--from-records", type=Path, default=None,
                        help="summarise an earlier --out file instead of running")
    parser.add_argument("--write-results", type=Path, default=None,
                        help="replace the validity section of this markdown file (RESULTS.md)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    if args.from_records:
        records = [json.loads(x) for x in args.from_records.read_text().splitlines() if x.strip()]
        wall = sum(r.get("seconds") or 0 for r in records)
    else:
        rows = sample_schemas(args.limit, args.seed, [s for s in args.splits.split(",") if s],
                              args.bench_dir)
        records = run(rows, max_tokens=args.max_tokens, batch_size=args.batch_size, out=args.out,
                      progress=not args.quiet)
        wall = time.perf_counter() - t0
    body = format_summary(records, max_tokens=args.max_tokens, seed=args.seed,
                          batch_size=args.batch_size, wall_s=wall)
    print(body)
    bugs = [r for r in records if r["outcome"] in ("invalid_silent", "crash")]
    for r in bugs:
        print(f"\nBUG {r['outcome']}: {r['id']}: {r.get('error_type', '')}: {r.get('error', '')}\n"
              f"  text: {r.get('text', '')[:300]!r}", file=sys.stderr)
    if args.write_results:
        write_section(args.write_results, RESULTS_HEADING, body)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
