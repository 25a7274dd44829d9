"""Where a serving step's time goes at batch 1, 4, 8, ...: the engine's stages, the forward's rows.

    python -m benchmarks.step_profile                    # batch 1, 4, 8; the JSON-schema tasks
    python -m benchmarks.step_profile --batch 1,8,16 --speculative '{"method": "ngram"}'

The JSON-schema tasks of ``benchmarks/data/tasks.jsonl`` (their prompt with our schema system
message), each ``--repeats`` times, run through ONE engine (`Generator.new_engine`) with every
slot kept full: a request joins as soon as one finishes, as in the server's engine loop, but in
this process and thread (no HTTP, no event loop), so the breakdown is the engine's own. Per
batch size: steps, the mean rows per forward, and per step the milliseconds of each stage of
`generation.timing.StepTimer` (drafting without its grammar work; grammar = the forks' masks
and forced tokens + the commit's matcher updates; forward; verify) plus the rest (Python
around them), and the prefill forwards of arrivals (their total time and how many steps they
ran between). Tokens per second and per forward close each row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks.serving import TASKS, load_tasks, with_messages


def profile(generator: Any, tasks: list[dict], batch: int) -> dict[str, Any]:
    from constrained_spec.generation import timing

    engine = generator.new_engine()
    engine.max_batch_size = batch
    prefix = getattr(engine.runner, "prefiller", None)
    if prefix is not None:  # each batch size starts with no prompt cached
        prefix.cache.clear()
    timers: list[tuple[int, timing.StepTimer]] = []
    rows: list[int] = []
    prompt_rows: list[int] = []  # rows of prompts read in the step's forward (generation/prefill.py)
    padded: list[int] = []
    prefills: list[float] = []
    real_charge = timing.StepTimer.charge
    runner = engine.runner
    real_forward = runner.forward
    real_prefill = engine._prefill

    def charge(self: timing.StepTimer, stats: Any) -> None:
        timers.append((len(stats), self))
        real_charge(self, stats)

    def forward(slots: Any, tokens: Any, num_logits: Any, **kw: Any) -> Any:
        if any(num_logits):
            rows.append(sum(len(t) for t, n in zip(tokens, num_logits) if n))
            prompt_rows.append(sum(len(t) for t, n in zip(tokens, num_logits) if not n))
            padded.append(len(tokens) * max(len(t) for t in tokens))
        return real_forward(slots, tokens, num_logits, **kw)

    def prefill(reqs: Any) -> None:
        t0 = time.perf_counter()
        real_prefill(reqs)
        prefills.append(time.perf_counter() - t0)

    waiting = deque(generator.make_request(t["messages"], schema=t["schema"],
                                           max_tokens=t["max_tokens"])[0] for t in tasks)
    timing.StepTimer.charge = charge  # type: ignore[method-assign]
    runner.forward = forward
    engine._prefill = prefill
    done: list[Any] = []
    t0 = time.perf_counter()
    try:
        while waiting or engine.running:
            free = engine.max_batch_size - len(engine.running)
            if waiting and free > 0:
                engine.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
            engine.safe_step()
            done.extend(r for r in engine.running if r.finished)
            engine.reap()
    finally:
        timing.StepTimer.charge = real_charge  # type: ignore[method-assign]
        runner.forward = real_forward
        del engine._prefill
    wall = time.perf_counter() - t0
    full = [(n, t) for n, t in timers if n == batch] or timers  # steps with every slot busy

    def ms(xs: list[float]) -> float:
        return 1000 * statistics.fmean(xs) if xs else 0.0

    totals = [t.drafting + t.forward + t.verify + t.commit for _, t in full]
    tokens = sum(len(r.output_ids) for r in done)
    return {
        "batch": batch, "steps": len(timers), "full_steps": len(full),
        "rows_per_forward": statistics.fmean(rows) if rows else 0.0,
        "prompt_rows_per_forward": statistics.fmean(prompt_rows) if prompt_rows else 0.0,
        "cached_prompt_tokens": sum(r.stats.cached_prompt_tokens for r in done),
        "prompt_tokens": sum(len(r.prompt_ids) for r in done),
        "padded_per_forward": statistics.fmean(padded) if padded else 0.0,
        "drafting_ms": ms([t.drafting - t.grammar for _, t in full]),
        "grammar_ms": ms([t.grammar + t.commit for _, t in full]),
        "forward_ms": ms([t.forward for _, t in full]),
        "verify_ms": ms([t.verify for _, t in full]),
        "step_ms": ms(totals),
        "prefill_s": sum(r.stats.prefill_s for r in done), "prefills": len(prefills),
        "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
        "tokens_per_forward": sum(r.stats.emitted_tokens for r in done)
        / max(sum(r.stats.target_forwards for r in done), 1),
        "valid": sum(r.finish_reason == "stop" for r in done), "requests": len(done),
    }


def render(rows: list[dict]) -> str:
    head = ("| batch | steps (all slots busy) | rows / forward (padded) | prompt rows / forward | "
            "drafting ms | grammar ms | forward ms | verify ms | step ms | forward ms / row | "
            "prefill s (forwards at admission) | prompt tokens cached | tokens / forward | tokens/s | wall s |")
    out = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in rows:
        all_rows = r["rows_per_forward"] + r["prompt_rows_per_forward"]
        per_row = r["forward_ms"] / all_rows if all_rows else 0.0
        out.append(f"| {r['batch']} | {r['steps']} ({r['full_steps']}) | "
                   f"{r['rows_per_forward']:.1f} ({r['padded_per_forward']:.0f}) | "
                   f"{r['prompt_rows_per_forward']:.1f} | "
                   f"{r['drafting_ms']:.1f} | {r['grammar_ms']:.1f} | {r['forward_ms']:.1f} | "
                   f"{r['verify_ms']:.1f} | {r['step_ms']:.1f} | {per_row:.2f} | "
                   f"{r['prefill_s']:.2f} ({r['prefills']}) | "
                   f"{r['cached_prompt_tokens']} of {r['prompt_tokens']} | {r['tokens_per_forward']:.2f} | "
                   f"{r['tok_per_s']:.1f} | {r['wall_s']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,4,8")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tasks", type=Path, default=TASKS)
    p.add_argument("--speculative", default=None, help="Generator's speculative=, as JSON")
    args = p.parse_args(argv)

    from constrained_spec import Generator

    spec = None if args.speculative is None else json.loads(args.speculative)
    generator: Any = Generator(speculative=spec)
    tasks = with_messages(load_tasks(args.tasks)) * args.repeats
    profile(generator, tasks[:2], 1)  # warm: compiles, kernels
    rows = [profile(generator, tasks, int(b)) for b in args.batch.split(",")]
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
