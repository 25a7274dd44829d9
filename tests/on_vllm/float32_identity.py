"""Run by tests/on_vllm/test_float32_identity.py in a process of its own (vLLM keeps process-wide
state per engine dtype): greedy token ids of our engine and vLLM's, both in float32 over the
same weights, and vLLM's with our proposer's drafts, for the prompts given as JSON on stdin;
prints one JSON line."""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel

from constrained_spec import Generator
from constrained_spec.model.loading import load_model


class Person(BaseModel):
    name: str
    age: int
    city: str


def main() -> None:
    prompts = json.loads(sys.stdin.read())
    ours_model = load_model(None, dtype="float32", quiet=True)
    theirs_model = load_model(None, engine="vllm", dtype="float32", quiet=True, enforce_eager=True)
    out = []
    for prompt in prompts:
        row = []
        # ours; vLLM's without speculation; vLLM's with its defaults: our proposer's drafts
        for model, speculative in ((ours_model, False), (theirs_model, False), (theirs_model, None)):
            gen: Generator[Person] = Generator(model, schema=Person, speculative=speculative,
                                               max_retries=0, max_tokens=64)
            res = gen(prompt, return_result=True)
            row.append({"tokens": res.token_ids, "drafted": res.stats.drafted_tokens,
                        "accepted": res.stats.accepted_tokens})
        out.append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
