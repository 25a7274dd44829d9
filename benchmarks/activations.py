"""Int8 against bf16 activations on the native forward: what they change on output quality.

One process, the embedded model, the library's defaults (``Generator(loaded)``: default
speculation, greedy, default retries). Each request runs on both sides, the order alternating
per request: the native forward's 4-bit products on bf16 activations and on int8 activations
(the default since this measurement; `LeanRunner.int8_activations`: llama.cpp's Q8_0 scheme;
on integer dot products, or byte pairs where the CPU has none: `cpu_native.int8_instructions`). Each side keeps its own
prompt prefix cache (the runner's is keyed by tokens only: a prefix prefilled on one side's
activations would otherwise be read by the other).

Shared tasks (benchmarks/data/tasks.jsonl), per side:

* **completed-valid**: a value returned, and it validates (``jsonschema`` against the task's
  schema, the regex matched whole, one of the choices; checked here, independently of the
  library's own check);
* **valid objects per minute** and **tokens/s**: over the wall time of that side's generations
  (prefill and retries included; emitted tokens of every attempt);
* **verbatim**: on the extraction tasks (`benchmarks.speculation.EXTRACTION`: the answer's
  strings are to be copied from the prompt), the share of string leaves of the returned values
  that appear in the prompt (case-sensitive substring);
* **agreement with bf16**: the share of tasks whose returned value is identical to the bf16
  side's (a failure on both sides counts as identical), and the share of leaf values (flattened
  JSON paths, over the union of both sides' paths) equal to the bf16 side's.

BFCL tool set (`benchmarks.tools`: its requests, its ``ours`` system with speculation on, no
retries, and its scoring): completed, valid (of completed), asked tool (of completed), and the
share of requests whose calls (names and arguments) are identical to the bf16 side's.

Losslessness under int8: the shared tasks' greedy token ids (no retries) with speculation off
against speculation on, both on int8 activations; the differing tasks must be 0.

    python -m benchmarks.activations [--limit N] [--tool-limit 40] [--threads 2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks import tools
from benchmarks._results import write_section
from benchmarks.speculation import DEFAULT_TASKS, EXTRACTION, task_schema
from constrained_spec import Generator, load_model
from constrained_spec.kernels import cpu_native
from constrained_spec.model.loading import LoadedModel
from constrained_spec.model.plan import machine_info
from constrained_spec.model.prefix_cache import PrefixCache
from constrained_spec.model.runner import LeanRunner

HEADING = "## int8 against bf16 activations: quality on the shared tasks and the BFCL tools"
SIDES = ("bf16", "int8")


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(JSON pointer, leaf) of every scalar in ``value``; an empty object or array is a leaf."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaves(v, f"{path}/{k}")
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}/{i}")
    else:
        yield path, value


def verbatim(value: Any, prompt: str) -> tuple[int, int]:
    """(string leaves of ``value`` that appear in ``prompt``, case-sensitive; string leaves)."""
    strings = [v for _, v in leaves(value) if isinstance(v, str)]
    return sum(s in prompt for s in strings), len(strings)


def leaf_agreement(a: Any, b: Any) -> tuple[int, int]:
    """(paths whose leaf is equal in ``a`` and ``b``; paths in either). A leaf equal in value
    but not in JSON type (``1`` and ``1.0``, ``1`` and ``true``) differs."""
    la, lb = dict(leaves(a)), dict(leaves(b))
    paths = la.keys() | lb.keys()
    same = sum(p in la and p in lb and json.dumps(la[p]) == json.dumps(lb[p]) for p in paths)
    return same, len(paths)


def same_value(a: Any, b: Any) -> bool:
    """Whether two returned values are identical as JSON (``1`` and ``1.0`` differ, key order
    does not)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def validates(task: dict[str, Any], value: Any) -> bool:
    """Whether ``value`` meets the task's constraint (checked here, not by the library)."""
    if task["kind"] == "json_schema":
        import jsonschema

        cls = jsonschema.validators.validator_for(task["schema"])
        return not any(True for _ in cls(task["schema"]).iter_errors(value))
    if task["kind"] == "regex":
        return isinstance(value, str) and re.fullmatch(task["regex"], value) is not None
    return value in task["choices"]


class Sides:
    """Puts the model's runner on one side or the other, each side with its own prefix cache:
    the cache is keyed by tokens only, so a prompt prefix prefilled on one side's activations
    would otherwise be read by the other side."""

    def __init__(self, loaded: LoadedModel) -> None:
        runner = loaded.runner
        assert isinstance(runner, LeanRunner)  # the embedded model always runs on the lean runner
        self.runner = runner
        self.caches = {s: PrefixCache(runner.prefiller.cache.max_bytes) for s in SIDES}

    def set(self, side: str) -> None:
        self.runner.int8_activations = side == "int8"
        self.runner.prefiller.cache = self.caches[side]


