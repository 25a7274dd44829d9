"""Effect of the opt-in output-quality levers on the embedded model (greedy, speculation on).

Each row is a set of ``Generator`` keyword arguments; all rows run the same JSON tasks of the
benchmark (one batch per row, the default layout and prompt). Reported per row: outputs that
completed (finished within max_tokens and valid), incomplete (max_tokens ran out: usually a
repetition loop), invalid (finished but failed final validation), tokens emitted (all
attempts), attempts (with retries), wall time, and on the extraction tasks
(``speculation.EXTRACTION``) the share of the completed outputs' leaf values found verbatim in
the prompt (``e2e.verbatim_fields``): a lever that completes outputs by bending what the model
copies shows up there. Tasks whose output changed from the first row
are listed, so a lever that "completes" an output by damaging it can be seen.

    python -m benchmarks.levers [--tasks FILE.jsonl] [--limit N] [--rows a,b]
                                [--out benchmarks/RESULTS.md] [--dump FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import write_section
from benchmarks.e2e import verbatim_fields
from benchmarks.speculation import DEFAULT_TASKS, EXTRACTION, hardware
from constrained_spec import (
    Generator,
    IncompleteOutputError,
    OutputValidationError,
    load_model,
)

ROWS: dict[str, dict] = {
    "default": {},
    "no_repeat_ngram_size=8": {"no_repeat_ngram_size": 8},
    "repetition_penalty=1.2": {"repetition_penalty": 1.2},
    "max_string_length=64, max_items=8": {"max_string_length": 64, "max_items": 8},
    "max_retries=1": {"max_retries": 1},
    "max_retries=2": {"max_retries": 2},
}


def run_row(model, tasks: list[dict], options: dict) -> dict:
    gen: Generator[Any] = Generator(model, **options)
    t0 = time.perf_counter()
    out = gen.batch([t["prompt"] for t in tasks], schemas=[t["schema"] for t in tasks],
                    return_result=True, max_tokens=max(t["max_tokens"] for t in tasks))
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"completed": 0, "incomplete": 0, "invalid": 0, "other": 0, "tokens": 0, "attempts": 0,
                           "verbatim": [0, 0], "wall": wall, "texts": {}}
    for t, r in zip(tasks, out):
        stats = getattr(r, "stats", None)
        row["tokens"] += stats.emitted_tokens if stats is not None else 0
        row["attempts"] += getattr(r, "attempts", 1)
        if isinstance(r, IncompleteOutputError):
            row["incomplete"] += 1
            row["texts"][t["id"]] = ("incomplete", r.partial_text)
        elif isinstance(r, OutputValidationError):
            row["invalid"] += 1
            row["texts"][t["id"]] = ("invalid", r.text)
        elif isinstance(r, BaseException):
            row["other"] += 1
            row["texts"][t["id"]] = ("error", str(r))
        else:
            row["completed"] += 1
            row["texts"][t["id"]] = ("ok", r.text)
            if t["id"] in EXTRACTION:
                hits, total = verbatim_fields(json.loads(r.text), t["prompt"])
                row["verbatim"][0] += hits
                row["verbatim"][1] += total
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="replace the section in this markdown file")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--dump", type=Path, default=None, help="write every output text to this JSON file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    tasks = [t for t in tasks if t["kind"] == "json_schema"][: args.limit]
    rows = {k: ROWS[k] for k in (args.rows.split(",") if args.rows else ROWS)}
    model = load_model(None, quiet=True)
    results = {}
    for name, options in rows.items():
        results[name] = run_row(model, tasks, options)
        r = results[name]
        print(f"{name}: {r['completed']}/{len(tasks)} completed, {r['wall']:.0f} s", file=sys.stderr)
    n = len(tasks)
    first = next(iter(results.values()))
    lines = [f"`python -m benchmarks.levers` — the {n} JSON tasks of `benchmarks/data/tasks.jsonl`, "
             f"embedded model ({model.dtype}), greedy, speculation on, default layout and prompt; one "
             f"batch per row. Hardware: {hardware()}.", "",
             "| options | completed | incomplete (max_tokens) | invalid | verbatim fields "
             "(extraction) | tokens emitted | attempts | outputs changed vs first row | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        changed = sum(r["texts"][tid] != first["texts"][tid] for tid in r["texts"])
        lines.append(f"| {name or 'default'} | {r['completed']} / {n} | {r['incomplete']} | "
                     f"{r['invalid'] + r['other']} | {100 * r['verbatim'][0] / max(r['verbatim'][1], 1):.0f}% "
                     f"({r['verbatim'][0]} / {r['verbatim'][1]}) | {r['tokens']} | {r['attempts']} | {changed} | "
                     f"{r['wall']:.0f} |")
    lines.append("")
    for name, r in results.items():
        fixed = [tid for tid, (kind, _) in r["texts"].items()
                 if kind == "ok" and first["texts"][tid][0] != "ok"]
        broken = [tid for tid, (kind, _) in r["texts"].items()
                  if kind != "ok" and first["texts"][tid][0] == "ok"]
        if fixed or broken:
            lines.append(f"- {name}: completes {', '.join(fixed) or 'none'} that the first row did "
                         f"not; loses {', '.join(broken) or 'none'}.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_section(args.out, "## Output quality levers on the embedded model", text)
    if args.dump:
        args.dump.write_text(json.dumps({k: v["texts"] for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
