"""Red-team probes of the OpenAI-compatible server: grammar bombs, template injection, client
mistakes; what came back, whether the connection survived, and what the bombs cost the others.

    python -m benchmarks.redteam                     # starts the server (embedded model) itself
    python -m benchmarks.redteam --url http://127.0.0.1:8000 --api-key KEY --pid PID
    python -m benchmarks.redteam --quick --no-write

Without ``--url`` the script starts ``examples/openai_server.py`` on a free loopback port (as
``benchmarks/load.py`` does). A fuzz / soak run, not a test: each probe's outcome is recorded,
not asserted. In order:

1. **quiet**: plain requests (a short chat, ``max_tokens`` 4), first one at a time, then from
   ``--threads`` threads at once, nothing else running;
2. **probes**: every probe once (`probes`: compile and grammar bombs, ``chat_template_kwargs``
   that would replace the template or its call, client mistakes), each on one keep-alive
   ``httpx.Client`` followed by a plain request on the same client: a transport error on
   either (``ConnectError``, ``RemoteProtocolError``, ``ReadError``) is a connection reset;
3. **during**: the bombs again, ``--rounds`` times (each round's bombs slightly different, so
   that no compiled grammar is reused), from two threads, while ``--threads`` threads send
   plain requests until the last bomb is answered.

Reported: requests sent, responses by status, 500s, resets, p50 / p99 latency of the plain
requests quiet and during the bombs, and the server's ``VmRSS`` before the probes and after
the bombs (``--pid`` with ``--url``; its child processes, such as a grammar compile child, are
shown apart). Targets: no 500 (every probe is the client's doing), no reset, plain latency
during the bombs at most 2x quiet (the same threads, without bombs), RSS after the bombs within
20% of before. The section "## Red-team probes (OpenAI server)" of ``benchmarks/RESULTS.md`` is
replaced unless ``--no-write``. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from benchmarks._memory import rss_mib
from benchmarks._results import write_section
from benchmarks.load import RESULTS, percentile, scrape, start_server, stop_server
from benchmarks.soak import settle

HEADING = "## Red-team probes (OpenAI server)"
CHAT, COMPLETIONS, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize"
#: what a dropped connection raises in httpx (a timeout is counted apart)
RESETS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
MAX_LATENCY_RATIO, MAX_RSS_CHANGE = 2.0, 0.20
#: the parameters of transformers' ``apply_chat_template`` a request must not set through
#: ``chat_template_kwargs`` (besides ``chat_template`` itself), with a value each
TEMPLATE_CALL_KWARGS: dict[str, Any] = {
    "tokenizer_kwargs": {"truncation": True, "max_length": 1}, "truncation": True,
    "max_length": 1, "padding": "max_length", "return_tensors": "np",
    "return_assistant_tokens_mask": True,
    "conversation": [{"role": "user", "content": "INJECTED conversation"}]}


@dataclass(frozen=True)
class Probe:
    """One request: ``body`` JSON, or raw bytes sent as JSON text (a lone surrogate)."""

    name: str
    group: Literal["bomb", "template", "mistake"]
    expect: str
    body: dict[str, Any] | bytes
    path: str = CHAT


def chat(model: str, content: Any = "Say hello.", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 48, **fields}


def json_schema(schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "probe", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def bombs(model: str, k: int = 0) -> list[Probe]:
    """The compile and grammar bombs; ``k`` > 0 changes each a little (a bound, a value), so
    that a round of them compiles anew instead of hitting the compiled-grammar cache."""
    words = "Write as many different English words as you can, separated by spaces."
    return [
        Probe("nested counted regex", "bomb", "400",
              chat(model, guided_regex="((a{1,50}){1,50}){1,%d}" % (50 + k))),
        Probe("ambiguous word regex", "bomb", "400 matcher work, or 200",
              chat(model, words, max_tokens=300, guided_regex=r"(\w{1,20} ?){1,%d}" % (50 + k))),
        Probe("minLength 1000000", "bomb", "400 naming max_tokens",
              chat(model, response_format=json_schema({"type": "string",
                                                       "minLength": 1_000_000 + k}))),
        Probe("regex .{100000}", "bomb", "400 or 200",
              chat(model, guided_regex=".{%d}" % (100_000 + k))),
        Probe("5001 choices", "bomb", "400",
              chat(model, guided_choice=[f"choice {i} {k}" for i in range(5001)])),
        Probe("schema pattern (b{1,100}){1,100}", "bomb", "400",
              chat(model, response_format=json_schema({
                  "type": "object", "required": ["s"],
                  "properties": {"s": {"type": "string", "pattern": "(b{1,100}){1,%d}" % (100 + k)}}}))),
        Probe("enum of 4000 strings", "bomb", "200",
              chat(model, "Pick a value.", response_format=json_schema({
                  "type": "object", "required": ["v"], "additionalProperties": False,
                  "properties": {"v": {"enum": [f"value-{k}-{i:04d}" for i in range(4000)]}}}))),
    ]


def probes(model: str) -> list[Probe]:
    """Every probe, in the order they are sent."""
    out = bombs(model)
    out.append(Probe("chat_template injected", "template", "400", chat(
        model, chat_template_kwargs={"chat_template": "INJECTED {{ messages[0].content }}"})))
    out += [Probe(f"template kwarg {name}", "template", "400",
                  chat(model, chat_template_kwargs={name: value}))
            for name, value in TEMPLATE_CALL_KWARGS.items()]
    surrogate = '{"role": "user", "content": "hello \\ud800 there"}'
    allof = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}},
                                         {"required": ["a"]}]}
    contains = {"type": "array", "contains": {"type": "integer", "minimum": 5}, "maxItems": 4}
    if_then = {"type": "object", "required": ["kind"],
               "properties": {"kind": {"enum": ["x", "y"]}, "n": {"type": "integer"}},
               "if": {"properties": {"kind": {"const": "x"}}}, "then": {"required": ["n"]}}
    one_of = {"oneOf": [{"type": "integer", "multipleOf": 2}, {"type": "integer", "multipleOf": 3}]}
    lookahead = {"type": "function", "function": {
        "name": "lookup", "description": "Look a code up.",
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{3,8}$"}}}}}
    out += [
        Probe("tokenize messages []", "mistake", "400", {"model": model, "messages": []}, TOKENIZE),
        Probe("tokenize lone surrogate (messages)", "mistake", "400",
              f'{{"model": "{model}", "messages": [{surrogate}]}}'.encode(), TOKENIZE),
        Probe("tokenize lone surrogate (prompt)", "mistake", "400",
              f'{{"model": "{model}", "prompt": "hello \\ud800 there"}}'.encode(), TOKENIZE),
        Probe("chat lone surrogate", "mistake", "400",
              f'{{"model": "{model}", "max_tokens": 4, "messages": [{surrogate}]}}'.encode()),
        Probe("chat messages []", "mistake", "400", {**chat(model), "messages": []}),
        Probe("EBNF with no finite string", "mistake", "400",
              chat(model, guided_grammar="root ::= a\na ::= b\nb ::= a")),
        Probe('completions prompt ""', "mistake", "400",
              {"model": model, "prompt": "", "max_tokens": 4}, COMPLETIONS),
        Probe("completions prompt [true, false]", "mistake", "400",
              {"model": model, "prompt": [True, False], "max_tokens": 4}, COMPLETIONS),
        Probe("n: true", "mistake", "400", chat(model, n=True)),
        Probe("text part without text", "mistake", "400", chat(model, [{"type": "text"}])),
        Probe("default schema allOf + required", "mistake", "400, or 200 with warnings",
              chat(model, response_format=json_schema(allof))),
        Probe("default schema contains", "mistake", "400, or 200 with warnings",
              chat(model, response_format=json_schema(contains))),
        Probe("default schema if/then", "mistake", "400, or 200 with warnings",
              chat(model, response_format=json_schema(if_then))),
        Probe("default schema oneOf", "mistake", "400, or 200 with warnings",
              chat(model, response_format=json_schema(one_of))),
        Probe("tool parameter with look-ahead pattern", "mistake", "400 or 200",
              chat(model, "Look up a code for me.", tools=[lookahead], tool_choice="required")),
    ]
    return out


@dataclass
class Reply:
    """What one request got: ``status`` None when no response came (``error`` says why)."""

    status: int | None
    message: str
    latency: float
    error: str = ""  # "reset: ReadError", "timeout: ReadTimeout", ...
    client_addr: Any = None  # the local end of the connection that carried it

    def outcome(self) -> str:
        return str(self.status) if self.status is not None else self.error.split(":")[0]


@dataclass
class Tally:
    """Every request sent and what came back, from any thread."""

    sent: int = 0
    by_status: Counter = field(default_factory=Counter)  # "200" | "400" | "timeout" | "reset"
    resets: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)  # the requests answered 500
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, reply: Reply) -> None:
        with self.lock:
            self.sent += 1
            self.by_status[reply.outcome()] += 1
            if reply.error.startswith("reset"):
                self.resets.append(f"{what}: {reply.error}")
            if reply.status is not None and reply.status >= 500:
                self.server_errors.append(what)


def send(client: httpx.Client, path: str, body: dict[str, Any] | bytes) -> Reply:
    """POST ``body`` and summarize the answer: an error's message, a 200's warnings or the start
    of its text (100 characters)."""
    t0 = time.perf_counter()
    try:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(path, json=body)
    except RESETS as e:
        return Reply(None, str(e)[:100], time.perf_counter() - t0, f"reset: {type(e).__name__}")
    except httpx.TimeoutException as e:
        return Reply(None, str(e)[:100], time.perf_counter() - t0, f"timeout: {type(e).__name__}")
    except httpx.HTTPError as e:
        return Reply(None, str(e)[:100], time.perf_counter() - t0, f"error: {type(e).__name__}")
    latency = time.perf_counter() - t0
    try:
        data = r.json()
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    if r.status_code != 200:
        error = data.get("error")
        message = str(error.get("message")) if isinstance(error, dict) else r.text
    elif data.get("warnings"):
        message = "warnings: " + "; ".join(
            str(w.get("message", w)) if isinstance(w, dict) else str(w) for w in data["warnings"])
    elif "choices" in data:
        choice = data["choices"][0]
        text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
        calls = (choice.get("message") or {}).get("tool_calls") or []
        if calls:
            text = "; ".join(str(c.get("function")) for c in calls)
        message = f"finish {choice.get('finish_reason')}: {text}"
    else:
        message = f"count {data.get('count')}" if "count" in data else r.text
    return Reply(r.status_code, message[:100], latency, client_addr=_client_addr(r))


def _client_addr(r: httpx.Response) -> Any:
    try:
        return r.extensions["network_stream"].get_extra_info("client_addr")
    except (KeyError, AttributeError, OSError):
        return None


@dataclass
class ProbeResult:
    probe: Probe
    reply: Reply
    after: Reply  # the plain request sent next on the same client

    def keepalive(self) -> str:
        if self.after.status is None:
            return self.after.error
        same = None not in (self.reply.client_addr, self.after.client_addr) and \
            self.reply.client_addr == self.after.client_addr
        return f"{self.after.status}, {'same' if same else 'new'} connection"


@dataclass
class Run:
    tally: Tally = field(default_factory=Tally)
    model: str = ""
    alone: list[float] = field(default_factory=list)  # plain latencies, one at a time
    quiet: list[float] = field(default_factory=list)  # --threads at once, nothing else
    during: list[float] = field(default_factory=list)  # --threads at once, bombs running
    probes: list[ProbeResult] = field(default_factory=list)
    bomb_outcomes: Counter = field(default_factory=Counter)  # during: (probe name, outcome)
    during_s: float = 0.0
    rss_before: tuple[float, float, int] | None = None  # server MiB, its children MiB, how many
    rss_after: tuple[float, float, int] | None = None
    peak_mib: float | None = None
    # the bounded caches' bytes in MiB before / after (``/metrics``; empty without it)
    caches_before: dict[str, float] = field(default_factory=dict)
    caches_after: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0


def plain(client: httpx.Client, run: Run, what: str = "plain") -> Reply:
    reply = send(client, CHAT, chat(run.model, max_tokens=4))
    run.tally.add(what, reply)
    return reply


def plain_load(make_client: Callable[[], httpx.Client], run: Run, threads: int, per_thread: int,
               done: threading.Event | None = None) -> list[float]:
    """Latencies of the plain requests ``threads`` threads send, ``per_thread`` each or (with
    ``done``) until it is set; only those answered 200 count."""
    latencies: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        with make_client() as client:
            k = 0
            while (k < per_thread) if done is None else not done.is_set():
                reply = plain(client, run)
                if reply.status == 200:
                    with lock:
                        latencies.append(reply.latency)
                k += 1

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return latencies


def bomb_load(make_client: Callable[[], httpx.Client], run: Run, rounds: int, threads: int,
              without: frozenset[str] = frozenset()) -> None:
    """Each round's bombs (`bombs` with k = 1, 2, ...; those named in ``without`` left out)
    from ``threads`` threads."""
    work: queue.Queue[Probe] = queue.Queue()
    for k in range(1, rounds + 1):
        for p in bombs(run.model, k):
            if p.name not in without:
                work.put(p)

    def worker() -> None:
        with make_client() as client:
            while True:
                try:
                    p = work.get_nowait()
                except queue.Empty:
                    return
                reply = send(client, p.path, p.body)
                run.tally.add(f"{p.name} (during)", reply)
                with run.tally.lock:
                    run.bomb_outcomes[(p.name, reply.outcome())] += 1

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


#: the server's bounded caches, as ``/metrics`` names them
CACHES = {"prefix": "constrained_spec_prefix_cache_bytes",
          "compiled grammars": "constrained_spec_compile_cache_bytes"}


def cache_mib(url: str) -> dict[str, float]:
    """MiB held by each of the server's bounded caches (empty when ``/metrics`` is off)."""
    try:
        got = scrape(url)
    except (httpx.HTTPError, ValueError):
        return {}
    return {name: got[metric] / 2 ** 20 for name, metric in CACHES.items() if metric in got}


