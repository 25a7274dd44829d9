"""PromptTooLongError before and after the schema prompt budget (``prompts.SCHEMA_PROMPT_SHARE``),
with the embedded model's tokenizer and chat template (no forward pass).

Every JSONSchemaBench schema in ``../shared/bench`` is normalised (one that
``normalize_schema`` rejects is counted apart) and given the prompt of ``benchmarks/validity.py``; its prompt is
encoded with the whole schema pasted (before) and within the budget (after), and counted as
too long when prompt + max_tokens + the default speculative lookahead + 1 exceed the context
(the check of ``api._encode_with_check``).

    python -m benchmarks.prompt_budget [--context 8192] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import gzip
import json
import warnings
from collections import Counter
from pathlib import Path

from benchmarks.loops import BENCH, embedded_tokenizer
from benchmarks.validity import prompt_for
from constrained_spec import ConstrainedSpecError, SpeculativeConfig
from constrained_spec.frontend.prompts import SCHEMA_PROMPT_SHARE, encode_prompt
from constrained_spec.schemas import normalize_schema


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    spec_cfg = SpeculativeConfig()
    reserved = args.max_tokens + spec_cfg.num_speculative_tokens + spec_cfg.max_forced_tokens + 1
    tok = embedded_tokenizer()
    stats: dict[str, Counter] = {}
    over_share = 0
    for path in sorted(Path(BENCH).glob("*.jsonl.gz")):
        split = path.name.split(".")[0]
        c = stats.setdefault(split, Counter())
        with gzip.open(path, "rt") as f:
            for line in f:
                row = json.loads(line)
                c["schemas"] += 1
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        spec = normalize_schema(row["schema"])
                except ConstrainedSpecError:
                    c["rejected"] += 1
                    continue
                prompt = prompt_for(row)
                before = encode_prompt(tok, prompt, spec)
                after = encode_prompt(tok, prompt, spec, context=args.context, reserved=reserved)
                c["too long before"] += len(before) + reserved > args.context
                c["too long after"] += len(after) + reserved > args.context
                c["shortened"] += before != after
                base = encode_prompt(tok, prompt, spec, False)
                over_share += len(after) - len(base) > SCHEMA_PROMPT_SHARE * args.context + 16
    print(f"Context {args.context}, max_tokens {args.max_tokens} (+{reserved - args.max_tokens} "
          f"lookahead), schema share {SCHEMA_PROMPT_SHARE:.0%}; prompt of benchmarks/validity.py.\n")
    print("| split | schemas | rejected by normalize_schema | PromptTooLongError before | after | prompts shortened |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for split, c in [*stats.items(), ("**all**", sum(stats.values(), Counter()))]:
        print(f"| {split} | {c['schemas']} | {c['not enforceable']} | {c['too long before']} | "
              f"{c['too long after']} | {c['shortened']} |")
    print(f"\nSystem messages over the share (+16 tokens of template slack): {over_share}.")


if __name__ == "__main__":
    main()
