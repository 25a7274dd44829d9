"""Memory soak of the OpenAI-compatible server: 1,000 sequential requests, RSS and leaked slots.

    python -m benchmarks.soak                        # 1,000 requests, embedded model
    python -m benchmarks.soak --requests 200 --no-write

The script starts ``examples/openai_server.py`` on a free loopback port (as
``benchmarks/load.py`` does) and sends ``--requests`` requests one after the other, cycling
through ten kinds so that every path that allocates something runs hundreds of times:

* JSON Schema requests, non-streamed and streamed, each with a ``request_id`` const unique to
  the request (a new schema every time: the grammar compile cache fills and evicts);
* ``json_object`` and free text (the latter ends at ``max_tokens``);
* a stream the client drops after its first content chunk (cancellation mid-generation);
* a bad schema (a 400 before any compute).

Every 100 requests it records the server process's resident set size (``VmRSS``) and the
KV-cache slots its model runner holds (``constrained_spec_kv_slots_in_use`` on ``/metrics``:
anything above 0 between requests is a leaked slot). A response must come back for every
request (none lost) with the status its kind expects, and schema outputs must validate against
their own schema. Results go to ``benchmarks/RESULTS.md`` under "## Memory soak (OpenAI server)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._memory import rss_mib
from benchmarks._results import write_section
from benchmarks.load import RESULTS, scrape, start_server, stop_server

HEADING = "## Memory soak (OpenAI server)"
KINDS = ("schema", "schema", "schema", "schema", "schema stream", "schema stream", "json_object",
         "free text", "dropped stream", "bad schema")
STR = {"type": "string", "maxLength": 24}
PEOPLE = [("Ada Lovelace", 36), ("Alan Turing", 41), ("Grace Hopper", 85), ("Edsger Dijkstra", 72)]


def request_body(i: int, max_tokens: int) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """Request ``i``: (kind, the body, the schema its output must follow or None)."""
    kind = KINDS[i % len(KINDS)]
    name, age = PEOPLE[i % len(PEOPLE)]
    rid = f"r{i:05d}"
    text = f"{name} is {age} years old. Extract the person. Use request_id {rid}."
    schema = None
    body: dict[str, Any] = {"model": "", "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": text}]}
    if kind.startswith("schema") or kind == "dropped stream":
        schema = {"type": "object", "properties": {"request_id": {"const": rid}, "name": STR,
                                                   "age": {"type": "integer", "minimum": 0}},
                  "required": ["request_id", "name", "age"], "additionalProperties": False}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": schema, "strict": True}}
    elif kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif kind == "free text":
        body["messages"] = [{"role": "user", "content": f"Tell me about {name}."}]
        body["max_tokens"] = 8
    elif kind == "bad schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    body["stream"] = "stream" in kind
    return kind, body, schema


@dataclass
class Checkpoint:
    done: int
    rss_mib: float
    slots: float
    elapsed_s: float


@dataclass
class Soak:
    checkpoints: list[Checkpoint] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)  # (kind, "ok" | problem) -> requests
    sent: int = 0
    answered: int = 0
    start_rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    wall_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def one(client: httpx.Client, i: int, model: str, max_tokens: int) -> str:
    """Send request ``i``; "ok" or what went wrong."""
    import jsonschema

    kind, body, schema = request_body(i, max_tokens)
    body["model"] = model
    if kind == "bad schema":
        r = client.post("/v1/chat/completions", json=body)
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        return "ok" if r.status_code == 400 and code == "invalid_schema" else f"HTTP {r.status_code} {code}"
    if kind == "dropped stream":
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    return "ok"  # leaving the block drops the connection mid-generation
        return "stream ended before any content"
    if body["stream"]:
        text, finish = "", None
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error event {event['error'].get('code')}"
                for c in event["choices"]:
                    text += c["delta"].get("content") or ""
                    finish = c["finish_reason"] or finish
    else:
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return f"HTTP {r.status_code} {r.json().get('error', {}).get('code')}"
        choice = r.json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    if kind == "free text":
        return "ok" if finish in ("stop", "length") else f"finish_reason {finish}"
    if finish != "stop":
        return f"finish_reason {finish}"
    try:
        value = json.loads(text)
        if schema is not None:
            jsonschema.validate(value, schema)
        elif not isinstance(value, dict):
            return "json_object: not an object"
    except Exception as e:  # noqa: BLE001 -- not JSON or not valid: both count as invalid
        return f"invalid: {type(e).__name__}"
    return "ok"


def soak(url: str, pid: int, requests: int, max_tokens: int, every: int, timeout: float) -> Soak:
    from tqdm import tqdm

    result = Soak()
    with httpx.Client(base_url=url, timeout=timeout) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        result.start_rss_mib, _ = rss_mib(pid)
        result.checkpoints.append(Checkpoint(0, result.start_rss_mib,
                                             slots_in_use(url), 0.0))
        t0 = time.perf_counter()
        for i in tqdm(range(requests), desc="requests", unit="req", file=sys.stderr):
            result.sent += 1
            try:
                outcome = one(client, i, model, max_tokens)
                result.answered += 1
            except httpx.HTTPError as e:
                outcome = f"lost: {type(e).__name__}"
            result.outcomes[(KINDS[i % len(KINDS)], outcome)] += 1
            if (i + 1) % every == 0 or i + 1 == requests:
                settle(url)
                rss, peak = rss_mib(pid)
                result.peak_rss_mib = max(result.peak_rss_mib, peak)
                result.checkpoints.append(Checkpoint(i + 1, rss, slots_in_use(url),
                                                     time.perf_counter() - t0))
        result.wall_s = time.perf_counter() - t0
    result.metrics = scrape(url)
    return result


def finished(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """(finish_reason, requests) from the scraped ``constrained_spec_requests_total{...}``."""
    prefix = 'constrained_spec_requests_total{finish_reason="'
    return sorted((k[len(prefix):-2], v) for k, v in metrics.items() if k.startswith(prefix))


def slots_in_use(url: str) -> float:
    return scrape(url).get("constrained_spec_kv_slots_in_use", float("nan"))


def settle(url: str, timeout: float = 30.0) -> None:
    """Wait until nothing runs (a dropped stream is cancelled at the engine's next step)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["running"] == 0 and health["waiting"] == 0:
            return
        time.sleep(0.05)


def report(result: Soak, args: argparse.Namespace, load_before: tuple[float, ...]) -> str:
    first, last = result.checkpoints[0], result.checkpoints[-1]
    warm = next((c for c in result.checkpoints if c.done >= args.every), first)
    leaked = max(c.slots for c in result.checkpoints)
    ok = sum(n for (_, outcome), n in result.outcomes.items() if outcome == "ok")
    lines = [
        (f"`python -m benchmarks.soak --requests {args.requests} --max-tokens {args.max_tokens}` — "
         f"{args.requests} sequential requests against one server on 127.0.0.1 ("
         f"{'embedded model' if not args.model else args.model}, speculation on, "
         f"`--max-batch-size {args.max_batch_size}`), cycling through ten kinds: 4 × JSON Schema, "
         "2 × JSON Schema streamed (every schema new: a per-request `request_id` const), "
         "`json_object`, free text (`max_tokens` 8), a stream the client drops after its first "
         "content chunk, a bad schema (400). RSS is the server process's `VmRSS` once nothing "
         "runs; slots are `constrained_spec_kv_slots_in_use` at the same moments."),
        "",
        "| requests done | RSS MiB | KV slots held | elapsed s |",
        "| --- | --- | --- | --- |",
    ]
    for c in result.checkpoints:
        lines.append(f"| {c.done} | {c.rss_mib:.1f} | {c.slots:.0f} | {c.elapsed_s:.0f} |")
    growth = last.rss_mib - warm.rss_mib
    notes = [
        (f"RSS at start (model loaded, before any request) {first.rss_mib:.1f} MiB; after "
         f"{warm.done} requests {warm.rss_mib:.1f} MiB; at the end ({last.done}) {last.rss_mib:.1f} "
         f"MiB (peak {result.peak_rss_mib:.1f} MiB). Growth from request {warm.done} to "
         f"{last.done}: {growth:+.1f} MiB ({growth * 1024 / max(1, last.done - warm.done):+.1f} KiB "
         "per request)."),
        f"Leaked KV-cache slots: {leaked:.0f} (the most held at any checkpoint, with nothing running).",
        (f"Answered {result.answered} / {result.sent} (none lost: {result.answered == result.sent}); "
         f"{ok} / {result.sent} as expected for their kind; wall {result.wall_s:.0f} s "
         f"({result.sent / result.wall_s:.2f} req/s)."),
        "Finished requests by reason (server): " + ", ".join(
            f"{reason} {n:.0f}" for reason, n in finished(result.metrics)) + ".",
    ]
    problems = [(kind, outcome, n) for (kind, outcome), n in result.outcomes.items() if outcome != "ok"]
    for kind, outcome, n in sorted(problems, key=lambda p: -p[2])[:6]:
        notes.append(f"{n} × {kind}: `{outcome}`")
    load = ", ".join(f"{x:.2f}" for x in load_before)
    notes.append(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
                 f"{platform.python_version()}; load average before the run {load}"
                 + (" (other jobs were running: timings are indicative, memory figures are not "
                    "affected)." if load_before[0] > 0.5 else "."))
    notes += args.note
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="sequential requests (10..5000)")
    p.add_argument("--every", type=int, default=100, help="a checkpoint every N requests")
    p.add_argument("--max-tokens", type=int, default=48, help="per schema request (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=4, help="the server's --max-batch-size")
    p.add_argument("--model", default=None, help="the server's --model (default: embedded)")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--note", action="append", default=[], help="a note under the table (repeatable)")
    args = p.parse_args(argv)
    if not 10 <= args.requests <= 5000 or args.every < 1:
        p.error("--requests must be in 10..5000 and --every >= 1")
    load_before = os.getloadavg()
    flags = ["--max-batch-size", str(args.max_batch_size), "--max-queue", "8", "--log-level", "warning"]
    if args.model:
        flags += ["--model", args.model]
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        proc, url = start_server(flags, time.monotonic() + 600, Path(tmp))
        try:
            result = soak(url, proc.pid, args.requests, args.max_tokens, args.every, args.timeout)
        finally:
            stop_server(proc)
    text = report(result, args, load_before)
    print(f"{HEADING}\n\n{text}")
    if not args.no_write:
        write_section(RESULTS, HEADING, text)
        print(f"written to {RESULTS}", file=sys.stderr)
    leaked = max(c.slots for c in result.checkpoints)
    return 0 if result.answered == result.sent and leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
