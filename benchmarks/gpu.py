"""One prepared run for a CUDA machine: the kernels on the device, then tokens/s of the
embedded model at batch 1 / 8 / 64, speculation on (the default drafter) and off:
(a) every kernel dispatcher on the device (Triton on CUDA) against its torch reference on the
CPU, on the same inputs, then ``benchmarks/kernels.py``'s rows for the device; (b) a Generator
over N prompts at once (the shared tasks cycled, each with its own schema, greedy, max_tokens
the batch's largest), one timed batch per row after an untimed 16-token run of it; (c) the
markdown tables, printed and written with the raw figures to ``--out`` (default ``$OUT``) as
gpu.md and gpu.json. Exit status 1 when a kernel disagrees with its reference: exactly for the
masks and the greedy path; for the sampled rejection path within ``--sampled-tolerance`` of
the rows (a softmax summed in another order on CUDA may move a draw that sits on a boundary:
a real bug moves many). (d) where vLLM is installed, the same batches on the vLLM engine
(``load_model(engine="vllm")``; the lent GPU machine has no vLLM -- its CUDA wheel is far
larger than what can be brought there -- and the rows say so). ``--max-tokens`` caps every
task's budget.

Needs there: torch with CUDA and Triton; this package (``pip install --no-deps
--no-build-isolation -e .``); what a CUDA image lacks, as wheels: xgrammar and outlines-core
(pydantic, jsonschema, gguf, platformdirs where missing); the embedded model, offline:
``CONSTRAINED_SPEC_CACHE`` at a folder with ``gguf/SmolLM2-135M-Instruct.Q4_1.gguf`` in it
(converted there on first use), or ``--model`` a checkpoint folder.

    python -m benchmarks.gpu                                          # on the GPU machine
    python -m benchmarks.gpu --device cpu --batches 1,2 --limit 2     # dry run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import kernels as kernel_bench
from benchmarks import speculation
from constrained_spec import GenerationResult, Generator, IncompleteOutputError, load_model
from constrained_spec import kernels as ks
from constrained_spec.model.plan import machine_info

K = 5


def check_kernels(dev: torch.device, batch: int = 8, vocab: int = 128256,
                  draft_vocab: int = 32000, sampled_tolerance: float = 0.02) -> list[dict]:
    """Each dispatcher on ``dev`` against its reference on the CPU, same inputs: equal outputs
    (the contract tests/kernels holds the Triton kernels to under the CPU interpreter)."""
    g = torch.Generator().manual_seed(0)
    rows = batch * (K + 1)
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = kernel_bench.grammar_like_bitmask(rows, vocab, g)
    d2t = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    draft_logits = torch.randn(rows, draft_vocab, generator=g)
    drafts = torch.randint(0, vocab, (batch * K,), generator=g)
    half = torch.arange(0, batch * K, 2)  # every other draft is the target's argmax
    drafts[half] = logits[half + half // K].argmax(-1)
    rej: dict[str, Any] = dict(draft_tokens=drafts, cu_num_drafts=torch.arange(0, batch * K + 1, K),
               uniform=torch.rand(batch * K, generator=g),
               exp_noise=torch.empty(rows, vocab).exponential_(generator=g))

    def masked(fn, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        fn(x, *args)
        return x.cpu()

    logits_d, bitmask_d, d2t_d = logits.to(dev), bitmask.to(dev), d2t.to(dev)
    cases = [
        ("apply_bitmask", lambda: masked(ks.apply_bitmask, logits_d, bitmask_d),
         lambda: masked(ks.apply_bitmask_reference, logits, bitmask)),
        ("bitmask_to_draft_vocab", lambda: ks.bitmask_to_draft_vocab(bitmask_d, d2t_d).cpu(),
         lambda: ks.bitmask_to_draft_vocab_reference(bitmask, d2t)),
        ("apply_target_bitmask_to_draft_logits",
         lambda: masked(ks.apply_target_bitmask_to_draft_logits, draft_logits.to(dev), bitmask_d, d2t_d),
         lambda: masked(ks.apply_target_bitmask_to_draft_logits_reference, draft_logits, bitmask, d2t)),
    ] + [(f"rejection_sample greedy={greedy}",
          lambda greedy=greedy: ks.rejection_sample(
              logits_d, greedy=greedy, **{k: v.to(dev) for k, v in rej.items()}).output_tokens.cpu(),
          lambda greedy=greedy: ks.rejection_sample_reference(logits, greedy=greedy, **rej).output_tokens)
         for greedy in (True, False)]
    out = []
    for name, mine, ref in cases:
        a, b = mine(), ref()
        mismatches = int((a != b).sum())
        # exact everywhere but the sampled path, where a draw on a boundary may move
        allowed = int(sampled_tolerance * a.numel()) if name.endswith("greedy=False") else 0
        out.append(dict(kernel=name, device=dev.type, rows=rows, vocab=vocab, draft_vocab=draft_vocab,
                        equal=mismatches <= allowed, mismatches=mismatches, allowed=allowed))
    return out


def throughput(model: object, tasks: list[dict], batch: int, speculative: bool,
               max_tokens: int | None = None, engine: str = "native") -> dict:
    """One batch of ``batch`` prompts (tasks cycled), after the same batch for 16 tokens
    (untimed: grammar compiles, first-use costs at these shapes)."""
    if max_tokens is not None:
        tasks = [{**t, "max_tokens": min(t["max_tokens"], max_tokens)} for t in tasks]
    gen: Generator[Any] = Generator(model, speculative=None if speculative else False,
                                    max_batch_size=max(batch, 1))
    picked = [tasks[i % len(tasks)] for i in range(batch)]
    prompts, schemas = [t["prompt"] for t in picked], [speculation.task_schema(t) for t in picked]
    gen.batch(prompts, schemas=schemas, max_tokens=16)  # compiles (cached), this batch's shapes
    on_cuda = gen.model.device.type == "cuda" and torch.cuda.is_available()
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    res = gen.batch(prompts, schemas=schemas, return_result=True,
                    max_tokens=max(t["max_tokens"] for t in picked))
    sync()
    wall = time.perf_counter() - t0
    ids = [r.token_ids if isinstance(r, (GenerationResult, IncompleteOutputError)) else [] for r in res]
    stats = [r.stats for r in res if getattr(r, "stats", None) is not None]
    forwards = sum(s.target_forwards for s in stats)
    return dict(engine=engine, batch=batch, speculation="on" if speculative else "off", tokens=sum(map(len, ids)),
                wall_s=wall, tok_s=sum(map(len, ids)) / wall,
                acc_len=sum(s.emitted_tokens for s in stats) / forwards if forwards else None,
                completed_valid=sum(isinstance(r, GenerationResult) for r in res))


def vllm_rows(model_path: str | None, tasks: list[dict], batches: list[int],
              max_tokens: int | None) -> list[dict]:
    """The batches on vLLM's engine, or one row saying why they cannot run here."""
    try:
        from constrained_spec.generation.vllm_engine import import_vllm

        import_vllm()
        model = load_model(model_path, engine="vllm", quiet=True)
    except Exception as e:  # not installed (the lent GPU machine), or it cannot start here
        return [dict(engine="vllm", batch=0, speculation="—",
                     skipped=f"skipped: {type(e).__name__}: {str(e)[:160]}")]
    return [throughput(model, tasks, b, s, max_tokens, engine="vllm")
            for b in batches for s in (True, False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated requests per batch")
    ap.add_argument("--limit", type=int, default=None, help="the first N tasks only (cycled)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--budget", type=float, default=0.3, help="kernels.py seconds per row")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every task's max_tokens")
    ap.add_argument("--sampled-tolerance", type=float, default=0.02,
                    help="share of the sampled rejection path's tokens that may differ from the CPU")
    ap.add_argument("--engines", default="native,vllm",
                    help="native (ours), vllm (where installed; else its rows say why)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    tasks = [json.loads(line) for line in speculation.DEFAULT_TASKS.read_text().splitlines() if line.strip()]
    tasks = tasks[: args.limit] if args.limit else tasks
    batches = [int(b) for b in args.batches.split(",")]

    checks = check_kernels(dev, sampled_tolerance=args.sampled_tolerance)
    bench = (kernel_bench.bench_apply_bitmask(dev, torch.float32, batches, [49152, 128256], args.budget),
             kernel_bench.bench_rejection(dev, batches, 128256, args.budget))
    model = load_model(args.model, device=dev, quiet=True)
    engines = args.engines.split(",")
    rows = [throughput(model, tasks, b, s, args.max_tokens) for b in batches for s in (True, False)
            if "native" in engines]
    if "vllm" in engines:
        rows += vllm_rows(args.model, tasks, batches, args.max_tokens)

    info = machine_info()
    where = (f"{torch.cuda.get_device_name(dev)}, CUDA {torch.version.cuda}" if dev.type == "cuda" else
             f"CPU {info['cpu']}, flags {' '.join(info['flags'])}, capability {info['capability']}")
    desc = model.describe_kernels() if hasattr(model, "describe_kernels") else {}
    tables = [
        (["kernel", "device", "rows", "V (draft V)", "agrees with the CPU reference",
          "mismatches (allowed)"],
         [[c["kernel"], c["device"], str(c["rows"]), f"{c['vocab']} ({c['draft_vocab']})",
           str(c["equal"]), f"{c['mismatches']} ({c['allowed']})"] for c in checks]),
        (["device", "op", "V", "rows", "ours µs", "xgrammar µs", "torch reference µs",
          "xgrammar / ours"], bench[0]),
        (["device", "V", "requests", "accepted", "dispatcher µs", "vectorised µs",
          "loop reference µs"], bench[1]),
        (["engine", "batch", "speculation", "tokens", "wall s", "tokens/s", "acceptance length",
          "completed valid"],
         [[r["engine"], str(r["batch"]), r["speculation"], *(
             [r["skipped"], "", "", "", ""] if "skipped" in r else
             [str(r["tokens"]), f"{r['wall_s']:.2f}", f"{r['tok_s']:.1f}",
              "—" if r["acc_len"] is None else f"{r['acc_len']:.2f}", f"{r['completed_valid']} / {r['batch']}"])]
          for r in rows])]
    lines = [f"Device: {where}; torch {torch.__version__}; model {model.name} in "
             f"{str(model.dtype).removeprefix('torch.')}, plan {desc.get('plan', '—')}; "
             f"{len(tasks)} tasks cycled, greedy, max_tokens the batch's largest."]
    for head, body in tables:
        lines += ["", *kernel_bench.markdown(head, body)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.md").write_text(text + "\n")
        (args.out / "gpu.json").write_text(json.dumps(dict(device=where, kernels=desc, checks=checks,
                                                           bench=bench, throughput=rows), indent=1, default=str))
    return 0 if all(c["equal"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
