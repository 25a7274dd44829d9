"""Resident memory of a loaded model: peak and settled RSS of one process that loads it the way
``constrained_spec.generate`` does by default and extracts one short object.

    python -m benchmarks.load_memory                  # the embedded model, 3 processes
    python -m benchmarks.load_memory --gguf FILE      # a user's GGUF
    python -m benchmarks.load_memory --repeats 1 --fingerprint

Every measurement runs in a fresh Python process (peak RSS is per process), which reads its own
``/proc/self/status`` between the phases of a load: VmRSS (resident now) and VmHWM (the peak so
far). The phases: ``imports`` (``from constrained_spec import generate``: what a user's script
imports), ``load`` (`load_model`: the converted folder read, the tokenizer), ``runner`` (the
runner and its kernel plan's packs), ``generate`` (one greedy object from a short prompt) and
``settled`` (the same process after it, the heap trimmed as a load trims it).

``--fingerprint`` also prints a digest of the greedy tokens and of the logits' bytes of a fixed
prompt, for checking that a change to loading leaves the outputs bit-identical. The numbers go
into benchmarks/RESULTS.md ("Memory of a loaded model (issue 43)") by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._memory import rss_mib
from benchmarks._workers import module_env

PHASES = ("imports", "load", "runner", "generate", "settled")
PROMPT = "Ada Lovelace, 36, mathematician"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _sample(phases: dict[str, tuple[float, float]], name: str) -> None:
    phases[name] = rss_mib(os.getpid())


def _fingerprint(loaded: Any) -> dict[str, str]:
    """Digests of a fixed prompt's last-position logits (their bytes) and of 16 greedy tokens."""
    import torch

    runner = loaded.runner
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    slot = runner.new_slot()
    logits = runner.forward([slot], [ids], [1])
    digest = hashlib.sha256(logits.float().contiguous().numpy().tobytes())
    tokens = []
    for _ in range(16):
        tokens.append(int(torch.argmax(logits[-1])))
        logits = runner.forward([slot], [[tokens[-1]]], [1])
        digest.update(logits.float().contiguous().numpy().tobytes())
    runner.free_slot(slot)
    return {"logits_sha256": digest.hexdigest()[:16],
            "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}


def child(model: str | None, fingerprint: bool) -> dict[str, Any]:
    """One measurement in this process (started fresh by `main`)."""
    phases: dict[str, tuple[float, float]] = {}
    from constrained_spec import generate

    _sample(phases, "imports")
    from constrained_spec.model.loading import load_model, release_free_memory

    loaded = load_model(model, quiet=True)
    _sample(phases, "load")
    kernels = loaded.describe_kernels()  # builds the runner and its plan's packs
    _sample(phases, "runner")
    out = generate(loaded, PROMPT, schema=SCHEMA, max_tokens=48)
    _sample(phases, "generate")
    release_free_memory()
    _sample(phases, "settled")
    result: dict[str, Any] = {"phases": phases, "output": out, "plan": kernels["plan"],
                              "resident_weights_mb": kernels["resident_bytes"] / 2**20}
    if fingerprint:
        result.update(_fingerprint(loaded))
    return result


def _run_child(model: str | None, fingerprint: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.load_memory", "--child"]
    if model is not None:
        cmd += ["--gguf", model]
    if fingerprint:
        cmd.append("--fingerprint")
    done = subprocess.run(cmd, capture_output=True, text=True, env=module_env(os.environ),
                          check=False)
    if done.returncode:
        raise RuntimeError(f"measurement failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(runs: list[dict[str, Any]]) -> None:
    """One table row per phase: median RSS and peak so far over the runs (MiB)."""
    print("| phase | RSS MB (median) | peak so far MB (median) |")
    print("| --- | --- | --- |")
    for name in PHASES:
        rss = statistics.median(r["phases"][name][0] for r in runs)
        peak = statistics.median(r["phases"][name][1] for r in runs)
        print(f"| {name} | {rss:.0f} | {peak:.0f} |")
    last = runs[-1]
    print(f"\nplan {last['plan']}; resident weights {last['resident_weights_mb']:.0f} MB; "
          f"output {last['output']}")
    for key in ("logits_sha256", "tokens_sha256"):
        if key in last:
            print(f"{key}: {sorted({r[key] for r in runs})}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes measured")
    ap.add_argument("--fingerprint", action="store_true",
                    help="digests of a fixed prompt's logits and greedy tokens")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model = None if args.gguf is None else str(args.gguf)
    if args.child:
        print(json.dumps(child(model, args.fingerprint)))
        return
    runs = [_run_child(model, args.fingerprint) for _ in range(args.repeats)]
    _report(runs)


if __name__ == "__main__":
    main()
