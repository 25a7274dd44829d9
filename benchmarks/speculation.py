"""Speculation benchmark: tokens/s and acceptance length per drafter on the benchmark tasks.

One run, one machine, the embedded model, greedy decoding. For every task the modes run
back to back in a rotating order (cancels drift), each on a warm compile cache. Reported per
mode: tokens/s (emitted tokens over wall time, prefill included), acceptance length, the
share of step time spent in grammar work, and the speed-up over speculation off.

Losslessness on the side, in the dtype and kernels the plan picks: per mode, the tasks whose
greedy tokens differ from speculation off run alone -- each task alone, and all tasks batched
(mixed schemas, one batch per max_tokens) unless ``--no-batched``. An exact runner (the default)
must show 0 everywhere.

    python -m benchmarks.speculation [--tasks FILE.jsonl] [--limit N] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks._results import write_section
from constrained_spec import Generator, Regex, SpeculativeConfig, load_model
from constrained_spec.config import SpeculativeMethod
from constrained_spec.drafters import make_drafter
from constrained_spec.generation.stats import SpecStats

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = ROOT / "benchmarks" / "data" / "tasks.jsonl"
# Tasks whose values are copied from the prompt (the rest invent their values).
EXTRACTION = {"person_extract", "event_extract", "invoice_extract", "address_extract",
              "product_extract", "contacts_list", "medication", "job_post", "log_parse",
              "flight_search", "weather_call"}

MODES = {
    "off": False,
    "forced": SpeculativeConfig(method=None),
    "ngram": SpeculativeConfig(method="ngram", forced=False),
    "forced+ngram": SpeculativeConfig(method="ngram"),
}
# learned drafters (the heads shipped for the embedded model, or --eagle3 / --mtp folders; a
# distilled draft model with --draft-model);
# "no draft mask": the same drafter with its drafts taken from the raw head (ablation)
HEAD_MODES: dict[str, tuple[SpeculativeMethod, bool, bool]] = {  # method, forced, draft mask
    "eagle3": ("eagle3", False, True),
    "eagle3+forced": ("eagle3", True, True),
    "eagle3+forced (no draft mask)": ("eagle3", True, False),
    "mtp": ("mtp", False, True),
    "mtp+forced": ("mtp", True, True),
    "mtp+forced (no draft mask)": ("mtp", True, False),
    "draft_model": ("draft_model", False, True),
    "draft_model+forced": ("draft_model", True, True),
}


def head_modes(heads: dict[str, object], k: dict[str, int]) -> dict:
    """(config, draft mask on?) per learned-drafter mode whose head is available."""
    out = {}
    for name, (method, forced, masked) in HEAD_MODES.items():
        if method in heads:
            out[name] = (SpeculativeConfig(method=method, model=heads[method], forced=forced,
                                           num_speculative_tokens=k[method]), masked)
    return out


def task_schema(task: dict):
    return {"json_schema": lambda: task["schema"], "regex": lambda: Regex(task["regex"]),
            "choice": lambda: list(task["choices"])}[task["kind"]]()


def run(tasks: list[dict], modes: dict, repeats: int) -> dict:
    model = load_model(None, quiet=True)
    gens: dict[str, Generator[Any]] = {}
    for m, s in modes.items():
        spec, masked = s if isinstance(s, tuple) else (s, True)
        # one attempt: a retry samples (at the retry temperature), so a task whose greedy
        # attempt fails would be compared on sampled tokens
        gens[m] = Generator(model, speculative=spec, max_retries=0)
        if not masked:
            # its own drafter: Generators with equal configs share one (api.shared_drafter),
            # and the ablation must not switch masking off for the masked mode too
            from constrained_spec.drafters.feature import FeatureDrafter

            drafter = make_drafter(spec, model)
            if not isinstance(drafter, FeatureDrafter):  # only heads have a no-mask mode
                raise TypeError(f"mode {m!r}: no draft mask needs an eagle3 / mtp head, got {drafter!r}")
            drafter.mask_drafts = False
            gens[m].drafter = drafter
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    names = list(modes)
    for ti, task in enumerate(tqdm(tasks, desc="tasks", file=sys.stderr)):
        for rep in range(repeats):
            order = names[(ti + rep) % len(names):] + names[: (ti + rep) % len(names)]
            for m in order:
                t0 = time.perf_counter()
                res = gens[m].batch([task["prompt"]], schemas=[task_schema(task)], return_result=True,
                                    max_tokens=task["max_tokens"])[0]
                wall = time.perf_counter() - t0
                stats = res.stats if hasattr(res, "stats") and res.stats is not None else SpecStats()
                rows[m].append(dict(task=task["id"], wall=wall, stats=stats,
                                    ok=not isinstance(res, BaseException),
                                    ids=getattr(res, "token_ids", None)))
    return rows


def run_batched(tasks: list[dict], modes: dict) -> dict[str, dict[str, list[int] | None]]:
    """Greedy token ids per mode and task with the tasks batched (mixed schemas; one batch per
    max_tokens, as a server would group them)."""
    model = load_model(None, quiet=True)
    out: dict[str, dict[str, list[int] | None]] = {}
    for m, s in tqdm(modes.items(), desc="batched", file=sys.stderr):
        spec, masked = s if isinstance(s, tuple) else (s, True)
        if not masked:
            continue  # the ablation changes drafts, not outputs: the masked mode covers it
        gen: Generator[Any] = Generator(model, speculative=spec, max_retries=0)
        out[m] = {}
        for mt in sorted({t["max_tokens"] for t in tasks}):
            group = [t for t in tasks if t["max_tokens"] == mt]
            res = gen.batch([t["prompt"] for t in group], schemas=[task_schema(t) for t in group],
                            return_result=True, max_tokens=mt)
            out[m].update({t["id"]: getattr(r, "token_ids", None) for t, r in zip(group, res)})
    return out


def divergence_table(rows: dict, batched: dict | None) -> tuple[str, int]:
    """Per mode: tasks whose greedy tokens differ from speculation off run alone; and the total."""
    base = {r["task"]: r["ids"] for r in rows["off"]}
    lines = ["| mode | tasks | differ from off (alone) | differ from off (batched) |",
             "| --- | --- | --- | --- |"]
    total = 0
    for m, rs in rows.items():
        alone = sorted({r["task"] for r in rs if r["ids"] != base[r["task"]]})
        together = None if batched is None or m not in batched else \
            sorted(t for t, ids in batched[m].items() if ids != base[t])
        total += len(alone) + len(together or [])
        lines.append(f"| {m} | {len(base)} | {_listed(alone)} | "
                     f"{'—' if together is None else _listed(together)} |")
    return "\n".join(lines), total


def _listed(tasks: list[str]) -> str:
    return "0" if not tasks else f"{len(tasks)}: {', '.join(tasks)}"


def summarize(rows: dict, subset=None) -> dict:
    out = {}
    for m, rs in rows.items():
        rs = [r for r in rs if subset is None or r["task"] in subset]
        if not rs:
            continue
        tokens = sum(r["stats"].emitted_tokens for r in rs)
        wall = sum(r["wall"] for r in rs)
        forwards = sum(r["stats"].target_forwards for r in rs)
        step = sum(r["stats"].step_s for r in rs)
        grammar = sum(r["stats"].grammar_s for r in rs)
        per_task = [r["stats"].emitted_tokens / r["wall"] for r in rs if r["wall"] > 0]
        merged = SpecStats()
        for r in rs:
            merged = merged.merge(r["stats"])
        out[m] = dict(tok_s=tokens / wall, acc_len=tokens / max(forwards, 1),
                      by_position=merged.acceptance_rate_by_position[:5],
                      draft_cost=merged.drafting_s / merged.target_forward_s if merged.target_forward_s else 0.0,
                      grammar_share=grammar / step if step else 0.0,
                      tok_s_median=statistics.median(per_task),
                      tok_s_iqr=(statistics.quantiles(per_task, n=4) if len(per_task) > 1 else [0, 0, 0]),
                      valid=sum(r["ok"] for r in rs) / len(rs), n=len(rs))
    return out


def table(summary: dict, title: str) -> str:
    base = summary.get("off", {}).get("tok_s")
    lines = [f"**{title}**", "",
             "| mode | tokens/s (all) | tokens/s per task, median [q1, q3] | acceptance length "
             "| acceptance by draft position 1..5 | drafting / target forward time | speed-up vs off "
             "| grammar share of step | completed valid |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m, s in summary.items():
        q = s["tok_s_iqr"]
        pos = " / ".join(f"{100 * a:.0f}" for a in s["by_position"]) or "—"
        lines.append(f"| {m} | {s['tok_s']:.1f} | {s['tok_s_median']:.1f} [{q[0]:.1f}, {q[2]:.1f}] | "
                     f"{s['acc_len']:.2f} | {pos} | {100 * s['draft_cost']:.0f}% | "
                     f"{s['tok_s'] / base:.2f}x | {100 * s['grammar_share']:.1f}% | "
                     f"{100 * s['valid']:.0f}% |" if base else "")
    return "\n".join(lines)


def hardware() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, python {platform.python_version()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 avoids stalls when another process shares the cores)")
    ap.add_argument("--out", type=Path, default=None, help="append/replace the section in this markdown file")
    ap.add_argument("--eagle3", type=Path, default=None, help="EAGLE-3 head folder (default: the shipped one)")
    ap.add_argument("--mtp", type=Path, default=None, help="MTP head folder (default: the shipped one)")
    ap.add_argument("--k-eagle3", type=int, default=3, help="drafts per step for eagle3")
    ap.add_argument("--k-mtp", type=int, default=3, help="drafts per step for mtp")
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="draft model folder (python -m constrained_spec.training draft_model)")
    ap.add_argument("--k-draft-model", type=int, default=3, help="drafts per step for draft_model")
    ap.add_argument("--modes", default=None, help="comma-separated modes to run (default: all available)")
    ap.add_argument("--no-batched", action="store_true",
                    help="skip the batched losslessness check (each mode with all tasks batched)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    tasks = tasks[: args.limit] if args.limit else tasks
    from constrained_spec.drafters.feature import shipped_head

    heads = {m: p for m, p in (("eagle3", args.eagle3 or shipped_head("eagle3")),
                                ("mtp", args.mtp or shipped_head("mtp")),
                                ("draft_model", args.draft_model)) if p is not None}
    modes = dict(MODES, **head_modes(heads, {"eagle3": args.k_eagle3, "mtp": args.k_mtp,
                                             "draft_model": args.k_draft_model}))
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",")]
        unknown = [m for m in wanted if m not in modes]
        if unknown:
            ap.error(f"unknown or unavailable modes {unknown}; available: {list(modes)}")
        modes = {m: modes[m] for m in ["off"] + [w for w in wanted if w != "off"]}
    rows = run(tasks, modes, args.repeats)
    # losslessness check on the side: greedy outputs must be identical across modes, alone
    # (the timed runs) and batched
    batched = None if args.no_batched else run_batched(tasks, modes)
    divergences, total = divergence_table(rows, batched)
    model = load_model(None, quiet=True)
    runner = model.runner
    plan = getattr(runner, "plan", None)
    kernels = f"kernel plan {plan.describe()} ({plan.source})" if plan is not None else type(runner).__name__
    text = "\n\n".join([
        f"Hardware: {hardware()}; model dtype {model.dtype}; {kernels}; exact runner "
        f"{getattr(runner, 'exact', False)}; {len(tasks)} tasks x {args.repeats}; greedy; outputs "
        f"identical to speculation off: {'yes' if total == 0 else f'NO ({total} divergences)'}",
        divergences,
        table(summarize(rows), "All tasks"),
        table(summarize(rows, EXTRACTION), "Extraction tasks (values copied from the prompt)"),
        table(summarize(rows, {t['id'] for t in tasks} - EXTRACTION), "Generation tasks"),
    ])
    print(text)
    if args.out:
        write_section(args.out, "## Speculation on the benchmark tasks", text)


if __name__ == "__main__":
    main()
