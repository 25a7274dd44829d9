"""Tool-call benchmark: the BFCL schemas of JSONSchemaBench as tools, several per request.

Each BFCL schema is one function: ``{"properties": {NAME: ARGUMENTS_SCHEMA}}``; it becomes the
OpenAI tool ``NAME`` (dots and other characters OpenAI does not allow in a name become ``_``)
with ``ARGUMENTS_SCHEMA`` as its parameters. Request *i* offers ``--tools-per-request`` (4)
consecutive functions, in file order, and asks the model to call one of them (the *i*-th modulo
that number), with ``tool_choice="required"``; the prompt is the same for every system: "Call
NAME with suitable arguments." plus the function's description when it has one.

Systems (one process, one after another per request, the order rotated per request):

* ``ours``: ``constrained_spec`` with speculation on (the default drafters: the tags and tool
  names are forced drafts, the arguments go through the usual masked drafting);
* ``ours off``: the same with speculation off;
* ``llama.cpp``: llama-cpp-python's own tool calling on the same GGUF
  (``chat_format="chatml-function-calling"``). Its handler has no ``"required"``: it gets the
  named tool choice of the function the prompt asks for (an easier task: no choice between
  tools). It writes its own prompt (its tools section), ours writes ours (our default format's
  system message): the prompts differ as the two libraries differ.

Greedy decoding, ``--max-tokens`` (256) per request, ``--threads`` CPU threads, no retries.

Definitions, per system:

* **completed**: the output ended before ``max_tokens`` with at least one call;
* **valid**: completed, and every call names an offered tool and its arguments validate against
  that tool's schema (``jsonschema``, checked here, independently of the library's own check);
  the target is 100% of completed calls valid;
* **asked tool**: the first call is to the function the prompt names;
* **acceptance length**: tokens emitted per target forward over all requests (1 without
  speculation); compare with the JSON tasks' figure in the other sections of RESULTS.md;
* **tokens/s**: output tokens / wall time over all requests (prefill included; the grammar
  compile is done before the clock starts: one untimed warm-up request per tool set).

    python -m benchmarks.tools --limit 3                      # quick look, prints the table
    python -m benchmarks.tools --limit 200 --out benchmarks/RESULTS.md
    python -m benchmarks.tools --systems "ours,ours off" --tools-per-request 8
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import time
from pathlib import Path
from typing import Any, cast

from benchmarks._results import write_section

ROOT = Path(__file__).resolve().parents[1]
BFCL = ROOT.parent / "shared" / "bench" / "jsonschemabench" / "BFCL.jsonl.gz"
RESULTS_HEADING = "## Tool calls (BFCL schemas as tools)"
SYSTEMS = ("ours", "ours off", "llama.cpp")


class Skip(Exception):
    """A system that cannot run here (a missing package), with the reason."""


def tool_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]


def load_tools(path: Path) -> list[dict[str, Any]]:
    """The BFCL functions as OpenAI tools (those whose schema has the one-function shape)."""
    tools = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            props = row["schema"].get("properties") or {}
            if len(props) != 1:
                continue
            [(name, params)] = props.items()
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                continue
            fn = {"name": tool_name(name), "parameters": params}
            if params.get("description"):
                fn["description"] = params["description"]
            tools.append({"type": "function", "function": fn, "id": row["id"]})
    return tools


def make_requests(tools: list[dict[str, Any]], per_request: int, limit: int | None
                  ) -> list[dict[str, Any]]:
    out = []
    for i in range(len(tools) // per_request):
        offered = tools[i * per_request:(i + 1) * per_request]
        names = [t["function"]["name"] for t in offered]
        if len(set(names)) < len(names):
            continue
        ask = offered[i % per_request]["function"]
        prompt = f"Call {ask['name']} with suitable arguments."
        if ask.get("description"):
            prompt += f" ({ask['description']})"
        out.append({"id": f"req{i}", "tools": [{k: v for k, v in t.items() if k != "id"}
                                               for t in offered],
                    "ask": ask["name"], "prompt": prompt})
        if limit is not None and len(out) >= limit:
            break
    return out


def check_calls(request: dict[str, Any], calls: list[tuple[str, Any]]) -> tuple[bool, bool]:
    """(every call valid, the first call is to the asked tool)."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in request["tools"]}
    for name, args in calls:
        if name not in schemas:
            return False, False
        cls = jsonschema.validators.validator_for(schemas[name])
        if any(True for _ in cls(schemas[name]).iter_errors(args)):
            return False, calls[0][0] == request["ask"]
    return bool(calls), bool(calls) and calls[0][0] == request["ask"]


class Ours:
    def __init__(self, speculative: bool, threads: int, max_tokens: int) -> None:
        import torch

        from constrained_spec import Generator, load_model

        torch.set_num_threads(threads)
        self.gen: Generator[Any] = Generator(load_model(None, quiet=True), speculative=None if speculative else False,
                             max_tokens=max_tokens, max_retries=0)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        from constrained_spec.errors import ConstrainedSpecError
        from constrained_spec.frontend.tools import ToolCall, ToolSet

        try:
            toolset = ToolSet(request["tools"], "required", False)
            self.gen.make_request(request["prompt"], tools=toolset)  # compile, untimed
        except ConstrainedSpecError as e:
            return {"refused": f"{type(e).__name__}: {e}"}
        start = time.perf_counter()
        req, spec = self.gen.make_request(request["prompt"], tools=toolset)
        self.gen.new_engine().run([req])
        value = self.gen.finalize(req, spec, return_result=False)
        wall = time.perf_counter() - start
        calls = [value] if isinstance(value, ToolCall) else value if isinstance(value, list) else []
        return {"tokens": len(req.output_ids), "wall_s": wall,
                "forwards": req.stats.target_forwards,
                "completed": req.finish_reason == "stop" and bool(calls),
                "calls": [(c.name, json.loads(c.arguments_json)) for c in calls],
                "finish_reason": req.finish_reason,
                "text": self.gen.model.tokenizer.decode(req.output_ids)[:500],
                "error": None if not isinstance(value, BaseException) else type(value).__name__}


