"""Microbenchmark of the kernels: microseconds per call, as a markdown table.

- apply_bitmask (our dispatcher) vs xgrammar.apply_token_bitmask_inplace vs our torch
  reference, at batch x (K + 1) logits rows, K = 5, for two vocabulary sizes.
- rejection_sample: the dispatcher, the vectorised torch path and the loop reference, K = 5
  point-mass drafts per request (85% of them the target's likely token, p~ ~ 0.9), sampled
  (not greedy), uniform / exp_noise drawn beforehand (kernel time only).

Runs on the CPU always and on CUDA too when available. Each number is the median of
repeated calls after one warm-up call. The bitmasks look like grammar masks: a mix of
all-allowed, all-disallowed and random words.

    python -m benchmarks.kernels                 # CPU (and GPU), prints the table
    python -m benchmarks.kernels --out benchmarks/out/kernels.md --threads 2
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

from constrained_spec.kernels import (
    apply_bitmask,
    apply_bitmask_reference,
    rejection_sample,
    rejection_sample_reference,
)
from constrained_spec.kernels.rejection import _rejection_sample_torch

K = 5


def time_call(fn: Callable[[], object], device: torch.device, *, budget_s: float,
              max_repeats: int) -> float:
    """Median microseconds per call of fn(), after one warm-up call."""
    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    first = once()
    repeats = int(min(max_repeats, max(3, budget_s / max(first, 1e-6))))
    return statistics.median(once() for _ in range(repeats)) * 1e6


def grammar_like_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 3, (rows, words), generator=gen)
    return torch.where(kind == 0, 0, torch.where(kind == 1, -1, bitmask)).to(torch.int32)


def bench_apply_bitmask(device: torch.device, dtype: torch.dtype, batches: list[int],
                        vocabs: list[int], budget_s: float) -> list[list[str]]:
    xgrammar: ModuleType | None
    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    cases = [(v, b) for v in vocabs for b in batches]
    for vocab, batch in tqdm(cases, desc=f"apply_bitmask {device.type}", leave=False):
        rows = batch * (K + 1)
        logits = torch.randn(rows, vocab, generator=gen).to(device=device, dtype=dtype)
        bitmask = grammar_like_bitmask(rows, vocab, gen).to(device)
        # masking is idempotent, so repeating the call on the same logits times the same work
        # (the partials bind this iteration's tensors: the `del` below frees them before the next)
        ours = time_call(functools.partial(apply_bitmask, logits, bitmask), device,
                         budget_s=budget_s, max_repeats=200)
        theirs = (time_call(functools.partial(xgrammar.apply_token_bitmask_inplace, logits, bitmask),
                            device, budget_s=budget_s, max_repeats=200)
                  if xgrammar is not None else float("nan"))
        reference = time_call(functools.partial(apply_bitmask_reference, logits, bitmask), device,
                              budget_s=budget_s, max_repeats=50)
        rows_out.append([device.type, "apply_bitmask", str(vocab), f"{batch} x {K + 1}",
                         f"{ours:,.0f}", f"{theirs:,.0f}", f"{reference:,.0f}",
                         f"{theirs / ours:.2f}x"])
        del logits, bitmask
    return rows_out


def bench_rejection(device: torch.device, batches: list[int], vocab: int,
                    budget_s: float) -> list[list[str]]:
    gen = torch.Generator().manual_seed(1)
    rows_out = []
    for batch in tqdm(batches, desc=f"rejection_sample {device.type}", leave=False):
        num_drafts, num_rows = batch * K, batch * (K + 1)
        # a peaked target whose likely token the drafter proposes 85% of the time
        logits = torch.randn(num_rows, vocab, generator=gen) * 2
        likely = torch.randint(0, vocab, (num_rows,), generator=gen)
        logits[torch.arange(num_rows), likely] += 16
        draft_rows = torch.arange(num_drafts) + torch.arange(num_drafts) // K
        drafts = torch.where(torch.rand(num_drafts, generator=gen) < 0.85, likely[draft_rows],
                             torch.randint(0, vocab, (num_drafts,), generator=gen))
        args: dict[str, Any] = dict(
            target_logits=logits.to(device), draft_tokens=drafts.to(device),
            cu_num_drafts=torch.arange(0, num_drafts + 1, K).to(device), greedy=False,
            uniform=torch.rand(num_drafts, generator=gen).to(device),
            exp_noise=torch.empty(num_rows, vocab).exponential_(generator=gen).to(device))
        accepted = rejection_sample(**args).num_accepted.float().mean().item()
        times = [time_call(functools.partial(fn, **args), device, budget_s=budget_s, max_repeats=50)
                 for fn in (rejection_sample, _rejection_sample_torch,
                            rejection_sample_reference)]
        rows_out.append([device.type, str(vocab), str(batch), f"{accepted:.1f} / {K}",
                         *(f"{t:,.0f}" for t in times)])
    return rows_out


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the markdown table to this file")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="logits dtype for apply_bitmask")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256],
                        help="requests per call for apply_bitmask (rows = batch x 6)")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--rejection-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rejection-vocab", type=int, default=128256)
    parser.add_argument("--budget", type=float, default=0.5,
                        help="seconds of repeated calls per measurement (at least 3 calls)")
    parser.add_argument("--no-gpu", action="store_true", help="skip CUDA even if available")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and not args.no_gpu:
        devices.append(torch.device("cuda"))
    bitmask_rows, rejection_rows = [], []
    for device in devices:
        bitmask_rows += bench_apply_bitmask(device, dtype, args.batches, args.vocabs,
                                            args.budget)
        rejection_rows += bench_rejection(device, args.rejection_batches,
                                          args.rejection_vocab, args.budget)

    lines = [
        f"Kernels, µs per call (median). {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", GPU {torch.cuda.get_device_name()}" if len(devices) > 1 else "") + ".",
        "",
        f"apply_bitmask, logits {args.dtype}, K + 1 = {K + 1} rows per request:",
        "",
        *markdown(["device", "op", "V", "rows", "ours µs", "xgrammar µs",
                   "torch reference µs", "xgrammar / ours"], bitmask_rows),
        "",
        f"rejection_sample, float32 logits, K = {K} point-mass drafts, sampled:",
        "",
        *markdown(["device", "V", "requests", "accepted", "dispatcher µs", "vectorised µs",
                   "loop reference µs"], rejection_rows),
    ]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
