"""What the exact runner costs: decode / verify forwards with ``exact`` on and off, one process.

The embedded model is loaded once (its own kernel plan); slots are prefilled to ``--keys``
cached tokens; for each case (1 row, a 6-row verify, 4 requests x 6 rows) and key count, the
same runner runs the forward with ``exact`` True and False alternately (the flag is read per
forward), ``--rounds`` rounds of ``--repeats`` forwards each, the cache truncated back after
every forward. Reported: the median of the per-round medians (ms) and the ratio exact / not.
Run it on a quiet machine: another process on the second core stalls torch's ops.

    python -m benchmarks.exact [--keys 200 1000] [--threads 2] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks._results import write_section
from constrained_spec import load_model
from constrained_spec.model.plan import machine_info
from constrained_spec.model.runner import LeanRunner

CASES = (("1 row", 1, 1), ("6-row verify", 1, 6), ("4 requests x 6 rows", 4, 6))
HEADING = "## Exact runner: its cost with query-invariant chunked attention"


def measure(keys: list[int], rounds: int, repeats: int) -> tuple[dict, str]:
    loaded = load_model(None, quiet=True)
    runner = loaded.runner
    assert isinstance(runner, LeanRunner)  # the embedded model always runs on the lean runner
    out: dict = {}
    for n in keys:
        slots = [runner.new_slot() for _ in range(4)]
        for i, s in enumerate(slots):  # the requests differ by a few tokens, as in a batch
            runner.forward([s], [[100 + (7 * j + i) % 4000 for j in range(n - 3 * i)]], [0])
        lengths = [runner.length(s) for s in slots]
        for name, B, T in CASES:
            samples: dict[bool, list[float]] = {True: [], False: []}
            for r in range(rounds + 1):  # round 0 warms up
                for exact in ((True, False) if r % 2 else (False, True)):
                    runner.exact = exact
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        runner.forward(slots[:B], [[500 + j for j in range(T)]] * B, [T] * B, phase="decode")
                        times.append(time.perf_counter() - t0)
                        for s, m in zip(slots[:B], lengths[:B]):
                            runner.truncate(s, m)
                    if r:
                        samples[exact].append(statistics.median(times) * 1000)
            out[(n, name)] = {e: statistics.median(v) for e, v in samples.items()}
        for s in slots:
            runner.free_slot(s)
    runner.exact = True
    return out, loaded.describe_kernels()["plan"]


def render(res: dict, keys: list[int], plan: str, args: argparse.Namespace) -> str:
    info = machine_info()
    head = "| forward | " + " | ".join(f"{n} keys: exact / not (ms) | ratio" for n in keys) + " |"
    lines = [head, "| --- |" + " --- | --- |" * len(keys)]
    for name, _, _ in CASES:
        cells = []
        for n in keys:
            e, ne = res[(n, name)][True], res[(n, name)][False]
            cells.append(f"{e:.1f} / {ne:.1f} | {e / ne:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join([
        f"CPU {info.get('cpu', '?')}, flags {' '.join(info.get('flags', []))}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; plan `{plan}`. One process, the "
        f"flag flipped per forward, {args.rounds} alternating rounds of {args.repeats} forwards, "
        "median of the round medians. `python -m benchmarks.exact`.", "", *lines])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res, plan = measure(args.keys, args.rounds, args.repeats)
    body = render(res, args.keys, plan, args)
    print(body)
    if args.out:
        write_section(args.out, HEADING, body)


if __name__ == "__main__":
    main()
