"""Which JSON layout does the embedded model write on its own, and which one completes more often?

Part 1 (natural layout): for every JSON task of the benchmark, the model answers WITHOUT a
grammar (greedy, the library's default system message describing the schema, the task's
prompt) and the first JSON object in its answer is classified: one line or indented (how many
spaces), item and key separators, inside a markdown fence or not.

Part 2 (completion rate): the same tasks under the grammar, greedy, speculation on (the
default drafters), once per candidate layout: compact one-line JSON and the indented layout(s)
the model wrote in part 1. "completed" = finished within the task's max_tokens AND valid
against the task's schema. "clean end" = every completed output is exactly
``layout.dumps(value)``: the grammar stopped where the JSON ended, nothing trails it.

Part 3 (``--parts bench``): the same comparison on the seeded JSONSchemaBench sample of
``benchmarks/validity.py`` (real-world schemas, outcomes classified as there).

    python -m benchmarks.layout [--tasks FILE.jsonl] [--limit N] [--out benchmarks/RESULTS.md]
    python -m benchmarks.layout --parts bench --bench-limit 48 --indents 2 --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks._results import write_section
from benchmarks.speculation import DEFAULT_TASKS, hardware
from constrained_spec import Generator, IncompleteOutputError, JsonLayout, load_model
from constrained_spec.frontend.prompts import describe_schema
from constrained_spec.schemas import normalize_schema

FREE_MAX_TOKENS = 160  # enough to see the layout of the first object: its first lines
_ITEM_SEP = re.compile(r'(?<=["\d\]}el]),( ?\n?)(?=\s*["\d\[{tfn-])')


def classify(text: str) -> dict:
    """The layout of the first JSON object in a free answer."""
    start = text.find("{")
    if start < 0:
        return {"layout": "no JSON object"}
    body = text[start:]
    fenced = "```" in text[:start]
    keysep = ": " if '": ' in body else ('":' if '":' in body else None)
    if body[1:2] == "\n":
        line = body[2:].split("\n", 1)[0]
        if line.startswith("\t"):
            label = "indented, tabs"
        else:
            indent = len(line) - len(line.lstrip(" "))
            trailing = ", \n" in body
            label = f"indent {indent}" + (", trailing space before newlines" if trailing else "")
        return {"layout": label, "fenced": fenced, "key_separator": keysep}
    seps = Counter("," + m.group(1) for m in _ITEM_SEP.finditer(body.split("\n", 1)[0]))
    item = seps.most_common(1)[0][0] if seps else None
    label = "one line" + (f", item separator {item!r}" if item is not None else "")
    return {"layout": label, "fenced": fenced, "key_separator": keysep}


def indent_of(label: str) -> int | None:
    m = re.fullmatch(r"indent (\d+)", label)
    return int(m.group(1)) if m else None


def natural_layouts(model, tasks: list[dict]) -> list[dict]:
    """Part 1: free greedy answers with the default system message, classified."""
    gen: Generator[Any] = Generator(model, max_tokens=FREE_MAX_TOKENS)
    prompts = [[{"role": "system", "content": describe_schema(normalize_schema(t["schema"]))},
                {"role": "user", "content": t["prompt"]}] for t in tasks]
    out = gen.batch(prompts, return_result=True)
    rows = []
    for t, r in zip(tasks, out):
        text = r.text if hasattr(r, "text") else getattr(r, "partial_text", "")
        rows.append({"task": t["id"], "text": text, **classify(text)})
    return rows


def completion(model, tasks: list[dict], layout: JsonLayout) -> dict:
    """Part 2: constrained greedy runs in ``layout`` (one batch of all tasks)."""
    gen: Generator[Any] = Generator(model, layout=layout)
    t0 = time.perf_counter()
    out = gen.batch([t["prompt"] for t in tasks], schemas=[t["schema"] for t in tasks],
                    return_result=True, max_tokens=max(t["max_tokens"] for t in tasks))
    wall = time.perf_counter() - t0
    completed, incomplete, invalid, clean, tokens, forwards = [], [], [], 0, 0, 0
    for t, r in zip(tasks, out):
        stats = getattr(r, "stats", None)
        if stats is not None:
            tokens += stats.emitted_tokens
            forwards += stats.target_forwards
        if isinstance(r, IncompleteOutputError):
            incomplete.append((t["id"], r.partial_text[-60:]))
        elif isinstance(r, BaseException):
            invalid.append((t["id"], str(r)[:80]))
        else:
            completed.append(t["id"])
            clean += r.text == layout.dumps(json.loads(r.text))
    return {"completed": completed, "incomplete": incomplete, "invalid": invalid, "clean": clean,
            "tokens": tokens, "forwards": forwards, "wall": wall}


def name(layout: JsonLayout) -> str:
    if layout.indent is None:
        return f"compact, separators {layout.separators!r}"
    return f"indent {layout.indent}, separators {layout.separators!r}"


def bench_completion(model, layout: JsonLayout, n: int, batch_size: int = 8,
                     max_tokens: int = 256) -> dict:
    """Part 3: the seeded JSONSchemaBench sample of ``validity.py``, run in ``layout``."""
    from benchmarks import validity

    rows = validity.sample_schemas(n, 0, list(validity.SPLITS))
    gen: Generator[Any] = Generator(model, layout=layout, max_tokens=max_tokens)
    records: list[dict] = []
    t0 = time.perf_counter()
    for start in range(0, len(rows), batch_size):
        records += validity.run_batch(gen, rows[start:start + batch_size], max_tokens)
    summary = validity.summarize(records)
    summary["wall"] = time.perf_counter() - t0
    return summary


def section_tasks(model, tasks: list[dict], natural: list[dict] | None,
                  candidates: list[JsonLayout]) -> str:
    n = len(tasks)
    lines = [f"`python -m benchmarks.layout` — the {n} JSON tasks of `benchmarks/data/tasks.jsonl`, "
             f"embedded model ({model.dtype}), greedy. Hardware: {hardware()}.", ""]
    if natural is not None:
        counts = Counter(r["layout"] for r in natural)
        fenced = sum(bool(r.get("fenced")) for r in natural)
        keyseps = Counter(r.get("key_separator") for r in natural if r.get("key_separator"))
        lines += [f"**What the model writes without a grammar** (default system message, first "
                  f"{FREE_MAX_TOKENS} tokens of a free answer):", "",
                  "| layout of the first JSON object | tasks |", "| --- | ---: |"]
        lines += [f"| {label} | {c} |" for label, c in counts.most_common()]
        lines += ["", f"In a markdown fence: {fenced} of {n}; key separator: "
                  + ", ".join(f"{k!r} {v}" for k, v in keyseps.most_common()) + ".", ""]
    results = {name(c): completion(model, tasks, c) for c in candidates}
    lines += ["**Under the grammar** (speculation on: forced + n-gram; completed = finished within "
              "max_tokens and valid; clean end = every completed output is exactly the layout's "
              "`json.dumps`, nothing after the closing brace):", "",
              "| layout | completed | incomplete (max_tokens) | invalid | clean end | tokens emitted "
              "| acceptance length | wall s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in results.items():
        lines.append(f"| {label} | {len(r['completed'])} / {n} | {len(r['incomplete'])} | "
                     f"{len(r['invalid'])} | {r['clean']} / {len(r['completed'])} | {r['tokens']} | "
                     f"{r['tokens'] / max(r['forwards'], 1):.2f} | {r['wall']:.0f} |")
    lines.append("")
    for label, r in results.items():
        if r["incomplete"] or r["invalid"]:
            lines.append(f"- {label}: not completed: "
                         + "; ".join(f"{tid} (…{tail!r})" for tid, tail in r["incomplete"])
                         + "; ".join(f"{tid} ({msg})" for tid, msg in r["invalid"]))
    return "\n".join(lines)


def section_bench(model, candidates: list[JsonLayout], n: int) -> str:
    lines = [f"`python -m benchmarks.layout --parts bench --bench-limit {n}` — the seeded "
             f"JSONSchemaBench sample of `benchmarks/validity.py` ({n} schemas drawn with seed 0, prompt "
             f"\"Generate a JSON object for: ...\"), embedded model ({model.dtype}), greedy, "
             f"speculation on, max_tokens 256, batches of 8. Hardware: {hardware()}.", "",
             "| layout | valid | incomplete (max_tokens) | invalid (declared) | invalid (silent) "
             "| refused | tokens emitted | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in candidates:
        s = bench_completion(model, c, n)
        print(f"{name(c)}: {s}", file=sys.stderr)
        lines.append(f"| {name(c)} | {s['valid']} / {s['n']} | {s['incomplete']} | "
                     f"{s['invalid_declared']} | {s['invalid_silent']} | {s['refused']} | "
                     f"{s['tokens']} | {s['wall']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--parts", default="free,tasks",
                    help="comma-separated: free (part 1), tasks (part 2), bench (part 3)")
    ap.add_argument("--bench-limit", type=int, default=64, help="JSONSchemaBench schemas (part 3)")
    ap.add_argument("--indents", default=None,
                    help="indents to compare with compact JSON, e.g. 2,4 (default: part 1's)")
    ap.add_argument("--out", type=Path, default=None, help="replace the sections in this markdown file")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    tasks = [t for t in tasks if t["kind"] == "json_schema"][: args.limit]
    model = load_model(None, quiet=True)

    natural = natural_layouts(model, tasks) if "free" in parts else None
    if args.indents:
        indents = [int(i) for i in args.indents.split(",")]
    elif natural is not None:
        for r in natural:
            print(f"{r['task']}: {r['layout']} | {r['text'][:80]!r}", file=sys.stderr)
        counts = Counter(r["layout"] for r in natural)
        indents = [i for i in (indent_of(label) for label, _ in counts.most_common()) if i is not None][:2]
    else:
        indents = [2, 4]
    candidates = [JsonLayout()] + [JsonLayout(indent=i) for i in indents]
    if "free" in parts or "tasks" in parts:
        text = section_tasks(model, tasks, natural, candidates if "tasks" in parts else [])
        print(text)
        if args.out:
            write_section(args.out, "## JSON layout on the embedded model", text)
    if "bench" in parts:
        text = section_bench(model, candidates, args.bench_limit)
        print(text)
        if args.out:
            write_section(args.out, "## JSON layout on JSONSchemaBench schemas", text)


if __name__ == "__main__":
    main()
