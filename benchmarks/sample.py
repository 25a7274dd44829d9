"""Write the in-repository JSONSchemaBench sample, ``benchmarks/data/jsonschemabench/``.

The tests (and a quick ``--bench-dir`` run of the sweeps) use this sample so that a fresh clone
tests what CI tests; the full splits stay an optional download for the benchmarks. The sample is
the first :data:`PER_SPLIT` rows that ``coverage.sample_rows(rows, PER_SPLIT, seed=SEED)`` picks
from each split of :data:`SPLITS`, rows unchanged, gzipped without a timestamp so the same
input always gives the same bytes:

    python -m benchmarks.sample --bench-dir PATH/TO/jsonschemabench

Only the splits of JSONSchemaBench itself (MIT licence, see ``LICENSE`` beside the sample) are
sampled; BFCL, JME and MCPspec were added by MaskBench from sources under other licences.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from benchmarks.coverage import BENCH_DIR, SAMPLE_DIR, load_split, sample_rows
from benchmarks.coverage import SAMPLE_SPLITS as SPLITS

PER_SPLIT = 8
SEED = 1


def write_sample(bench_dir: Path = BENCH_DIR, out: Path = SAMPLE_DIR) -> dict[str, int]:
    """Write ``<split>.jsonl.gz`` for every split of :data:`SPLITS` into ``out``; returns the
    rows written per split."""
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in SPLITS:
        rows = sample_rows(load_split(split, bench_dir), PER_SPLIT, SEED)
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        with open(out / f"{split}.jsonl.gz", "wb") as raw, \
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(text.encode("utf-8"))
        written[split] = len(rows)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR,
                        help="the folder of the full JSONSchemaBench *.jsonl.gz splits")
    parser.add_argument("--out", type=Path, default=SAMPLE_DIR)
    args = parser.parse_args()
    for split, n in write_sample(args.bench_dir, args.out).items():
        print(f"{split}: {n} schemas")


if __name__ == "__main__":
    main()
