"""Decode forward of the embedded model: the one-call native layer stack against the torch
layers, and both against the time to read the packed weights once.

One process, the embedded model in its own kernel plan, a slot prefilled to ``--keys`` tokens.
For a 1-row decode and a 7-row verify the runner's ``native_forward`` flag is flipped per round
(``--rounds`` alternating rounds of ``--repeats`` forwards, the cache truncated back after each;
reported: the median of the round medians). The floor: the bytes of the packed weights a
forward reads (every layer's linears and the LM head, in the plan's packs) over the memory read
bandwidth measured here (a float32 sum over 512 MB with the same threads). Numerics: over
``--logit-prompts`` task prompts, 8 greedy decode steps from the same cache on both paths, the
largest |logit difference| and its share of the largest |logit|, and the argmax agreement; with
``--tasks N``, the greedy outputs of the first N shared tasks (benchmarks/data/tasks.jsonl,
default speculation, no retries) on the native path against the torch path, and against
speculation off. Run it on a quiet machine, or compare only ratios from one run.

``--int8``: the two sides are the native forward with bf16 activations and with int8
activations, the default (`LeanRunner.int8_activations`: the 4-bit products in integers, on
the CPU's integer dot products or byte pairs); every comparison above is then int8 against
bf16. Without it the native side takes bf16 activations, as the torch path does.

    python -m benchmarks.forward [--keys 300] [--threads 2] [--clock wall|cpu] [--tasks 24]
                                 [--int8] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import write_section
from constrained_spec import Generator, load_model
from constrained_spec.kernels import cpu_native
from constrained_spec.model.plan import machine_info
from constrained_spec.model.runner import LeanRunner

HEADING = "## Decode forward: one native call against the torch layers"
HEADING_INT8 = "## Decode forward: int8 against bf16 activations on the native forward"
ROWS = (1, 7)
TASKS = Path(__file__).with_name("data") / "tasks.jsonl"


def read_bandwidth(threads: int, mb: int = 512, repeats: int = 7) -> float:
    """Bytes per second of a float32 sum over ``mb`` MB (memory read bandwidth, ``threads``)."""
    torch.set_num_threads(threads)
    x = torch.ones(mb * (1 << 20) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def packed_bytes(runner: LeanRunner) -> int:
    """Bytes of the packed weights one decode forward reads: the plan's packs of every layer's
    linears and of the LM head."""
    kernel = runner.plan.decode_kernel(1)
    total = 0
    for lin, k in [(lin, kernel) for lin in runner.linears()] + [(runner.lm_head_weight, runner.plan.lm_head)]:
        pack = lin._pack(runner._kernel(lin, k))
        total += pack.data.numel() if isinstance(pack, cpu_native.GroupPack) else sum(
            t.numel() * t.element_size() for t in pack)
    return total


def side(runner: LeanRunner, on: bool, int8: bool) -> None:
    """Put ``runner`` on one side of the comparison: native (``on``) or torch layers, or with
    ``int8`` the native forward on int8 (``on``) or bf16 activations."""
    runner.native_forward = on or int8
    runner.int8_activations = on and int8


def time_forwards(runner: LeanRunner, slot: int, keys: int, rounds: int, repeats: int,
                  now: Callable[[], float], int8: bool = False) -> dict[tuple[int, bool], float]:
    """Median of the round medians (ms) per (rows, side: native or int8)."""
    samples: dict[tuple[int, bool], list[float]] = {(T, n): [] for T in ROWS for n in (True, False)}
    for r in range(rounds + 1):  # round 0 warms up
        for T in ROWS:
            for native in ((True, False) if r % 2 else (False, True)):
                side(runner, native, int8)
                times = []
                for _ in range(repeats):
                    t0 = now()
                    runner.forward([slot], [[500 + j for j in range(T)]], [T])
                    times.append(now() - t0)
                    runner.truncate(slot, keys)
                if r:
                    samples[(T, native)].append(statistics.median(times) * 1000)
    side(runner, True, False)
    return {k: statistics.median(v) for k, v in samples.items()}


def logit_difference(runner: LeanRunner, prompts: list[list[int]], steps: int = 8,
                     int8: bool = False) -> dict[str, float]:
    """Largest |native - torch| logit over greedy decode steps from the same caches, its share
    of the largest |logit|, and the share of steps whose argmax agrees."""
    diff, scale, agree, n = 0.0, 0.0, 0, 0
    for ids in prompts:
        logits: dict[bool, torch.Tensor] = {}
        for native in (True, False):
            side(runner, native, int8)
            s = runner.new_slot()
            runner.forward([s], [ids], [0])
            tok, rows = ids[-1], []
            for _ in range(steps):  # the torch path follows the native path's tokens
                row = runner.forward([s], [[tok]], [1])
                rows.append(row)
                tok = int(logits[True][len(rows) - 1].argmax()) if not native else int(row.argmax())
            logits[native] = torch.cat(rows)
            runner.free_slot(s)
        d = (logits[True] - logits[False]).abs().max().item()
        diff, scale = max(diff, d), max(scale, logits[False].abs().max().item())
        agree += int((logits[True].argmax(-1) == logits[False].argmax(-1)).sum())
        n += steps
    side(runner, True, False)
    return {"max_diff": diff, "share": diff / scale, "argmax_agree": agree / n}


def greedy_outputs(loaded: Any, tasks: list[dict], int8: bool = False) -> dict[str, int]:
    """Tasks whose greedy tokens differ: native vs torch (speculation on), and native with
    speculation on vs off."""
    from benchmarks.speculation import task_schema

    runner = loaded.runner
    outs: dict[tuple[bool, bool], list[Any]] = {}
    for native, spec in ((True, True), (False, True), (True, False)):
        side(runner, native, int8)
        gen: Generator[Any] = (Generator(loaded, max_retries=0) if spec
                               else Generator(loaded, max_retries=0, speculative=False))
        outs[(native, spec)] = [
            getattr(gen.batch([t["prompt"]], schemas=[task_schema(t)], return_result=True,
                              max_tokens=t["max_tokens"])[0], "token_ids", None) for t in tasks]
    side(runner, True, False)
    return {"native_vs_torch": sum(a != b for a, b in zip(outs[(True, True)], outs[(False, True)])),
            "spec_on_vs_off": sum(a != b for a, b in zip(outs[(True, True)], outs[(True, False)])),
            "tasks": len(tasks)}


def render(res: dict, args: argparse.Namespace) -> str:
    info = machine_info()
    floor_ms = res["bytes"] / res["bandwidth"] * 1000
    t = res["times"]
    a, b = ("native, bf16 act.", "native, int8 act.") if args.int8 else ("torch layers", "native, one call")
    lines = [f"| forward | {a} (ms) | {b} (ms) | {a} / {b} | {b} / floor |",
             "| --- | --- | --- | --- | --- |"]
    for T in ROWS:
        lines.append(f"| {'1-row decode' if T == 1 else f'{T}-row verify'} | {t[(T, False)]:.2f} | "
                     f"{t[(T, True)]:.2f} | {t[(T, False)] / t[(T, True)]:.2f}x | "
                     f"{t[(T, True)] / floor_ms:.2f}x |")
    verify = f"{ROWS[-1]}-row verify / 1-row decode: {b} {t[(ROWS[-1], True)] / t[(1, True)]:.2f}x, " \
             f"{a} {t[(ROWS[-1], False)] / t[(1, False)]:.2f}x."
    num = res["logits"]
    out = [f"CPU {info.get('cpu', '?')}, flags {' '.join(info.get('flags', []))}; native build "
           f"`{cpu_native.build_for_this_cpu()}` (int8 products: {cpu_native.int8_instructions()}), "
           f"torch capability "
           f"{torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}, {args.threads} threads, "
           f"clock {args.clock}; plan `{res['plan']}`; {args.keys} cached keys. {args.rounds} alternating "
           f"rounds of {args.repeats} forwards, median of the round medians. `python -m benchmarks.forward`.",
           "", f"Floor: {res['bytes'] / 1e6:.1f} MB of packed weights at {res['bandwidth'] / 1e9:.1f} GB/s "
           f"(measured read bandwidth) = {floor_ms:.2f} ms.", "", *lines, "", verify, "",
           f"Logits, {b} vs {a}, {num['steps']} greedy decode steps: max |difference| "
           f"{num['max_diff']:.3f} ({100 * num['share']:.2f}% of the largest |logit|), argmax agreement "
           f"{100 * num['argmax_agree']:.1f}%."]
    if "greedy" in res:
        g = res["greedy"]
        out += ["", f"Greedy outputs on {g['tasks']} shared tasks (default speculation, no retries): "
                f"{g['native_vs_torch']} differ between {b} and {a}; "
                f"{g['spec_on_vs_off']} differ between speculation on and off on {b}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--logit-prompts", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=0, help="greedy outputs of the first N shared tasks")
    ap.add_argument("--int8", action="store_true",
                    help="compare int8 activations against bf16 on the native forward")
    ap.add_argument("--out", type=Path, help="write the section into this markdown file")
    args = ap.parse_args(argv)
    if args.int8 and not cpu_native.int8_activations():
        ap.error("--int8: this CPU's native library has no integer dot products (AVX-512-VNNI / AVX-VNNI)")
    torch.set_num_threads(args.threads)
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    loaded = load_model(None, quiet=True)
    runner = loaded.runner
    assert isinstance(runner, LeanRunner)  # the embedded model always runs on the lean runner
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    slot = runner.new_slot()
    runner.forward([slot], [[100 + (7 * j) % 4000 for j in range(args.keys)]], [0])
    res: dict[str, Any] = {"plan": loaded.describe_kernels()["plan"], "bytes": packed_bytes(runner),
                           "times": time_forwards(runner, slot, args.keys, args.rounds, args.repeats, now,
                                                  args.int8)}
    runner.free_slot(slot)
    res["bandwidth"] = read_bandwidth(args.threads)
    torch.set_num_threads(args.threads)
    prompts = [loaded.tokenizer.encode(t["prompt"]) for t in tasks[: args.logit_prompts]]
    res["logits"] = dict(logit_difference(runner, prompts, int8=args.int8), steps=8 * len(prompts))
    if args.tasks:
        res["greedy"] = greedy_outputs(loaded, tasks[: args.tasks], args.int8)
    body = render(res, args)
    print(body)
    if args.out:
        write_section(args.out, HEADING_INT8 if args.int8 else HEADING, body)


if __name__ == "__main__":
    main()
