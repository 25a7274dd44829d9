"""Load test of the OpenAI-compatible server: concurrent clients, mixed schemas, speculation on vs off.

    python -m benchmarks.load                      # 32 clients x 2 requests, both settings
    python -m benchmarks.load --clients 8 --requests-per-client 1 --settings on --no-write

For each setting the script starts ``examples/openai_server.py`` on a free loopback port,
sends one warm-up request, then lets ``--clients`` concurrent clients (the official async
``openai`` client) send ``--requests-per-client`` requests each, one after the other. Every
request has its own schema (four shapes, mixed across clients), and every schema carries a
``request_id`` const unique to the request, so a response that reached the wrong client
cannot validate. Each response must come back (none lost), finish with ``stop``, parse, and
validate against ITS schema (jsonschema). Reported: throughput, p50 / p95 latency, and the
server's acceptance length (``/metrics``). Results go to ``benchmarks/RESULTS.md`` under
"## Load test (OpenAI server)" (that section is replaced, the others are left alone).

Bounded: at most 64 clients x 8 requests, loopback only, and a global ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._results import write_section

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "examples" / "openai_server.py"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HEADING = "## Load test (OpenAI server)"

NAMES = [("Ada Lovelace", 36, "London"), ("Alan Turing", 41, "Manchester"),
         ("Grace Hopper", 85, "New York"), ("Katherine Johnson", 101, "Hampton"),
         ("Edsger Dijkstra", 72, "Nuenen"), ("Barbara Liskov", 84, "Boston"),
         ("Donald Knuth", 86, "Stanford"), ("Margaret Hamilton", 87, "Boston")]
REVIEWS = ["The battery died after two days. Returning it.", "Exactly what I needed, works perfectly.",
           "It arrived on time. Nothing special.", "Terrible support, I want my money back.",
           "Great value for the price, I love it."]
PRODUCTS = [("a steel water bottle", 19.99), ("wireless headphones", 59.5), ("a paper notebook", 4.25),
            ("a desk lamp", 32.0), ("running shoes", 89.9)]
STR = {"type": "string", "maxLength": 40}


def task(client: int, k: int) -> tuple[list[dict[str, str]], dict[str, Any], str]:
    """The messages, schema and request id of client ``client``'s ``k``-th request."""
    rid = f"c{client:02d}-r{k}"
    props: dict[str, Any] = {"request_id": {"const": rid}}
    kind = (client + k) % 4
    if kind == 0:
        name, age, city = NAMES[client % len(NAMES)]
        text = f"{name} is {age} years old and lives in {city}. Extract the person."
        props |= {"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 150}}
    elif kind == 1:
        name, _, city = NAMES[client % len(NAMES)]
        text = f"{name} was born in {city}. Where was {name.split()[0]} born? Give the city and country."
        props |= {"city": STR, "country": STR}
    elif kind == 2:
        text = f"Classify the sentiment of this review: {REVIEWS[client % len(REVIEWS)]}"
        props |= {"sentiment": {"enum": ["positive", "negative", "neutral"]}}
    else:
        product, price = PRODUCTS[client % len(PRODUCTS)]
        text = f"We sell {product} for ${price}. Extract the product, its price and up to 3 tags."
        props |= {"product": STR, "price": {"type": "number", "minimum": 0},
                  "tags": {"type": "array", "items": STR, "maxItems": 3}}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    text += f" Use request_id {rid}."
    return [{"role": "user", "content": text}], schema, rid


@dataclass
class Outcome:
    rid: str
    ok: bool = False
    problem: str = ""
    latency: float = 0.0
    completion_tokens: int = 0
    finish_reason: str = ""


@dataclass
class Run:
    setting: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    sent: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], deadline: float, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(port),
                                 "--enable-metrics", *flags], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not start in time")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def one_request(client: Any, model: str, c: int, k: int, max_tokens: int) -> Outcome:
    import jsonschema

    messages, schema, rid = task(c, k)
    out = Outcome(rid)
    t0 = time.perf_counter()
    try:
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"task{(c + k) % 4}", "schema": schema, "strict": True}})
    except Exception as e:  # noqa: BLE001 -- any failure is counted and reported
        # an HTTP error response came back ("error"); anything else means no response ("lost")
        out.finish_reason = "error" if getattr(e, "status_code", None) else ""
        out.problem = f"{type(e).__name__}: {e}"
        return out
    out.latency = time.perf_counter() - t0
    choice = r.choices[0]
    out.finish_reason = choice.finish_reason
    out.completion_tokens = r.usage.completion_tokens if r.usage else 0
    if choice.finish_reason != "stop":
        out.problem = f"finish_reason {choice.finish_reason}"
        return out
    try:
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
    except Exception as e:  # noqa: BLE001 -- not JSON, or not valid: both are "invalid"
        out.problem = f"invalid: {type(e).__name__}: {str(e)[:80]}"
        return out
    if value.get("request_id") != rid:  # cannot happen if validation passed; kept explicit
        out.problem = f"mismatched: got {value.get('request_id')!r}"
        return out
    out.ok = True
    return out