def run_tasks(loaded: LoadedModel, sides: Sides, tasks: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """One record per side and task: the value (None on failure), validity, tokens, wall."""
    gen: Generator[Any] = Generator(loaded)
    for t in tasks:  # compile every grammar before any clock starts
        gen.make_request(t["prompt"], schema=task_schema(t))
    for side in SIDES:  # untimed: each side's native layer stack is built on its first forward
        sides.set(side)
        gen.batch([tasks[0]["prompt"]], schemas=[task_schema(tasks[0])], max_tokens=8, max_retries=0)
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for i, t in enumerate(tqdm(tasks, desc="shared tasks", file=sys.stderr)):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            sides.set(side)
            t0 = time.perf_counter()
            res = gen.batch([t["prompt"]], schemas=[task_schema(t)], return_result=True,
                            max_tokens=t["max_tokens"])[0]
            wall = time.perf_counter() - t0
            ok = not isinstance(res, BaseException)
            stats = getattr(res, "stats", None)
            out[side].append({
                "task": t["id"], "wall_s": wall, "value": res.value if ok else None,
                "valid": ok and validates(t, res.value),
                "error": None if ok else type(res).__name__,
                "attempts": getattr(res, "attempts", 1),
                "tokens": stats.emitted_tokens if stats else len(getattr(res, "token_ids", []))})
    sides.set("bf16")
    return out


def spec_on_off(loaded: LoadedModel, sides: Sides, tasks: list[dict[str, Any]]) -> list[str]:
    """Tasks whose greedy token ids (no retries) differ between speculation on and off, both on
    int8 activations."""
    sides.set("int8")
    ids: dict[bool, list[Any]] = {}
    for spec in (True, False):
        gen: Generator[Any] = Generator(loaded, max_retries=0, speculative=None if spec else False)
        ids[spec] = [getattr(gen.batch([t["prompt"]], schemas=[task_schema(t)], return_result=True,
                                       max_tokens=t["max_tokens"])[0], "token_ids", None)
                     for t in tqdm(tasks, desc=f"int8, speculation {'on' if spec else 'off'}",
                                   file=sys.stderr)]
    sides.set("bf16")
    return [t["id"] for t, a, b in zip(tasks, ids[True], ids[False]) if a != b]


def run_tools(loaded: LoadedModel, sides: Sides, requests: list[dict[str, Any]], threads: int, max_tokens: int
              ) -> dict[str, list[dict[str, Any]]]:
    """`benchmarks.tools`' ``ours`` system on each side per request, scored as it scores."""
    ours = tools.Ours(True, threads, max_tokens)
    assert ours.gen.model is loaded  # load_model caches: the runner flipped here is the one it runs
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for i, request in enumerate(tqdm(requests, desc="BFCL tool requests", file=sys.stderr)):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            sides.set(side)
            rec = {"id": request["id"], **ours.run(request)}
            if "refused" not in rec:
                rec["valid"], rec["asked"] = tools.check_calls(request, rec["calls"])
                rec["valid"] = rec["valid"] and rec["completed"]
            out[side].append(rec)
    sides.set("bf16")
    return out


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.1f}% ({a:g}/{b:g})" if b else "n/a"