class LlamaCpp:
    def __init__(self, gguf: str, threads: int, max_tokens: int) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise Skip(f"llama-cpp-python is not installed ({e}); see "
                       "benchmarks/requirements-peers.txt") from e
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=4096, n_threads=threads,
                                   n_threads_batch=threads, seed=0, verbose=False,
                                   chat_format="chatml-function-calling")
        self.max_tokens = max_tokens

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        self.llm.reset()
        start = time.perf_counter()
        try:
            # not streamed: one response dict (llama_cpp's stubs, when installed, say a union)
            out = cast("dict[str, Any]", self.llm.create_chat_completion(
                messages=[{"role": "user", "content": request["prompt"]}], tools=request["tools"],
                tool_choice={"type": "function", "function": {"name": request["ask"]}},
                max_tokens=self.max_tokens, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0,
                repeat_penalty=1.0))
        except Exception as e:  # noqa: BLE001 - a grammar llama.cpp cannot build: recorded
            return {"refused": f"{type(e).__name__}: {e}"[:200]}
        wall = time.perf_counter() - start
        choice = out["choices"][0]
        calls = []
        for c in choice["message"].get("tool_calls") or []:
            try:
                calls.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
            except json.JSONDecodeError:
                calls.append((c["function"]["name"], None))
        tokens = out["usage"]["completion_tokens"]
        return {"tokens": tokens, "wall_s": wall, "forwards": tokens,
                "completed": choice["finish_reason"] != "length" and bool(calls),
                "calls": calls, "finish_reason": choice["finish_reason"],
                "text": json.dumps(choice["message"], ensure_ascii=False)[:500], "error": None}


def summarize(records: list[dict[str, Any]], systems: list[str]) -> str:
    lines = ["| system | requests | refused | completed | valid (of completed) | asked tool | "
             "acceptance length | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        rs = [r for r in records if r["system"] == s]
        ran = [r for r in rs if "refused" not in r]
        done = [r for r in ran if r["completed"]]
        valid = [r for r in done if r["valid"]]
        tokens = sum(r["tokens"] for r in ran)
        wall = sum(r["wall_s"] for r in ran)
        forwards = sum(r["forwards"] for r in ran)

        def pct(a: int, b: int) -> str:
            return f"{100 * a / b:.1f}% ({a}/{b})" if b else "n/a"
        lines.append(f"| {s} | {len(rs)} | {len(rs) - len(ran)} | {pct(len(done), len(ran))} | "
                     f"{pct(len(valid), len(done))} | "
                     f"{pct(sum(r['asked'] for r in done), len(done))} | "
                     f"{tokens / forwards if forwards else float('nan'):.2f} | "
                     f"{tokens / wall if wall else float('nan'):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=BFCL, help="BFCL.jsonl.gz of JSONSchemaBench")
    ap.add_argument("--limit", type=int, default=None, help="requests to run (default: all)")
    ap.add_argument("--tools-per-request", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the GGUF for llama.cpp (default: the embedded model's)")
    ap.add_argument("--out", type=Path, default=None, help="write the section into this file")
    ap.add_argument("--out-json", type=Path, default=None, help="every record as JSON")
    args = ap.parse_args(argv)
    if not args.data.exists():
        ap.error(f"{args.data} not found: JSONSchemaBench's BFCL split (--data)")
    requests = make_requests(load_tools(args.data), args.tools_per_request, args.limit)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; use {', '.join(SYSTEMS)}")
    runners: dict[str, Any] = {}
    notes = []
    for s in systems:
        try:
            if s == "llama.cpp":
                from constrained_spec.model.embedded import fetch_default_gguf

                gguf = str(args.gguf or fetch_default_gguf(quiet=True))
                runners[s] = LlamaCpp(gguf, args.threads, args.max_tokens)
            else:
                runners[s] = Ours(s == "ours", args.threads, args.max_tokens)
        except Skip as e:
            notes.append(f"{s}: skipped, {e}")
    records = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the package's dependencies
        def tqdm(x: Any, **_: Any) -> Any:
            return x
    for i, request in enumerate(tqdm(requests, desc="tool-call requests")):
        order = list(runners)
        order = order[i % len(order):] + order[:i % len(order)] if order else order
        for s in order:
            rec = {"system": s, "id": request["id"], **runners[s].run(request)}
            if "refused" not in rec:
                rec["valid"], rec["asked"] = check_calls(request, rec["calls"])
                rec["valid"] = rec["valid"] and rec["completed"]
            records.append(rec)
    from benchmarks.e2e import hardware

    ran = [s for s in systems if s in runners]
    text = (f"{len(requests)} requests of {args.tools_per_request} BFCL tools each, "
            f"tool_choice required, greedy, max_tokens {args.max_tokens}, {args.threads} "
            f"threads. {hardware()}.\n\n{summarize(records, ran)}\n")
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print(text)
    if args.out_json:
        args.out_json.write_text(json.dumps(records, indent=1, default=str))
    if args.out:
        write_section(args.out, RESULTS_HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