async def load(url: str, clients: int, per_client: int, max_tokens: int, timeout: float) -> Run:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    model = (await client.models.list()).data[0].id
    await one_request(client, model, 99, 0, max_tokens)  # warm-up (compiles, first forwards)
    run = Run(setting="")

    async def worker(c: int) -> None:
        for k in range(per_client):
            run.sent += 1
            run.outcomes.append(await one_request(client, model, c, k, max_tokens))

    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in range(clients))), timeout)
    except asyncio.TimeoutError:
        run.timed_out = True
    run.wall_s = time.perf_counter() - t0
    run.metrics = scrape(url)
    await client.close()
    return run


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"(constrained_spec_\w+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def table(runs: list[Run], args: argparse.Namespace, load_before: tuple[float, ...]) -> str:
    """The markdown section: the command, one row per setting, and notes."""
    lines = [
        (f"`python -m benchmarks.load --clients {args.clients} --requests-per-client "
        f"{args.requests_per_client} --max-tokens {args.max_tokens} --max-batch-size {args.max_batch_size}`"
        f" — {args.clients} concurrent clients (official async `openai` client) × "
        f"{args.requests_per_client} requests, four schema shapes mixed, each with a per-request "
        f"`request_id` const; one server per setting on 127.0.0.1 (embedded model, "
        f"`--max-batch-size {args.max_batch_size}`); a warm-up request per server is not counted."),
        "",
        ("| speculation | ok / sent | HTTP errors | lost | invalid or mismatched | incomplete (length) "
         "| wall s | req/s | completion tok/s | p50 latency s | p95 latency s | acceptance length |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        ok = [o for o in run.outcomes if o.ok]
        lost = run.sent - len(run.outcomes) + sum(1 for o in run.outcomes if not o.finish_reason)
        errors = sum(1 for o in run.outcomes if o.finish_reason == "error")
        invalid = sum(1 for o in run.outcomes if o.problem.startswith(("invalid", "mismatched")))
        length = sum(1 for o in run.outcomes if o.finish_reason == "length")
        lat = sorted(o.latency for o in run.outcomes if o.finish_reason not in ("", "error"))
        tokens = sum(o.completion_tokens for o in run.outcomes)
        acc = run.metrics.get("constrained_spec_acceptance_length", float("nan"))
        lines.append(
            f"| {run.setting} | {len(ok)} / {run.sent} | {errors} | {lost} | {invalid} | {length} | {run.wall_s:.1f} "
            f"| {len(run.outcomes) / run.wall_s:.2f} | {tokens / run.wall_s:.1f} | {percentile(lat, 50):.1f} "
            f"| {percentile(lat, 95):.1f} | {acc:.2f} |")
    cpu = os.cpu_count()
    notes = [f"Machine: {platform.machine()}, {cpu} CPUs, Python {platform.python_version()}; "
             f"load average before the run {', '.join(f'{x:.2f}' for x in load_before)}"
             f" (other jobs were running on the machine: the numbers are indicative)."
             if load_before[0] > 0.5 else
             f"Machine: {platform.machine()}, {cpu} CPUs, Python {platform.python_version()}; "
             f"load average before the run {', '.join(f'{x:.2f}' for x in load_before)}.",
             ("Latency is per request, from send to the full response (completed requests); p95 is "
              "the 95th percentile over the setting's requests. \"ok\": finished with `stop`, valid "
              "JSON, valid against its own schema (jsonschema), its own `request_id`. \"lost\": no "
              "response at all (transport error or the global timeout).")]
    if any(r.timed_out for r in runs):
        notes.append("The global timeout was reached: unfinished requests count as lost.")
    for run in runs:
        problems = Counter(o.problem for o in run.outcomes if o.problem)
        for problem, n in problems.most_common(5):
            notes.append(f"Speculation {run.setting}: {n} × `{problem[:240]}`")
    notes += getattr(args, "note", [])
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (1..64)")
    p.add_argument("--requests-per-client", type=int, default=2, help="sequential requests per client (1..8)")
    p.add_argument("--max-tokens", type=int, default=192,
                   help="per request; generous, so that outputs finish (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=32, help="the server's --max-batch-size")
    p.add_argument("--settings", nargs="+", choices=("on", "off"), default=["on", "off"],
                   help="speculation settings to run, in order")
    p.add_argument("--model", default=None, help="the server's --model (default: embedded)")
    p.add_argument("--timeout", type=float, default=1500.0, help="global limit in seconds")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: dropped)")
    p.add_argument("--note", action="append", default=[], help="a note added under the table (repeatable)")
    args = p.parse_args(argv)
    if not (1 <= args.clients <= 64 and 1 <= args.requests_per_client <= 8):
        p.error("--clients must be in 1..64 and --requests-per-client in 1..8")
    deadline = time.monotonic() + args.timeout
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="load-test-") as tmp:
        if args.log_dir:
            tmp = args.log_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for setting in args.settings:
            flags = ["--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.clients)]
            if setting == "off":
                flags.append("--no-speculation")
            if args.model:
                flags += ["--model", args.model]
            print(f"[{setting}] starting the server", file=sys.stderr)
            proc, url = start_server(flags, deadline, Path(tmp))
            try:
                remaining = max(10.0, deadline - time.monotonic())
                run = asyncio.run(load(url, args.clients, args.requests_per_client, args.max_tokens,
                                       remaining))
            finally:
                stop_server(proc)
            run.setting = setting
            runs.append(run)
            ok = sum(o.ok for o in run.outcomes)
            print(f"[{setting}] {ok}/{run.sent} ok in {run.wall_s:.1f} s", file=sys.stderr)
    text = table(runs, args, load_before)
    print(text)
    if not args.no_write:
        write_section(RESULTS, HEADING, text)
        print(f"written to {RESULTS}", file=sys.stderr)
    return 0 if all(o.ok for r in runs for o in r.outcomes) and all(
        len(r.outcomes) == r.sent for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
