"""Repetition-loop detection offline (``constrained_spec/loops.py``): false positives on valid
outputs and tokens saved on looping ones, with the embedded model's tokenizer (no forward pass).

- False positives: every valid instance of the JSONSchemaBench splits in ``../shared/bench``
  (the ``tests`` marked valid), written in the default layout (compact JSON) and tokenized; an
  instance on which the detector fires would have been stopped although it is a valid answer.
  With ``--outputs FILE`` (a ``benchmarks/levers.py --dump`` file) the completed outputs in it
  are checked too.
- Tokens saved: looping outputs shaped like the loops the embedded model fell into on the
  benchmark tasks (``RESULTS.md``, "JSON layout on the embedded model"): a plausible prefix,
  then the repeated unit until max_tokens; saved = max_tokens - the token at which the detector
  stops the attempt. With ``--outputs``, the incomplete outputs in it are measured the same way.

    python benchmarks/loops.py [--outputs FILE.json] [--max-tokens 256,512]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from constrained_spec.generation.loops import MAX_PERIOD, MIN_LENGTH, MIN_REPEATS, find_loop
from constrained_spec.schemas import JsonLayout

BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench" / "jsonschemabench"

# (name, prefix, repeated unit): the loops seen on the benchmark tasks, rebuilt as text
LOOPS = [
    ("digits in a string (order_create)", '{"order_id": "ORD-', "0123456789"),
    ("version dots (github_issue)", '{"title": "Crash on start", "version": "1.', ".1"),
    ("a phrase (book_create)", '{"title": "The Will", "summary": "A tale of the unyielding',
     " will of the unyielding, a tale of the unyielding"),
    ("the same array item (invoice_extract)", '{"invoice": "INV-7", "items": [',
     '{"description": "2024-03-14", "quantity": 2, "unit_price": 2024}, '),
    ("list items cycling (job_post)", '{"title": "Engineer", "skills": ["Python", ',
     '"C#", "Java", "JavaScript", '),
    ("a sentence in a step list (recipe_create)", '{"name": "Pancakes", "steps": [',
     '"Serve 12 pancakes with maple butter and cinnamon.", '),
]


def embedded_tokenizer():
    from transformers import AutoTokenizer

    from constrained_spec.model.embedded import converted_default_dir

    return AutoTokenizer.from_pretrained(str(converted_default_dir(quiet=True)))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def valid_instances() -> Iterator[tuple[str, dict, Any]]:
    """(split, schema row, instance) of every valid test instance of JSONSchemaBench."""
    for path in sorted(BENCH.glob("*.jsonl.gz")):
        split = path.name.split(".")[0]
        with gzip.open(path, "rt") as f:
            for line in f:
                row = json.loads(line)
                for test in row.get("tests") or []:
                    if test.get("valid"):
                        yield split, row, test["data"]


def false_positives(tok) -> tuple[list[str], list[str]]:
    layout = JsonLayout()
    rows: list[str] = []
    hits: list[str] = []
    total: Counter[str] = Counter()  # valid instances per split
    fired: Counter[str] = Counter()
    for split, row, data in valid_instances():
        total[split] += 1
        loop = find_loop(encode(tok, layout.dumps(data)))
        if loop is not None:
            fired[split] += 1
            hits.append(f"{split} {row.get('description', '')[-40:]}: period "
                        f"{loop.period}, span {loop.length} tokens")
    rows.append("| split | valid instances | detector fired (false positives) |")
    rows.append("| --- | ---: | ---: |")
    for split in total:
        rows.append(f"| {split} | {total[split]} | {fired[split]} |")
    rows.append(f"| **all** | {sum(total.values())} | {sum(fired.values())} |")
    return rows, hits


def saved_row(name: str, ids: list[int], max_tokens: int) -> str:
    ids = ids[:max_tokens]
    loop = find_loop(ids)
    if loop is None:
        return f"| {name} | {max_tokens} | not detected | - | 0 |"
    stop = loop.start + loop.length
    return (f"| {name} | {max_tokens} | {loop.period} tokens x {loop.repeats:.1f} from token "
            f"{loop.start} | {stop} | {max_tokens - stop} ({100 * (max_tokens - stop) / max_tokens:.0f}%) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, default=None, help="a benchmarks/levers.py --dump file")
    ap.add_argument("--max-tokens", default="256,512")
    args = ap.parse_args()
    tok = embedded_tokenizer()
    print(f"Rule: periods 1..{MAX_PERIOD} tokens, span >= {MIN_LENGTH} tokens and >= "
          f"{MIN_REPEATS} copies of the unit (constrained_spec/loops.py).\n")
    if BENCH.exists():
        rows, hits = false_positives(tok)
        print("False positives on valid JSONSchemaBench instances (compact layout):\n")
        print("\n".join(rows))
        for h in hits:
            print(f"- {h}")
        print()
    else:
        print(f"(JSONSchemaBench not found at {BENCH}: no false-positive count)\n", file=sys.stderr)
    print("Tokens saved on looping outputs:\n")
    print("| loop | max_tokens | detected | stopped at token | tokens saved |")
    print("| --- | ---: | --- | ---: | ---: |")
    budgets = [int(x) for x in args.max_tokens.split(",")]
    saved = spent = 0
    for name, prefix, unit in LOOPS:
        ids = encode(tok, prefix + unit * 200)
        for m in budgets:
            print(saved_row(name, ids, m))
            loop = find_loop(ids[:m])
            spent += m
            saved += m - (loop.start + loop.length) if loop else 0
    print(f"\nSynthetic loops: {saved} of {spent} tokens saved ({100 * saved / spent:.0f}%).")
    if args.outputs:
        dump = json.loads(args.outputs.read_text())
        fp, rows = 0, []
        for row_name, texts in dump.items():
            for task, (kind, text) in texts.items():
                ids = encode(tok, text)
                if kind == "ok" and find_loop(ids) is not None:
                    fp += 1
                    print(f"- false positive: {row_name} / {task}")
                elif kind == "incomplete":
                    rows.append(saved_row(f"{row_name} / {task}", ids, len(ids)))
        print(f"\nOutputs in {args.outputs.name}: {fp} false positives among completed outputs.\n")
        print("| incomplete output | tokens | detected | stopped at token | tokens saved |")
        print("| --- | ---: | --- | ---: | ---: |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
