"""Resident memory of a process, as the benchmarks report it."""

from __future__ import annotations

import os
from pathlib import Path


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid`` in MiB (Linux /proc; psutil elsewhere, peak = rss)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        values = {}
        for line in status.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024  # kB
        return values["VmRSS"], values["VmHWM"]
    import psutil

    rss = psutil.Process(pid).memory_info().rss / 2**20
    return rss, rss


def own_peak_rss_mib() -> float:
    """This process's peak resident memory in MiB, its own since its exec: VmHWM. Not
    ``ru_maxrss``, which on Linux keeps the parent's peak across fork and exec (a benchmark's
    worker started by a parent that had read a model file reported the parent's peak); that
    only where /proc is missing."""
    if Path("/proc/self/status").exists():
        return rss_mib(os.getpid())[1]
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