def tree_rss_mib(pid: int | None) -> tuple[float, float, int] | None:
    """(VmRSS of ``pid``, VmRSS of its descendants together, how many) in MiB; None without
    a pid."""
    if pid is None:
        return None
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    below, count, todo = 0.0, 0, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            below += rss_mib(child)[0]
            count += 1
        except (OSError, KeyError):
            pass  # ended, or a zombie without VmRSS
        todo += children.get(child, [])
    return rss_mib(pid)[0], below, count


def redteam(url: str, headers: dict[str, str], pid: int | None, args: argparse.Namespace) -> Run:
    from tqdm import tqdm

    run = Run()

    def make_client() -> httpx.Client:
        return httpx.Client(base_url=url, headers=headers, timeout=args.timeout)

    t0 = time.perf_counter()
    with make_client() as client:
        run.model = client.get("/v1/models").json()["data"][0]["id"]
        plain(client, run, "warm-up")
        run.alone = [r.latency for r in (plain(client, run) for _ in range(args.quiet))
                     if r.status == 200]
    run.quiet = plain_load(make_client, run, args.threads, max(1, args.quiet // args.threads))
    settle(url)
    run.rss_before = tree_rss_mib(pid)
    run.caches_before = cache_mib(url)
    with make_client() as client:
        for p in tqdm(probes(run.model), desc="probes", unit="probe", file=sys.stderr):
            reply = send(client, p.path, p.body)
            run.tally.add(p.name, reply)
            after = plain(client, run, f"plain after {p.name}")
            run.probes.append(ProbeResult(p, reply, after))
    done = threading.Event()

    def bomb_then_stop() -> None:
        try:
            bomb_load(make_client, run, args.rounds, 2, frozenset(args.without))
        finally:
            done.set()

    bombers = threading.Thread(target=bomb_then_stop, daemon=True)
    print(f"during: {args.rounds} round(s) of bombs beside {args.threads} plain threads",
          file=sys.stderr)
    t1 = time.perf_counter()
    bombers.start()
    run.during = plain_load(make_client, run, args.threads, 0, done)
    bombers.join()
    run.during_s = time.perf_counter() - t1
    settle(url)
    time.sleep(1.0)  # let freed memory go back before the reading
    run.rss_after = tree_rss_mib(pid)
    run.caches_after = cache_mib(url)
    if pid is not None:
        run.peak_mib = rss_mib(pid)[1]
    run.wall_s = time.perf_counter() - t0
    return run


# -- the report ---------------------------------------------------------------------------------
def cell(text: str) -> str:
    """``text`` fit for a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|").replace("`", "'")


def targets(run: Run) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met: None where not measured)."""
    out: list[tuple[str, str, bool | None]] = []
    errors = run.tally.server_errors
    out.append(("no 500 (every probe is the client's doing)",
                f"{len(errors)}" + (f": {', '.join(sorted(set(errors)))}" if errors else ""),
                not errors))
    resets = run.tally.resets
    out.append(("no connection reset", f"{len(resets)}" + (f": {'; '.join(resets[:4])}" if resets else ""),
                not resets))
    for q in (50, 99):
        quiet, during = percentile(run.quiet, q), percentile(run.during, q)
        ratio = during / quiet if quiet > 0 else float("nan")
        out.append((f"plain p{q} during bombs <= {MAX_LATENCY_RATIO:g}x quiet",
                    f"{ratio:.2f}x ({during:.2f} s / {quiet:.2f} s)",
                    None if math.isnan(ratio) else ratio <= MAX_LATENCY_RATIO))
    if run.rss_before and run.rss_after:
        before, after = run.rss_before[0], run.rss_after[0]
        change = (after - before) / before
        out.append((f"server RSS after the bombs within {MAX_RSS_CHANGE:.0%} of before",
                    f"{before:.0f} -> {after:.0f} MiB ({change:+.1%})", abs(change) <= MAX_RSS_CHANGE))
        if run.caches_after:
            # what the bounded caches took meanwhile is their bound at work, not a leak: the
            # growth beside them is what the probes left behind
            cached = sum(run.caches_after.values()) - sum(run.caches_before.values())
            rest = (after - before - cached) / before
            out.append((f"server RSS growth beside the bounded caches within {MAX_RSS_CHANGE:.0%}",
                        f"{after - before - cached:+.0f} MiB ({rest:+.1%}; the caches "
                        f"{cached:+.0f} MiB)", abs(rest) <= MAX_RSS_CHANGE))
    else:
        out.append((f"server RSS after the bombs within {MAX_RSS_CHANGE:.0%} of before",
                    "not measured (no --pid)", None))
    return out


def machine(load_before: tuple[float, ...]) -> str:
    """The CPU model and the flags the kernels care about (as the kernel plan records them),
    the load, the date."""
    from constrained_spec.model.plan import machine_info

    info = machine_info()
    before, after = (", ".join(f"{x:.2f}" for x in load) for load in (load_before, os.getloadavg()))
    busy = " (other jobs were running: timings are indicative)" if load_before[0] > 0.5 else ""
    return (f"Machine: {info['cpu']}, {os.cpu_count()} CPUs, flags "
            f"{' '.join(info['flags']) or 'none of note'}; Python {platform.python_version()}; "
            f"load average before the run {before}{busy}, after {after}; "
            f"{datetime.date.today().isoformat()}.")


def report(run: Run, args: argparse.Namespace, started: bool, load_before: tuple[float, ...]) -> str:
    command = "python -m benchmarks.redteam" + (" --quick" if args.quick else "") + (
        "" if started else " --url URL --pid PID")
    server = (f"a server it started on 127.0.0.1 ({args.model or 'embedded model'}, "
              "`--max-batch-size 4`)" if started else "a running server")
    lines = [
        (f"`{command}` — against {server}: {args.quiet} plain chat requests (`max_tokens` 4) one at a time, then "
         f"{args.threads} threads × {max(1, args.quiet // args.threads)}, nothing else running "
         f"(quiet); {len(run.probes)} probes one after the other, each followed by a plain request on "
         f"the same keep-alive connection; then {args.rounds} round(s) of the "
         f"{len(bombs(run.model))} bombs (each round's a little different, no compiled grammar reused) "
         f"from 2 threads while {args.threads} threads send plain requests (during, "
         f"{run.during_s:.0f} s). Every outcome is recorded, not asserted."),
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
    ]
    for name, measured, met in targets(run):
        lines.append(f"| {name} | {cell(measured)} | {'n/a' if met is None else 'yes' if met else '**no**'} |")
    lines += ["", "| plain requests | answered 200 | p50 s | p99 s |", "| --- | --- | --- | --- |"]
    for name, xs in (("quiet, one at a time", run.alone), (f"quiet, {args.threads} threads", run.quiet),
                     (f"during bombs, {args.threads} threads", run.during)):
        lines.append(f"| {name} | {len(xs)} | {percentile(xs, 50):.2f} | {percentile(xs, 99):.2f} |")
    lines += ["", "| probe | expected | got | s | next plain request | message (first 100 characters) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in run.probes:
        path = "" if r.probe.path == CHAT else f" ({r.probe.path})"
        lines.append(f"| {cell(r.probe.name)}{path} | {r.probe.expect} | {r.reply.outcome()} | "
                     f"{r.reply.latency:.2f} | {r.keepalive()} | {cell(r.reply.message)} |")
    by_status = ", ".join(f"{k} × {n}" for k, n in sorted(run.tally.by_status.items()))
    notes = [f"Requests sent {run.tally.sent}; responses by status: {by_status}; wall "
             f"{run.wall_s:.0f} s."]
    during = Counter[str]()
    for (name, outcome), n in run.bomb_outcomes.items():
        during[f"{name}: {outcome}"] += n
    if during:
        notes.append("Bombs during the plain load: " + ", ".join(
            f"{k} × {n}" for k, n in sorted(during.items())) + ".")
    if run.rss_before and run.rss_after:
        notes.append(f"RSS (`VmRSS`, nothing running): server {run.rss_before[0]:.0f} MiB before "
                     f"the probes, {run.rss_after[0]:.0f} MiB after the bombs (peak `VmHWM` "
                     f"{run.peak_mib:.0f} MiB); its child processes (a grammar compile child, ...) "
                     f"{run.rss_before[2]} with {run.rss_before[1]:.0f} MiB together before, "
                     f"{run.rss_after[2]} with {run.rss_after[1]:.0f} MiB after.")
        if run.caches_after:
            notes.append("Bounded caches (`/metrics`), before -> after: " + ", ".join(
                f"{name} {run.caches_before.get(name, 0.0):.0f} -> {mib:.0f} MiB"
                for name, mib in run.caches_after.items()))
    notes.append("Latency: from send to the whole response, answered 200 only; the target "
                 "compares the same threads' plain requests with and without the bombs.")
    notes.append(machine(load_before))
    notes += args.note
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=None, help="the running server's key")
    p.add_argument("--pid", type=int, default=None, help="the running server's process, for RSS")
    p.add_argument("--model", default=None, help="the started server's --model (default: embedded)")
    p.add_argument("--quick", action="store_true", help="fewer plain requests, one round of bombs")
    p.add_argument("--quiet", type=int, default=None, help="quiet plain requests (default 40; quick 12)")
    p.add_argument("--threads", type=int, default=3, help="plain-request threads (1..8)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of bombs during (default 40; quick 2)")
    p.add_argument("--timeout", type=float, default=180.0, help="per request, seconds")
    p.add_argument("--without", action="append", default=[], metavar="NAME",
                   help="leave this bomb out of the rounds during the load (repeatable): "
                        "what one bomb costs the others")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--note", action="append", default=[], help="a note under the tables (repeatable)")
    args = p.parse_args(argv)
    args.quiet = args.quiet or (12 if args.quick else 40)
    args.rounds = args.rounds or (2 if args.quick else 40)
    if not (1 <= args.threads <= 8 and 2 <= args.quiet <= 500 and 1 <= args.rounds <= 100):
        p.error("--threads must be in 1..8, --quiet in 2..500, --rounds in 1..100")
    if args.pid is not None and not args.url:
        p.error("--pid goes with --url (a started server's pid is known)")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    load_before = os.getloadavg()
    if args.url:
        run = redteam(args.url.rstrip("/"), headers, args.pid, args)
    else:
        flags = ["--max-batch-size", "4", "--max-queue", "16", "--log-level", "warning"]
        if args.model:
            flags += ["--model", args.model]
        with tempfile.TemporaryDirectory(prefix="redteam-") as tmp:
            proc, url = start_server(flags, time.monotonic() + 600, Path(tmp))
            try:
                run = redteam(url, headers, proc.pid, args)
            finally:
                stop_server(proc)
    text = report(run, args, not args.url, load_before)
    print(f"{HEADING}\n\n{text}")
    if not args.no_write:
        write_section(RESULTS, HEADING, text)
        print(f"written to {RESULTS}", file=sys.stderr)
    return 0 if all(met is not False for _, _, met in targets(run)) else 1


if __name__ == "__main__":
    sys.exit(main())