def task_rows(tasks: list[dict[str, Any]], recs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The shared tasks' table, one row per side."""
    prompts = {t["id"]: t["prompt"] for t in tasks}
    lines = ["| side | completed-valid | valid objects / min | tokens/s | verbatim (extraction) | "
             "values identical to bf16 | leaves equal to bf16 |", "|---|---|---|---|---|---|---|"]
    for side in SIDES:
        rs = recs[side]
        valid = sum(r["valid"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        vb = [verbatim(r["value"], prompts[r["task"]]) for r in rs if r["task"] in EXTRACTION]
        same = sum(same_value(r["value"], b["value"]) for r, b in zip(rs, recs["bf16"]))
        agree = [leaf_agreement(r["value"], b["value"]) for r, b in zip(rs, recs["bf16"])]
        lines.append(f"| {side} | {valid}/{len(rs)} | {60 * valid / wall:.1f} | "
                     f"{sum(r['tokens'] for r in rs) / wall:.1f} | "
                     f"{_pct(sum(a for a, _ in vb), sum(n for _, n in vb))} | {_pct(same, len(rs))} | "
                     f"{_pct(sum(a for a, _ in agree), sum(n for _, n in agree))} |")
    return lines


def tool_rows(recs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The BFCL table, one row per side."""
    lines = ["| side | requests | refused | completed | valid (of completed) | asked tool (of completed) | "
             "calls identical to bf16 | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for side in SIDES:
        rs = recs[side]
        ran = [r for r in rs if "refused" not in r]
        done = [r for r in ran if r["completed"]]
        same = sum(same_value(r.get("calls"), b.get("calls")) for r, b in zip(rs, recs["bf16"]))
        wall = sum(r["wall_s"] for r in ran)
        lines.append(f"| {side} | {len(rs)} | {len(rs) - len(ran)} | {_pct(len(done), len(ran))} | "
                     f"{_pct(sum(r['valid'] for r in done), len(done))} | "
                     f"{_pct(sum(r['asked'] for r in done), len(done))} | {_pct(same, len(rs))} | "
                     f"{sum(r['tokens'] for r in ran) / wall if wall else float('nan'):.1f} |")
    return lines


def differences(recs: dict[str, list[dict[str, Any]]], key: str) -> list[str]:
    """One line per request whose int8 output differs from bf16's (``key``: value or calls),
    with the side that failed or returned an invalid output."""
    out = []
    for b, i in zip(recs["bf16"], recs["int8"]):
        if same_value(b.get(key), i.get(key)):
            continue
        failed = "".join(f" [{side}: {r.get('error') or r.get('refused') or 'invalid'}]"
                         for side, r in (("bf16", b), ("int8", i)) if not r.get("valid"))
        out.append(f"- `{b.get('task', b.get('id'))}`{failed}: bf16 `{json.dumps(b.get(key))[:160]}`"
                   f" / int8 `{json.dumps(i.get(key))[:160]}`")
    return out


def render(res: dict[str, Any], args: argparse.Namespace) -> str:
    info = machine_info()
    tasks, recs, trecs = res["tasks"], res["records"], res["tool_records"]
    diff = res["spec_diff"]
    out = [f"CPU {info.get('cpu', '?')}, flags {' '.join(info.get('flags', []))}; native build "
           f"`{cpu_native.build_for_this_cpu()}`, int8 products on `{cpu_native.int8_instructions()}`; "
           f"torch {torch.__version__}, {args.threads} threads; plan `{res['plan']}`. The library's "
           f"defaults (`Generator(loaded)`: default speculation, greedy, default retries); each request "
           f"on both sides, the order alternating. `python -m benchmarks.activations` "
           f"(--tool-limit {args.tool_limit}); {res['minutes']:.0f} minutes. Tokens/s are indicative "
           f"(a shared machine); the quality columns are the measurement.",
           "", f"Shared tasks ({len(tasks)}; verbatim over the extraction tasks "
           f"{', '.join(sorted(t['id'] for t in tasks if t['id'] in EXTRACTION))}):", "",
           *task_rows(tasks, recs), "",
           f"Differing values ({len(differences(recs, 'value'))} of {len(tasks)} tasks):", "",
           *(differences(recs, "value") or ["- none"]), "",
           f"BFCL tool set ({len(trecs['bf16'])} requests of {args.tools_per_request} tools, "
           f"`benchmarks.tools`' `ours` system: speculation on, no retries, max_tokens {args.max_tokens}):",
           "", *tool_rows(trecs), "",
           f"Differing calls ({len(differences(trecs, 'calls'))} of {len(trecs['bf16'])} requests):", "",
           *(differences(trecs, "calls") or ["- none"]), "",
           f"Speculation on = off under int8 (greedy token ids, no retries): {len(diff)} of "
           f"{len(tasks)} tasks differ{': ' + ', '.join(diff) if diff else ''}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=None, help="the first N shared tasks")
    ap.add_argument("--tool-limit", type=int, default=40, help="BFCL requests (0: none)")
    ap.add_argument("--tools-per-request", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256, help="per BFCL request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the section into this markdown file")
    ap.add_argument("--out-json", type=Path, help="every record as JSON")
    args = ap.parse_args(argv)
    if not cpu_native.int8_activations():
        ap.error("this CPU's native library has no int8 activations (cpu_native.int8_activations)")
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, quiet=True)
    if not isinstance(loaded.runner, LeanRunner):  # each side sets int8_activations, over the plan's
        ap.error(f"the sides are set on the lean runner, not {type(loaded.runner).__name__}")
    sides = Sides(loaded)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    tasks = tasks[: args.limit]
    requests = tools.make_requests(tools.load_tools(tools.BFCL), args.tools_per_request,
                                   args.tool_limit) if args.tool_limit else []
    res: dict[str, Any] = {"tasks": tasks, "plan": loaded.describe_kernels()["plan"],
                           "records": run_tasks(loaded, sides, tasks),
                           "tool_records": run_tools(loaded, sides, requests, args.threads, args.max_tokens),
                           "spec_diff": spec_on_off(loaded, sides, tasks)}
    res["minutes"] = (time.perf_counter() - start) / 60
    body = render(res, args)
    print(body)
    if args.out_json:
        args.out_json.write_text(json.dumps({k: v for k, v in res.items() if k != "tasks"},
                                            indent=1, default=str))
    if args.out:
        write_section(args.out, HEADING, body)


if __name__ == "__main__":
    main()
