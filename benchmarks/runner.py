"""Target forward cost by rows: dense bf16 weights vs the exact int4 path (constrained_spec.model.runner).

One process, the embedded model loaded twice (``int4=False`` / ``int4=True``), a slot holding
``--context`` cached tokens; for each row count T (tokens appended in one forward, as in a
verification step of T-1 drafts) the two runners alternate, ``--repeats`` forwards each, the
cache truncated back after every forward. Reported: milliseconds per forward (median) and the
speed-up. ``--clock cpu`` measures process CPU time instead of wall time: with one thread it
is far less disturbed by other processes on a shared machine (a contended memory bus still
shows).

    python -m benchmarks.runner [--threads 1] [--clock cpu|wall] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks._results import write_section
from constrained_spec import load_model
from constrained_spec.model.runner import FEW_ROWS, LeanRunner

ROWS = (1, 2, 4, 6, 8, 10, 12, 13, 16, 22)


def measure(threads: int, clock: str, context: int, repeats: int, rows: tuple[int, ...]) -> dict:
    torch.set_num_threads(threads)
    now = time.process_time if clock == "cpu" else time.perf_counter
    runners = {name: load_model(None, int4=flag, quiet=True).runner
               for name, flag in (("dense", False), ("int4", True))}
    slots = {}
    for name, r in runners.items():
        slots[name] = r.new_slot()
        r.forward([slots[name]], [list(range(100, 100 + context))], [1])
    out: dict = {name: {} for name in runners}
    for T in rows:
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for rep in range(repeats + 2):
            for name in (list(runners) if rep % 2 == 0 else list(runners)[::-1]):
                r, s = runners[name], slots[name]
                t0 = now()
                r.forward([s], [[500 + i for i in range(T)]], [T])
                dt = now() - t0
                r.truncate(s, context)
                if rep >= 2:  # two warm-up rounds
                    samples[name].append(dt * 1000)
        for name in runners:
            out[name][T] = statistics.median(samples[name])
    int4 = runners["int4"]
    assert isinstance(int4, LeanRunner)  # the embedded model always runs on the lean runner
    out["int4_linears"] = int4.quantized_linears
    return out


def render(res: dict, args: argparse.Namespace) -> str:
    lines = ["| rows (1 + drafts) | dense bf16 (ms) | int4 path (ms) | speed-up |",
             "| ---: | ---: | ---: | ---: |"]
    for T in args.rows:
        d, q = res["dense"][T], res["int4"][T]
        lines.append(f"| {T} | {d:.1f} | {q:.1f} | {d / q:.2f}x |")
    cpu = platform.processor() or platform.machine()
    return "\n".join([
        f"Embedded model, {args.context} cached tokens, {args.threads} thread(s), "
        f"{'process CPU time' if args.clock == 'cpu' else 'wall time'} per forward (median of "
        f"{args.repeats}), {cpu} ({torch.get_num_threads()} torch threads), torch "
        f"{torch.__version__}. The int4 path covers {res['int4_linears']} linears (every q/k/v, o, "
        f"gate/up, down of the 30 layers; the tied embedding / LM head is Q8_0 in the GGUF and "
        f"stays dense bf16); past {FEW_ROWS} rows the runner switches to the dense copy, so "
        "the int4 column above that shows the dense cost. `python -m benchmarks.runner`.",
        "", *lines])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    args = ap.parse_args(argv)
    res = measure(args.threads, args.clock, args.context, args.repeats, tuple(args.rows))
    body = render(res, args)
    print(body)
    if args.out:
        write_section(args.out, "## Target forward: dense bf16 vs exact int4 weights", body)


if __name__ == "__main__":
    main()
