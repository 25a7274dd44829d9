"""Time and peak memory of reading a GGUF: ``gguf_weights`` vs transformers' GGUF load.

    python -m benchmarks.gguf_load                 # the embedded model's GGUF
    python -m benchmarks.gguf_load --gguf path/to/model.gguf

Each row runs in a fresh Python process (peak RSS is per process, ``VmHWM``), one after
the other, and prints one markdown table row:

- ``imports``: torch, transformers, gguf and transformers' llama modeling code imported
  (~140 MB of it; every row imports it before its clock starts), nothing read: the floor;
- ``gguf_weights int4``: `read_gguf`, then ``int4_groups()`` of every linear weight, all kept;
- ``gguf_weights int4 + rest fp32``: the same, plus every other tensor (embeddings, norms)
  dequantized to float32 and kept -- everything a model needs;
- ``transformers fp32``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...,
  dtype=torch.float32)``, which dequantizes every tensor to float32.

The numbers go into benchmarks/RESULTS.md ("GGUF loading (embedded model)") by hand;
nothing is written here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._memory import own_peak_rss_mib
from benchmarks._workers import module_env

MODES = ("imports", "int4", "int4+rest", "transformers")
LABELS = {"imports": "imports only", "int4": "gguf_weights int4",
          "int4+rest": "gguf_weights int4 + rest fp32", "transformers": "transformers fp32"}


def run_mode(mode: str, gguf: Path) -> dict:
    import gguf as _gguf  # noqa: F401
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (both paths build a llama)

    kept: list = []
    read_seconds = None
    t0 = time.perf_counter()
    if mode in ("int4", "int4+rest"):
        from constrained_spec.model.gguf import read_gguf

        model = read_gguf(gguf)
        read_seconds = time.perf_counter() - t0
        for name, t in model.tensors.items():
            groups = t.int4_groups() if name.endswith("_proj.weight") else None
            if groups is not None:
                kept.append(groups)
            elif mode == "int4+rest":
                kept.append(t.dequantize())
    elif mode == "transformers":
        from transformers import AutoModelForCausalLM

        kept.append(AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32))
    seconds = time.perf_counter() - t0
    return {"mode": mode, "seconds": seconds, "read_seconds": read_seconds,
            "peak_rss_mb": own_peak_rss_mib()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded model's GGUF")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.gguf is None:
        from constrained_spec.model.embedded import fetch_default_gguf

        args.gguf = fetch_default_gguf()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.gguf)))
        return
    print(f"{args.gguf.name}, {args.gguf.stat().st_size / 2**20:.0f} MiB")
    print("| load | seconds | of which read_gguf | peak RSS (MiB) |\n| --- | --- | --- | --- |")
    for mode in MODES:
        out = subprocess.run([sys.executable, "-m", "benchmarks.gguf_load", "--gguf", str(args.gguf),
                              "--mode", mode], check=True, capture_output=True, text=True,
                             env=module_env(os.environ)).stdout
        r = json.loads(out.strip().splitlines()[-1])
        read = "" if r["read_seconds"] is None else f"{r['read_seconds']:.1f}"
        print(f"| {LABELS[mode]} | {r['seconds']:.1f} | {read} | {r['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
