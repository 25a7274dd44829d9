"""Retries that keep what was good, and failures found sooner (``retry_from``, loops.py).

Three parts, each printed as a markdown table:

* **retries** (default): the 24 shared tasks of ``benchmarks/data/tasks.jsonl`` with the
  library's defaults (greedy, speculation on, ``DEFAULT_MAX_RETRIES`` retries), one batch per
  row, once with ``retry_from="start"`` (a failed attempt generated again after a new prefill)
  and once with ``retry_from="resume"`` (continued from its last good point on the prompt's
  cache), the two rows alternating over ``--rounds`` rounds (medians of the wall times).
  Reported per row: valid (checked here: ``e2e.check_output``), verbatim fields of the
  extraction tasks (``e2e.verbatim_fields``), attempts, tokens emitted, **tokens spent on
  failed attempts** (the tokens each failed attempt emitted; a resumed attempt emits only
  what follows its kept prefix), prompt prefills, wall time and **valid objects per minute**.
* **observe** (``--observe``): the structural loop rule (loops.py) in observe-only mode. The
  shared tasks and ``--tool-requests`` requests of the tool benchmark (``benchmarks/tools.py``,
  BFCL tools, ``tool_choice="required"``) run greedy with no retries and with the loop
  detector as it was before the rule; the rule then replays each output's tokens. A **false
  stop** is the rule firing on an output that completed (the grammar's end reached): it would
  have cut an answer. Also the tokens the first failed attempts spent, with the rule's stop
  point where it fires.
* **spans** (``--spans``): the data behind the rule's threshold, on the valid instances of
  JSONSchemaBench (``../shared/bench``) in the default layout, the embedded model's tokenizer:
  periodic spans that repeat whole values (contain a quote) against those inside one string,
  and the longest string and array values in tokens (why no length-only "no progress" rule is
  safe at these budgets).

    python -m benchmarks.retries [--rounds 2] [--limit N] [--observe] [--spans]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e import check_output, verbatim_fields
from benchmarks.speculation import DEFAULT_TASKS, EXTRACTION, hardware, task_schema

#: rows: name -> (retry_from, the structural loop rule on); "before" is the library as it was:
#: from-start retries and the loop detector without the structural rule
MODES: dict[str, tuple[str, bool]] = {"before (start, no structural rule)": ("start", False),
                                      "start": ("start", True), "resume": ("resume", True)}


def _failed_tokens(result: Any) -> int:
    """Tokens emitted by the failed attempts behind ``result`` (all of them when it failed)."""
    earlier = getattr(result, "failed_attempts", [])
    spent = sum(e.stats.emitted_tokens for e in earlier if getattr(e, "stats", None) is not None)
    stats = getattr(result, "stats", None)
    if isinstance(result, BaseException) and stats is not None:
        return int(stats.emitted_tokens)  # the merged stats of every attempt
    return spent


def run_mode(model: Any, tasks: list[dict], name: str) -> dict[str, Any]:
    """One batch of ``tasks`` with the defaults and the row ``name`` of :data:`MODES`."""
    from constrained_spec import GenerationResult, Generator
    from constrained_spec.generation.loops import LoopDetector

    mode, structural = MODES[name]
    gen: Generator[Any] = Generator(model, retry_from=mode)  # type: ignore[arg-type]
    if not structural:  # this Generator's requests get the detector as it was
        gen._loop_detector = lambda spec: LoopDetector()  # type: ignore[method-assign]
    t0 = time.perf_counter()
    out = gen.batch([t["prompt"] for t in tasks], schemas=[task_schema(t) for t in tasks],
                    return_result=True, max_tokens=max(t["max_tokens"] for t in tasks))
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"valid": 0, "attempts": 0, "emitted": 0, "failed_tokens": 0,
                           "wasted": 0, "prefills": 0, "verbatim": [0, 0], "wall": wall,
                           "texts": {}}
    for task, res in zip(tasks, out):
        stats = getattr(res, "stats", None)
        row["emitted"] += stats.emitted_tokens if stats is not None else 0
        row["attempts"] += getattr(res, "attempts", 1)
        row["failed_tokens"] += _failed_tokens(res)
        # emitted but not in the returned output (a resumed retry's kept prefix is in it)
        kept = len(res.token_ids) if isinstance(res, GenerationResult) else 0
        row["wasted"] += (stats.emitted_tokens if stats is not None else 0) - kept
        row["prefills"] += _prefills(res, mode)
        text = res.text if isinstance(res, GenerationResult) else None
        row["texts"][task["id"]] = text
        if text is not None and check_output(task, text):
            row["valid"] += 1
            if task["id"] in EXTRACTION:
                hits, total = verbatim_fields(json.loads(text), task["prompt"])
                row["verbatim"][0] += hits
                row["verbatim"][1] += total
    return row


def _prefills(result: Any, mode: str) -> int:
    """Prompt prefills behind ``result``: the first attempt's, and each retry's but a resumed
    one (after a loop or max_tokens under ``retry_from="resume"``: its prompt is cached)."""
    from constrained_spec import IncompleteOutputError

    earlier = getattr(result, "failed_attempts", [])
    return 1 + sum(1 for e in earlier if mode == "start" or not isinstance(e, IncompleteOutputError))


def retries_table(model: Any, tasks: list[dict], rounds: int) -> str:
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    names = list(MODES)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):  # alternate the order per round
            rows[name].append(run_mode(model, tasks, name))
    n = len(tasks)
    lines = [f"`python -m benchmarks.retries --rounds {rounds}` -- {n} of the shared tasks, embedded "
             f"model ({model.dtype}), defaults (greedy, speculation on, 2 retries), one batch per "
             f"row, {rounds} rounds alternating the rows; wall = median. Hardware: {hardware()}.",
             "", "| retries | valid | verbatim fields (extraction) | attempts | tokens emitted "
             "| tokens on failed attempts | tokens not in the returned output | prompt prefills "
             "| wall s median [min, max] | valid objects / min |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, rs in rows.items():
        first = rs[0]  # greedy + seeded retries: every round gives the same outputs
        same = all(r["texts"] == first["texts"] for r in rs)
        walls = [r["wall"] for r in rs]
        wall = statistics.median(walls)
        hits, total = first["verbatim"]
        lines.append(f"| {mode} | {first['valid']} / {n} | {100 * hits / max(total, 1):.0f}% "
                     f"({hits} / {total}) | {first['attempts']} | {first['emitted']} | "
                     f"{first['failed_tokens']} | {first['wasted']} | {first['prefills']} | "
                     f"{wall:.1f} [{min(walls):.1f}, {max(walls):.1f}] | {60 * first['valid'] / wall:.1f} |"
                     + ("" if same else " (outputs differ between rounds)"))
    before, resume = rows[names[0]][0], rows["resume"][0]
    changed = [t for t in before["texts"] if before["texts"][t] != resume["texts"][t]]
    lines += ["", f"Outputs that differ between before and resume: {', '.join(changed) or 'none'} "
              "(only retried tasks can differ)."]
    return "\n".join(lines)


def _observe(gen: Any, made: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    """Run ``made`` (requests, specs) with the detector as before the structural rule, then
    replay the rule over each output (observe only)."""
    from constrained_spec.generation.loops import LoopDetector

    structural = []
    for req, _ in made:
        structural.append(req.loops.structural_tokens if req.loops is not None else None)
        req.loops = LoopDetector()  # the rule as before: the run is not changed by the new one
    gen.new_engine().run([r for r, _ in made])
    out = []
    for (req, _), tokens in zip(made, structural):
        fired = None
        if tokens is not None:
            loop = LoopDetector(structural_tokens=tokens).extend(req.output_ids)
            fired = None if loop is None else loop.start + loop.length
        out.append({"finish": req.finish_reason, "tokens": len(req.output_ids), "fired_at": fired})
    return out


def observe_table(model: Any, tasks: list[dict], tool_requests: int) -> str:
    from benchmarks.tools import BFCL, load_tools, make_requests
    from constrained_spec import Generator
    from constrained_spec.frontend.tools import ToolSet

    gen: Generator[Any] = Generator(model, max_retries=0)
    made = [gen.make_request(t["prompt"], schema=task_schema(t), max_tokens=t["max_tokens"])
            for t in tasks]
    shared = _observe(gen, made)
    tool_gen: Generator[Any] = Generator(model, max_retries=0, max_tokens=256)
    reqs = make_requests(load_tools(BFCL), 4, tool_requests) if BFCL.exists() else []
    tools = _observe(tool_gen, [tool_gen.make_request(r["prompt"], tools=ToolSet(r["tools"], "required", False))
                                for r in reqs])
    lines = ["Structural loop rule, observe only (greedy, no retries, the run with the rule off; "
             "the rule replayed over every output):", "",
             "| requests | completed | false stops (rule fired on a completed output) | "
             "failed (loop / max_tokens) | their tokens | with the rule |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, rs in ((f"shared tasks ({len(shared)})", shared),
                      (f"tool benchmark, BFCL ({len(tools)})", tools)):
        done = [r for r in rs if r["finish"] == "stop"]
        false = [r for r in done if r["fired_at"] is not None]
        failed = [r for r in rs if r["finish"] in ("loop", "length")]
        spent = sum(r["tokens"] for r in failed)
        sooner = sum(min(r["tokens"], r["fired_at"] or r["tokens"]) for r in failed)
        lines.append(f"| {label} | {len(done)} | {len(false)} | {len(failed)} | {spent} | {sooner} |")
    return "\n".join(lines)


def spans_table() -> str:
    from benchmarks.loops import embedded_tokenizer, encode, valid_instances
    from constrained_spec.generation.loops import LoopDetector, find_loop
    from constrained_spec.generation.retry import quote_tokens
    from constrained_spec.schemas import JsonLayout

    tok = embedded_tokenizer()
    quotes = quote_tokens([tok.decode([i]).encode() for i in range(len(tok))])
    layout = JsonLayout()
    n, structural, in_string, longest = 0, 0, 0, {"string": 0, "array": 0}
    for _, _, data in valid_instances():
        n += 1
        ids = encode(tok, layout.dumps(data))
        # any structural span of 4 periods, down to 8 tokens
        if LoopDetector(min_length=10**9, structural_tokens=quotes,
                        structural_min_length=8).extend(ids) is not None:
            structural += 1
        if find_loop(ids, min_length=8) is not None:
            in_string += 1
        for kind, length in _value_spans(tok, ids).items():
            longest[kind] = max(longest[kind], length)
    return "\n".join([
        f"Valid instances of JSONSchemaBench (all splits, compact layout): {n}.", "",
        "| periodic span of >= 4 periods, >= 8 tokens | instances |", "| --- | ---: |",
        f"| repeating whole values (contains a quote): the structural rule at 8 tokens | {structural} |",
        f"| any (almost all inside one string: hashes, digit fixtures) | {in_string} |", "",
        f"Longest string value {longest['string']} tokens, longest array {longest['array']} tokens: "
        "a no-progress rule on length alone would have to wait longer than these, past the "
        "benchmark budgets (256-512 tokens)."])


def _value_spans(tok: Any, ids: list[int]) -> dict[str, int]:
    """The longest string and array of a JSON text, in tokens."""
    longest = {"string": 0, "array": 0}
    stack: list[int] = []
    opened: int | None = None
    escaped = False
    for k, i in enumerate(ids):
        for c in tok.decode([i]):
            if opened is not None:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    longest["string"] = max(longest["string"], k - opened + 1)
                    opened = None
            elif c == '"':
                opened = k
            elif c == "[":
                stack.append(k)
            elif c == "]" and stack:
                longest["array"] = max(longest["array"], k - stack.pop() + 1)
    return longest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated task ids (e.g. the ones that "
                                                 "fail their first attempt: the retry cost alone)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--observe", action="store_true", help="the structural rule, observe only")
    ap.add_argument("--tool-requests", type=int, default=16)
    ap.add_argument("--spans", action="store_true", help="the data behind the thresholds")
    ap.add_argument("--no-retries", action="store_true", help="skip the retries table")
    args = ap.parse_args()
    import torch

    from constrained_spec import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    if args.only:
        tasks = [t for t in tasks if t["id"] in args.only.split(",")]
    tasks = tasks[: args.limit]
    parts = []
    if args.spans:
        parts.append(spans_table())
    if args.observe or not args.no_retries:
        model = load_model(None, quiet=True)
        if args.observe:
            parts.append(observe_table(model, tasks, args.tool_requests))
        if not args.no_retries:
            parts.append(retries_table(model, tasks, args.rounds))
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
