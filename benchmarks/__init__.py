"""Benchmark scripts: speed, acceptance, coverage and validity against peers.

A package so the scripts share helpers by plain imports; run each from the repository root as a
module, e.g. ``python -m benchmarks.e2e`` (``python benchmarks/e2e.py`` does not find its
siblings). Results go to ``benchmarks/RESULTS.md``; the project's own tasks are
``benchmarks/data/tasks.jsonl``.
"""
