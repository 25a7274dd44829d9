"""Extract a Person from a sentence with the embedded default model and print it as JSON.

    python examples/quickstart.py ["your sentence"]
"""

import sys

from pydantic import BaseModel

from constrained_spec import generate


class Person(BaseModel):
    name: str
    age: int
    occupation: str
    city: str


text = sys.argv[1] if len(sys.argv) > 1 else (
    "Ada Lovelace is a 36 year old mathematician living in London.")
# Retries are on by default: the 135M embedded model sometimes loops under greedy decoding; a
# detected loop stops the attempt and a retry samples again (seeded) and returns the first valid
# object. Outputs greedy gets right are unchanged (benchmarks/RESULTS.md, "Output quality levers").
result = generate(None, f"Extract the person: {text}", schema=Person, return_result=True)
print(result.value.model_dump_json())
s = result.stats
print(f"{s.emitted_tokens} tokens in {s.target_forwards} target forwards "
      f"(acceptance length {s.acceptance_length:.2f}), {s.tokens_per_s:.1f} tokens/s, "
      f"{result.attempts} attempt(s)", file=sys.stderr)
