"""Run by tests/on_vllm/test_float32_identity.py in a process of its own (vLLM keeps process-wide
state per engine dtype): greedy token ids of our engine and vLLM's, both in float32 over the
same weights, for the prompts given as JSON on stdin; prints one JSON line."""

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
        pair = []
        for model in (ours_model, theirs_model):
            gen: Generator[Person] = Generator(model, schema=Person, speculative=False, max_retries=0, max_tokens=64)
            pair.append(gen(prompt, return_result=True).token_ids)
        out.append(pair)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
