"""The native CPU kernels against torch's, one process, on the embedded model's shapes.

- q4 against torch's int4 kernel over the 120 linears of the embedded model (30 layers of
  qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; random 4-bit groups with float16
  scales, as Q4_1 has), 1 / 4 / 7 / 16 rows: every matrix once per pass, so the weights come
  from memory as in a forward, not from the cache;
- q8 against the bf16 product for the 49,152 x 576 LM head (a Q8_0 matrix);
- the exact decode attention against `model.attention.chunked_attention` (9 heads over 3 kv
  heads of 64, one request, 7 verify rows) at 200 / 450 / 700 keys, per layer.

Medians of ``--repeats`` alternating rounds. Run it on a quiet machine; for the AVX2 build
and torch's AVX2 kernels, under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2`` (the table names the build and torch's capability).

    python -m benchmarks.native_kernels [--threads 2] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks._results import write_section
from constrained_spec.kernels import cpu_native
from constrained_spec.model.attention import chunk_mask, chunked_attention
from constrained_spec.model.plan import machine_info
from constrained_spec.model.weights import Int4Groups, packed_matmul

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
ROWS = (1, 4, 7, 16)
HEADING = "## Native CPU kernels against torch's"


def _median_ms(fn: Callable[..., object], repeats: int, *args: object) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def linears(repeats: int) -> list[list[str]]:
    gen = torch.Generator().manual_seed(0)
    weights = []
    for n, k in SHAPES:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
        minimum = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
        g = Int4Groups.from_values(q, scale, minimum)
        pack = g.int4_pack()
        assert pack is not None, "this torch build has no CPU int4 kernel"
        weights.append((cpu_native.pack(q, scale, minimum), pack, k))
    rows = []
    for m in ROWS:
        x = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        ours = _median_ms(lambda x: [cpu_native.matmul(x[k], p) for p, _, k in weights], repeats, x)
        theirs = _median_ms(lambda x: [packed_matmul(x[k], t) for _, t, k in weights], repeats, x)
        rows.append([f"120 linears, {m} rows", f"{ours:.1f}", f"{theirs:.1f} (int4)", f"{theirs / ours:.2f}x"])
    return rows


def lm_head(repeats: int) -> list[list[str]]:
    gen = torch.Generator().manual_seed(1)
    V, K = 49152, 576
    q = torch.randint(-127, 128, (V, K), generator=gen).to(torch.int8)
    scale = (torch.rand(V, K // 32, generator=gen) * 0.01).half().float()
    packed = cpu_native.pack_q8(q, scale)
    dense = (q.float().view(V, -1, 32) * scale[..., None]).view(V, K).bfloat16()
    del q
    rows = []
    for m in (1, 4, 8):
        x = torch.randn(max(m, 2), K, generator=gen).bfloat16()  # bf16: 2 rows (exact pads 1 to 2)
        ours = _median_ms(lambda x: cpu_native.matmul(x, packed), repeats, x[:m])
        theirs = _median_ms(lambda x: F.linear(x, dense), repeats, x)
        rows.append([f"LM head 49152x576, {m} rows", f"{ours:.2f}", f"{theirs:.2f} (bf16)", f"{theirs / ours:.2f}x"])
    return rows


def attention(repeats: int) -> list[list[str]]:
    gen = torch.Generator().manual_seed(2)
    H, KV, hd, T = 9, 3, 64, 7
    kc = torch.randn(1, 1024, KV, hd, generator=gen).bfloat16()
    vc = torch.randn(1, 1024, KV, hd, generator=gen).bfloat16()
    q = torch.randn(T, H, hd, generator=gen).bfloat16()
    rows = []
    for n in (200, 450, 700):
        pos = torch.arange(n - T, n)
        spans = torch.stack([torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long),
                             pos + 1]).to(torch.int32)
        Lk = -(-n // 256) * 256
        mask = chunk_mask((torch.arange(Lk)[None, :] <= pos[:, None])[None], heads=H, kv_heads=KV,
                          dtype=torch.bfloat16)
        keys, vals = kc[:, :Lk], vc[:, :Lk]
        ours = _median_ms(lambda spans: cpu_native.attention(q, kc, vc, spans, hd ** -0.5), repeats, spans)
        theirs = _median_ms(lambda keys, vals, mask: chunked_attention(q[None], keys, vals, mask, hd ** -0.5),
                            repeats, keys, vals, mask)
        rows.append([f"attention, {T} rows, {n} keys (per layer)", f"{ours * 1e3:.0f} us",
                     f"{theirs * 1e3:.0f} us (chunked flash)", f"{theirs / ours:.2f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    build = cpu_native.build_for_this_cpu()
    if not cpu_native.available():
        raise SystemExit("the native kernels do not build on this machine")
    rows = linears(args.repeats) + lm_head(args.repeats) + attention(args.repeats)
    info = machine_info()
    body = "\n".join([
        f"CPU {info.get('cpu', '?')}, flags {' '.join(info.get('flags', []))}; torch "
        f"{torch.__version__} capability {info.get('capability')}, {args.threads} threads; native "
        f"build `{build}`. `python -m benchmarks.native_kernels` (median of {args.repeats}).", "",
        "| product | ours ms | torch ms | speed-up |", "| --- | --- | --- | --- |",
        *("| " + " | ".join(r) + " |" for r in rows)])
    print(body)
    if args.out:
        write_section(args.out, f"{HEADING} ({build} build)", body)


if __name__ == "__main__":
    main()
