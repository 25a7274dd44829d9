"""The kernel plan: which kernel runs each phase of a target forward on THIS machine, measured.

No one dtype is right for every phase or every CPU. On a CPU with bf16 units a 256-row prompt
chunk is fastest in bf16 and a 1-row decode on the 4-bit kernel; on an AVX2-only CPU bf16 is
emulated (several times slower than float32 for a large product: benchmarks/RESULTS.md,
"Kernel plan per machine (embedded model)") while the 4-bit kernel still wins the memory-bound
1-row decode. So the plan is chosen per phase:

- ``prefill``: a prompt's forward (hundreds of rows, no logits),
- ``decode``: a decode / verify forward, by rows per forward (1 to (K+1) x batch): a list of
  ``(up to rows, kernel)`` buckets,
- ``lm_head``: the logits rows of a decode forward,

chosen at a model's load from the CPU's flags and the weights' formats (`flag_plan`: what the
measured plans on each CPU class chose; nothing is timed, so the first object comes in seconds).
Measured when asked (``CONSTRAINED_SPEC_PLAN=measure``, ``constrained-spec info --measure``): each
phase timed over the kernels the machine and the weights offer (`constrained_spec.model.weights`:
fp32, bf16, int4 from the file's own 4-bit groups on torch's kernel, q4 from the same groups on
this package's C kernel where it builds, q8 for the file's 8-bit groups, the LM head's among
them; int8, a re-quantization, only when asked for), and cached beside the converted checkpoint
keyed by the machine (CPU flags, torch's capability, threads) and the memory mode. A measurement
the machine disturbed (`Conditions.disturbed`: other load, steal time, a reference loop or
repeated timings that disagree) is never cached: the flag plan stays, and a later measurement
tries again. The memory mode (``CONSTRAINED_SPEC_MEMORY``): ``auto``, the default, keeps a
dense copy of the 4-bit weights only where it is measured faster by a margin, ``fast`` keeps
the dense copies the fastest kernels need, ``lean`` keeps 4-bit weights 4-bit and dequantizes
a prompt's per call. ``CONSTRAINED_SPEC_PLAN`` overrides the plan: ``measure`` (measure now) or
a fixed plan such as ``prefill=fp32,decode=int4,lm_head=bf16`` (``decode=int4:12/bf16`` for
buckets).

Exactness (on by default on a CPU; ``CONSTRAINED_SPEC_EXACT=0`` turns it off, see `exact_mode`): for speculation
and batching never to change a greedy output, every decode / verify row must be computed as
a 1-row decode of it would be (`runner.LeanRunner`). A plan for an exact runner therefore runs decode and the LM head
on ONE row-invariant kernel (`weights.ROW_INVARIANT_KERNELS`: bf16, int4, int8, q4, q8 -- not fp32)
whatever the rows: the one closest to the fastest over the measured row counts. Prompts keep
their row buckets (a prompt's kernel comes from its own length).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from constrained_spec.errors import ConfigError
from constrained_spec.model.weights import ACT_DTYPE, PACKED_KERNELS, ROW_INVARIANT_KERNELS
from constrained_spec.plan_syntax import (
    ACTIVATIONS,
    ALL_ROWS,
    MEMORY_MODES,
    bucket_kernel,
    check_kernel,
    describe_buckets,
    parse_plan,
)
from constrained_spec.settings import settings

logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
# rows per decode forward the plan is measured at: one request, one request verifying 5
# drafts, and a batch of four such requests
DECODE_ROWS = (1, 6, 24)
PREFILL_ROWS = (128, 512)  # a short prompt, a long one
DENSE_DECODE_GAIN = 0.25  # see _merge
# the gain a resident dense copy must bring a prompt's forward (at every measured prompt
# length) for "auto" memory to keep one: it costs 2-4x the 4-bit bytes of the model
RESIDENT_PREFILL_GAIN = 0.25


def exact_mode(device: torch.device | None = None) -> bool:
    """Whether a lean runner on ``device`` (default: the CPU) is exact: ``CONSTRAINED_SPEC_EXACT``
    (`settings.Settings.exact`) when set, else on for a CPU. Exact computes every decode /
    verify row as a 1-row decode of it would be, so a greedy output does not depend on
    speculation or batching; off lets each forward pick its kernels by its rows. What it costs
    on a CPU, from a 1-row decode to 4 requests x 6 rows: benchmarks/RESULTS.md, "Exactness by
    default: why SDPA could not give it, what replaced it, what it costs".

    Raises
    ------
    ConfigError
        ``CONSTRAINED_SPEC_EXACT=1`` for a device other than the CPU: the query-invariant
        attention is a CPU kernel, so the guarantee cannot be kept there."""
    device = torch.device("cpu") if device is None else device
    asked = settings().exact
    if asked and device.type != "cpu":
        raise ConfigError(f"exact decoding is implemented for the CPU only, not {device.type} "
                          "(unset it or set it to 0 for this device)", option="CONSTRAINED_SPEC_EXACT")
    return device.type == "cpu" if asked is None else asked


_CONTEXT = 128  # context the decode rows attend to while timed
HEAD_ONLY_KERNELS = ("q8",)  # kernels for the LM head alone (its 8-bit groups), timed there only
# 4: "auto" memory, dequantization 2x faster; 5: the q4 and q8 kernels; 6: the conditions of
# each measurement kept, and none kept that the machine disturbed (a version-5 plan may have been)
_PLAN_VERSION = 6
_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "asimd", "sve")


@dataclass
class KernelPlan:
    """Kernels per phase (see the module docstring)."""

    prefill: list[tuple[int, str]]  # (up to this many rows, kernel), ascending; the last covers all
    decode: list[tuple[int, str]]  # the same, for decode / verify forwards
    lm_head: str
    kv: str = "bf16"  # the KV cache's dtype
    # "measured", "flags" (`flag_plan`, nothing timed), "env" (CONSTRAINED_SPEC_PLAN) or "fixed"
    source: str = "fixed"
    # "fast": every dense form the plan uses stays resident; "lean": a prompt dequantizes
    # 4-bit weights per call and a dense decode bucket must win by DENSE_DECODE_GAIN
    memory: str = "fast"
    times_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> kernel -> ms
    # the activations of the native decode stack's 4-bit products: "bf16" (the model's), or
    # "int8" (each row's groups quantized; CONSTRAINED_SPEC_ACTIVATIONS, `_choose_act`)
    act: str = "bf16"
    # a measured plan's `Conditions` (when, under what load), as `Conditions.to_json`
    conditions: dict[str, Any] = field(default_factory=dict)

    # written out (the dataclass keeps it) because ``prefill`` also takes one kernel for every
    # prompt length, which the field, always buckets once built, does not
    def __init__(self, prefill: list[tuple[int, str]] | str, decode: list[tuple[int, str]],
                 lm_head: str, kv: str = "bf16", source: str = "fixed", memory: str = "fast",
                 times_ms: dict[str, dict[str, float]] | None = None, act: str = "bf16",
                 conditions: dict[str, Any] | None = None) -> None:
        self.prefill = [(ALL_ROWS, prefill)] if isinstance(prefill, str) else prefill
        self.decode = decode
        self.lm_head = lm_head
        self.kv = kv
        self.source = source
        self.memory = memory
        self.times_ms = {} if times_ms is None else times_ms
        self.act = act
        self.conditions = {} if conditions is None else conditions
        self.__post_init__()

    def __post_init__(self) -> None:
        for k in [self.lm_head, *(k for _, k in self.prefill), *(k for _, k in self.decode)]:
            check_kernel(k)
        if self.memory not in MEMORY_MODES:
            raise ConfigError(f"memory mode {self.memory!r} is not one of {', '.join(MEMORY_MODES)}",
                              option="CONSTRAINED_SPEC_MEMORY")
        if self.act not in ACTIVATIONS:
            raise ConfigError(f"activations {self.act!r} are not one of {', '.join(ACTIVATIONS)}",
                              option="CONSTRAINED_SPEC_PLAN")
        if self.kv not in ("fp32", "bf16"):
            raise ConfigError(f"kv cache dtype {self.kv!r} is not fp32 or bf16",
                              option="CONSTRAINED_SPEC_PLAN")
        self.decode = sorted((int(r), k) for r, k in self.decode)
        self.prefill = sorted((int(r), k) for r, k in self.prefill)

    @classmethod
    def uniform(cls, kernel: str, *, source: str = "fixed") -> KernelPlan:
        """The same kernel for every phase."""
        return cls(prefill=[(ALL_ROWS, kernel)], decode=[(ALL_ROWS, kernel)], lm_head=kernel,
                   kv="fp32" if kernel == "fp32" else "bf16", source=source)

    def decode_kernel(self, rows: int) -> str:
        return bucket_kernel(self.decode, rows)

    def prefill_kernel(self, rows: int) -> str:
        return bucket_kernel(self.prefill, rows)

    def kernels(self) -> set[str]:
        return {self.lm_head, *(k for _, k in self.prefill), *(k for _, k in self.decode)}

    @property
    def decode_dtype(self) -> torch.dtype:
        """Activations of a 1-row decode: the dtype drafters and kept features use."""
        return ACT_DTYPE[self.decode_kernel(1)]

    def describe(self) -> str:
        return (f"prefill={describe_buckets(self.prefill)},decode={describe_buckets(self.decode)},"
                f"lm_head={self.lm_head},kv={self.kv},memory={self.memory}"
                + ("" if self.act == "bf16" else f",act={self.act}"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KernelPlan:
        return cls(prefill=[tuple(x) for x in d["prefill"]], decode=[tuple(x) for x in d["decode"]],
                   lm_head=d["lm_head"], memory=d.get("memory", "fast"),
                   kv=d.get("kv", "bf16"), source=d.get("source", "fixed"),
                   times_ms=d.get("times_ms", {}), act=d.get("act", "bf16"),
                   conditions=d.get("conditions", {}))

    @classmethod
    def parse(cls, text: str, *, memory: str = "fast") -> KernelPlan:
        """A fixed plan's text (`constrained_spec.plan_syntax.parse_plan`)."""
        return cls(**parse_plan(text, memory=memory), source="env")


def _merge(times: dict[int, dict[str, float]], *, margin: float = 0.1,
           dense_margin: float | None = None) -> list[tuple[int, str]]:
    """Buckets from the kernels' times at measured row counts (boundaries halfway between
    them). A kernel takes over from the previous bucket's only when it is more than ``margin``
    faster there: fewer kernels mean fewer packs in memory, and noise does not split buckets.
    ``dense_margin``: the gain a dense kernel needs to take over from a packed one (a dense
    decode bucket keeps a dense copy of every 4-bit matrix: 2-4x their bytes)."""
    rows = sorted(times)
    merged: list[tuple[int, str]] = []
    for i, r in enumerate(rows):
        k = _best(times[r])
        prev = merged[-1][1] if merged else None
        need = margin
        if dense_margin is not None and k in ("fp32", "bf16"):
            need = dense_margin
            if prev is None:  # the first bucket: against the fastest packed kernel
                prev = min((p for p in times[r] if p in PACKED_KERNELS),
                           key=times[r].__getitem__, default=None)
        if prev in times[r] and times[r][prev] <= (1 + need) * times[r][k]:
            k = prev
        limit = (r + rows[i + 1]) // 2 if i + 1 < len(rows) else ALL_ROWS
        if merged and merged[-1][1] == k:
            merged[-1] = (limit, k)
        else:
            merged.append((limit, k))
    return merged


def _decode_buckets(times: dict[int, dict[str, float]], *,
                    dense_margin: float | None = DENSE_DECODE_GAIN,
                    exact: bool = False) -> list[tuple[int, str]]:
    """Decode buckets over at most one dense kernel (each keeps a resident dense copy of the
    model) plus the packed ones: of the kernel sets allowed, the one whose buckets are closest
    to the fastest kernel at every measured row count (sum of time / best time). ``exact``: one
    row-invariant kernel for every row count (switching kernel at a row count would compute a
    verify row differently from a 1-row decode)."""
    kernels = set().union(*(t.keys() for t in times.values()))
    packed = kernels & PACKED_KERNELS
    if exact:
        kernels = (kernels & ROW_INVARIANT_KERNELS) or kernels
        sets = [{k} for k in kernels]
    else:
        sets = [{k} for k in kernels] + [packed | {d} for d in kernels - packed if packed]
    best: tuple[float, int, list[tuple[int, str]]] | None = None
    for allowed in sets:
        sub = {r: {k: v for k, v in t.items() if k in allowed} for r, t in times.items()}
        if any(not t for t in sub.values()):
            continue
        buckets = _merge(sub, dense_margin=dense_margin)
        cost = sum(times[r][bucket_kernel(buckets, r)] / min(times[r].values()) for r in times)
        key = (round(cost, 3), len({k for _, k in buckets}), buckets)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        raise ValueError("no kernel was timed at every row count: cannot choose decode buckets "
                         f"from {times!r}")
    return best[2]


# -- the machine ---------------------------------------------------------------------------
def cpu_flags() -> list[str]:
    """The CPU feature flags the OS reports that matter for the kernels (Linux /proc/cpuinfo;
    empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return [f for f in _CPU_FLAGS if f in have]
    return []


def machine_info() -> dict[str, Any]:
    """What the plan depends on: CPU model and flags, torch's build and capability, threads,
    and the environment variables that restrict the kernels' instruction sets."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": cpu_flags(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()),
        "threads": torch.get_num_threads(),
        "isa_env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                 "MKL_ENABLE_INSTRUCTIONS") if k in os.environ},
    }


def machine_key(device: torch.device) -> str:
    if device.type != "cpu":
        return f"{device.type}:{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}"
    m = machine_info()
    return json.dumps([m["cpu"], m["flags"], m["torch"], m["capability"], m["threads"],
                       sorted(m["isa_env"].items())])


# -- the plan from the CPU's flags ----------------------------------------------------------
# a prompt of more rows than this runs on float32 where the CPU has no bf16 units: on the AVX2
# class the 4-bit products of a long prompt are float32 FMAs, slower than one dense product
FLAG_PREFILL_ROWS = 320


def bf16_units() -> bool:
    """Whether torch's CPU kernels run bf16 natively here (oneDNN's check: AVX-512-BF16 or AMX;
    ``ONEDNN_MAX_CPU_ISA`` below them turns it off)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def flag_plan(runner: Any, *, memory: str) -> KernelPlan:
    """The plan for ``runner`` from the CPU's flags and the weights' formats, timing nothing:
    what the measured plans of every CPU class chose (benchmarks/RESULTS.md, "Kernel plan from
    the CPU's flags"). Decode and the LM head on one row-invariant kernel (exact as a measured
    plan is): the native kernels on the file's own groups where they build (4-bit on q4, 8-bit
    on q8), else torch's int4 on 4-bit groups, else bf16. A prompt on the same packed kernel
    where the CPU has bf16 units; without them (AVX2) a long prompt on float32. ``memory``
    "auto" is "lean": no measured plan on either class kept a resident dense copy."""
    bf16 = bf16_units()
    if runner.supports_kernel("q4"):
        decode = "q4"
    elif runner.supports_kernel("int4"):
        decode = "int4"
    else:
        decode = "bf16"
    dense = "bf16" if bf16 else "fp32"
    if decode == "bf16":
        prefill = [(ALL_ROWS, dense)]
    elif bf16 and decode == "q4":
        prefill = [(ALL_ROWS, "q4")]
    else:
        prefill = [(FLAG_PREFILL_ROWS, decode), (ALL_ROWS, dense)]
    head = runner.lm_head_weight
    lm_head = next((k for k in ("q8", "q4") if decode == "q4" and head.supports(k)), "bf16")
    return KernelPlan(prefill=prefill, decode=[(ALL_ROWS, decode)], lm_head=lm_head, kv="bf16",
                      source="flags", memory="lean" if memory == "auto" else memory)


# -- what the machine was doing while a plan was measured ----------------------------------
# a measurement is disturbed, and not kept, when any of these is passed (`Conditions.disturbed`)
MAX_TIMING_SPREAD = 1.3  # median over (phase, kernel) of slowest / fastest round
MAX_REFERENCE_SPREAD = 1.3  # slowest / fastest run of the reference loop (before, between, after)
MAX_STEAL = 0.1  # share of the CPU time the hypervisor took during the measurement
MAX_OTHER_LOAD = 1.0  # runnable processes besides our threads, per core (1-minute load average)


def _clock() -> float:
    """The clock every timing of a measurement reads (a test replaces it)."""
    return time.perf_counter()


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not on every OS
        return 0.0


def _cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs since boot (Linux ``/proc/stat``), None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _reference_ms() -> float:
    """A fixed float32 product timed (best of 5 runs of about a millisecond each): before,
    between and after the rounds of a measurement it should take the same time; when it does
    not, something else ran on the cores meanwhile."""
    a = torch.ones(256, 256)
    torch.mm(a, a)  # warm: the thread pool awake
    best = float("inf")
    for _ in range(5):
        start = _clock()
        for _ in range(4):
            torch.mm(a, a)
        best = min(best, _clock() - start)
    return best * 1e3


@dataclass
class Conditions:
    """What the machine was doing while a plan was measured (kept with a measured plan, and
    printed by ``constrained-spec info``)."""

    at: str  # when (UTC, ISO 8601)
    load_before: float  # 1-minute load averages
    load_after: float
    steal: float  # share of CPU time stolen by the hypervisor meanwhile
    reference_spread: float  # slowest / fastest run of the reference loop
    timing_spread: float  # median over (phase, kernel) of slowest / fastest round
    threads: int
    cores: int

    def disturbed(self) -> str | None:
        """Why the measurement cannot be trusted, or None."""
        other = (max(self.load_before, self.load_after) - self.threads) / max(1, self.cores)
        if other >= MAX_OTHER_LOAD:
            return (f"other processes kept the CPUs busy (load average {self.load_before:.1f} "
                    f"before, {self.load_after:.1f} after, on {self.cores} cores)")
        if self.steal > MAX_STEAL:
            return f"the hypervisor took {self.steal:.0%} of the CPU time"
        if self.reference_spread > MAX_REFERENCE_SPREAD:
            return (f"a fixed reference loop ran {self.reference_spread:.2f}x slower at one point "
                    "than at another")
        if self.timing_spread > MAX_TIMING_SPREAD:
            return (f"repeated timings of the same kernel disagreed by {self.timing_spread:.2f}x "
                    "(median)")
        return None

    def describe(self) -> str:
        return (f"measured {self.at} at load average {self.load_before:.1f}/{self.load_after:.1f} "
                f"(before/after, {self.cores} cores), steal {self.steal:.0%}, repeated timings "
                f"within {self.timing_spread:.2f}x")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Watch:
    """Collects a measurement's `Conditions`: load and steal at its ends, the reference loop at
    every `mark`, and each timing of a (phase, kernel) across rounds."""

    def __init__(self) -> None:
        self.load_before, self.cpu_before = _load_average(), _cpu_times()
        self.reference = [_reference_ms()]
        self.samples: dict[tuple[str, str], list[float]] = {}

    def mark(self) -> None:
        self.reference.append(_reference_ms())

    def sample(self, phase: str, kernel: str, seconds: float) -> None:
        self.samples.setdefault((phase, kernel), []).append(seconds)

    def conditions(self) -> Conditions:
        after = _cpu_times()
        steal = 0.0
        if self.cpu_before is not None and after is not None and after[1] > self.cpu_before[1]:
            steal = (after[0] - self.cpu_before[0]) / (after[1] - self.cpu_before[1])
        ratios = sorted(max(v) / max(min(v), 1e-9) for v in self.samples.values() if len(v) > 1)
        from datetime import datetime, timezone

        return Conditions(
            at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            load_before=round(self.load_before, 2), load_after=round(_load_average(), 2),
            steal=round(max(0.0, steal), 3),
            reference_spread=round(max(self.reference) / max(min(self.reference), 1e-9), 3),
            timing_spread=round(ratios[len(ratios) // 2] if ratios else 1.0, 3),
            threads=torch.get_num_threads(), cores=os.cpu_count() or 1)


def _fixed_memory(mode: str) -> str:
    """The memory mode of a plan written by hand: "auto" keeps what its kernels need."""
    return "fast" if mode == "auto" else mode


# -- measuring -----------------------------------------------------------------------------
def _best(times: dict[str, float]) -> str:
    return min(times, key=times.__getitem__)


def measure(runner: Any, candidates: Sequence[str], *, rows: Sequence[int] = DECODE_ROWS,
            prefill_rows: Sequence[int] = PREFILL_ROWS, repeats: int = 2, memory: str = "fast",
            progress: Callable[[str], None] | None = None, exact: bool = False,
            activations: str = "bf16") -> KernelPlan:
    """Time each phase of ``runner`` (a lean runner) with each kernel in ``candidates`` and
    return the fastest per phase, over ``repeats`` rounds of every kernel (``progress`` is
    called once per kernel and round). Uses one scratch slot, freed after. ``exact``: decode
    and the LM head on one row-invariant kernel (see the module docstring). ``activations``
    "auto": the chosen decode kernel is timed again with int8 activations (`_choose_act`)."""
    times: dict[str, dict[str, float]] = {f"prefill@{r}": {} for r in prefill_rows}
    times.update({f"decode@{r}": {} for r in rows})
    times["lm_head"] = {}
    slot = runner.new_slot()
    prompt = [(7 * i + 3) % min(runner.vocab_size, 1000) for i in range(max(*prefill_rows, _CONTEXT))]
    saved = runner.plan
    lean = "int4" if "int4" in candidates else None
    # "auto" times a prompt's dense kernels both ways: dequantized per call and resident
    prefill_modes = ("lean", "fast") if memory == "auto" else (memory,)
    resident: dict[str, dict[str, float]] = {f"prefill@{r}": {} for r in prefill_rows}
    watch = _Watch()

    def keep(into: dict[str, dict[str, float]], phase: str, kernel: str, seconds: float) -> None:
        into[phase][kernel] = min(seconds, into[phase].get(kernel, float("inf")))
        watch.sample(phase + (" resident" if into is resident else ""), kernel, seconds)

    def prefill_call(r: int) -> Callable[[], None]:
        def call() -> None:  # a prompt of r tokens into the emptied slot
            runner.truncate(slot, 0)
            runner.forward([slot], [prompt[:r]], [0], phase="prefill")
        return call

    def decode_call(r: int) -> Callable[[], None]:
        def call() -> None:  # r rows after the _CONTEXT tokens prefilled before
            runner.truncate(slot, _CONTEXT)
            runner.forward([slot], [prompt[:r]], [0], phase="decode")
        return call

    def one_round(kernel: str, warm: bool) -> None:
        # a prompt runs as it would next to a 4-bit decode: in lean memory its dense forms
        # are dequantized per call (no resident dense copy); the cache in the kernel's dtype
        kv = "fp32" if kernel == "fp32" else "bf16"
        for mode in prefill_modes if kernel in ("fp32", "bf16") else prefill_modes[:1]:
            into = resident if mode == "fast" and memory == "auto" else times
            runner.set_plan(KernelPlan(prefill=kernel, decode=[(ALL_ROWS, lean or kernel)],
                                       lm_head=kernel, kv=kv, memory=mode))
            for r in prefill_rows:
                keep(into, f"prefill@{r}", kernel, _timed(1, prefill_call(r), warm=warm))
        runner.set_plan(KernelPlan.uniform(kernel))  # decode kernels keep dense forms resident
        runner.truncate(slot, 0)
        runner.forward([slot], [prompt[:_CONTEXT]], [0], phase="prefill")
        for r in rows:
            keep(times, f"decode@{r}", kernel, _timed(2, decode_call(r), warm=warm))
        # the LM head's kernels: this one, and those only an LM head has (q8: its 8-bit groups)
        for k in (kernel, *(k for k in HEAD_ONLY_KERNELS if kernel == candidates[0])):
            if runner.lm_head_weight.supports(k):
                keep(times, "lm_head", k, _timed(2, _head_call(runner, rows, k), warm=warm))

    try:
        # round-robin over the kernels, keeping each one's best time: a burst of load from
        # another process then slows one round of every kernel, not every timing of one
        # (a kernel-major loop cached a wrong plan on a busy machine)
        for rnd in range(max(1, repeats)):
            for kernel in candidates if rnd % 2 == 0 else candidates[::-1]:
                if progress:
                    progress(f"{kernel} (round {rnd + 1})")
                one_round(kernel, warm=rnd == 0)
            watch.mark()
    finally:
        runner.free_slot(slot)
        runner.set_plan(saved)
    plan = _plan_from_times(runner, times, resident, rows=rows, prefill_rows=prefill_rows,
                            repeats=repeats, memory=memory, exact=exact, activations=activations)
    plan.conditions = watch.conditions().to_json()
    return plan


def _plan_from_times(runner: Any, times: dict[str, dict[str, float]],
                     resident: dict[str, dict[str, float]], *, rows: Sequence[int],
                     prefill_rows: Sequence[int], repeats: int, memory: str, exact: bool,
                     activations: str) -> KernelPlan:
    """`measure`'s choice from its timings (seconds per phase and kernel): decode buckets,
    the prompt's kernels and memory mode, the LM head, and (``activations`` "auto") int8
    activations timed again on the chosen decode kernel."""
    decode = _decode_buckets({r: times[f"decode@{r}"] for r in rows},
                             dense_margin=None if memory == "fast" else DENSE_DECODE_GAIN, exact=exact)
    prefill = {r: times[f"prefill@{r}"] for r in prefill_rows}
    if memory == "auto":
        memory = _auto_memory(decode, prefill, {r: resident[f"prefill@{r}"] for r in prefill_rows})
        if memory == "fast":
            prefill = {r: {**prefill[r], **resident[f"prefill@{r}"]} for r in prefill_rows}
        times.update({f"{p} resident": t for p, t in resident.items()})
    first = decode[0][1]
    head = times["lm_head"]
    if exact:
        head = {k: v for k, v in head.items() if k in ROW_INVARIANT_KERNELS} or head
    act = "bf16"
    if activations == "auto" and len({k for _, k in decode}) == 1:
        act, act_times = _choose_act(runner, first, rows, repeats)
        times.update(act_times)
    return KernelPlan(prefill=_merge(prefill), decode=decode, lm_head=_best(head),
                      kv="fp32" if first == "fp32" else "bf16", source="measured", memory=memory,
                      times_ms={p: {k: round(v * 1e3, 3) for k, v in t.items()} for p, t in times.items()},
                      act=act)


def _act_choices(runner: Any, kernel: str) -> tuple[str, ...]:
    """`LeanRunner.act_choices`; bf16 only for a runner without it."""
    choices = getattr(runner, "act_choices", None)
    return ("bf16",) if choices is None else tuple(choices(kernel))


# the gain int8 activations must bring the decode rows (on average over the measured row
# counts) for a measured plan to take them: they cost the exactness against the bf16 products
ACT_GAIN = 0.1


def _choose_act(runner: Any, kernel: str, rows: Sequence[int],
                repeats: int) -> tuple[str, dict[str, dict[str, float]]]:
    """("int8" or "bf16", the times) for decode forwards on ``kernel``: both activations timed
    at each of ``rows`` in alternating rounds, int8 taken when its mean time ratio to bf16 is
    below 1 / (1 + `ACT_GAIN`). "bf16" and no times where int8 activations cannot run
    (`LeanRunner.act_choices`)."""
    if "int8" not in _act_choices(runner, kernel):
        return "bf16", {}
    times: dict[str, dict[str, float]] = {f"decode@{r} act": {} for r in rows}
    slot = runner.new_slot()
    saved = runner.plan
    prompt = [(7 * i + 3) % min(runner.vocab_size, 1000) for i in range(max(_CONTEXT, *rows))]

    def decode_call(r: int) -> Callable[[], None]:
        def call() -> None:
            runner.truncate(slot, _CONTEXT)
            runner.forward([slot], [prompt[:r]], [0], phase="decode")
        return call

    try:
        for rnd in range(max(1, repeats)):
            for act in ACTIVATIONS if rnd % 2 == 0 else ACTIVATIONS[::-1]:
                plan = KernelPlan.uniform(kernel)
                plan.act = act
                runner.set_plan(plan)
                runner.forward([slot], [prompt[:_CONTEXT]], [0], phase="prefill")
                for r in rows:
                    seconds = _timed(2, decode_call(r), warm=rnd == 0)
                    phase = times[f"decode@{r} act"]
                    phase[act] = min(seconds, phase.get(act, float("inf")))
    finally:
        runner.free_slot(slot)
        runner.set_plan(saved)
    ratio = sum(t["int8"] / t["bf16"] for t in times.values()) / len(times)
    return ("int8" if ratio * (1 + ACT_GAIN) < 1 else "bf16"), times


def _head_call(runner: Any, rows: Sequence[int], kernel: str) -> Callable[[], Any]:
    """The LM head of one request verifying its drafts (the second measured row count)."""
    h = torch.randn(max(rows), runner.hidden_size)
    n = rows[min(1, len(rows) - 1)]
    return lambda: runner.lm_head_linear(h[:n], kernel)


def _auto_memory(decode: list[tuple[int, str]], per_call: dict[int, dict[str, float]],
                 resident: dict[int, dict[str, float]]) -> str:
    """"fast" when a decode bucket runs dense (its copies are resident anyway, so a prompt may
    use them for free) or a resident dense copy makes every measured prompt length faster by
    `RESIDENT_PREFILL_GAIN` than the best kernel without one; else "lean"."""
    if any(k in ("fp32", "bf16") for _, k in decode):
        return "fast"
    wins = [min(resident[r].values(), default=float("inf")) * (1 + RESIDENT_PREFILL_GAIN)
            < min(per_call[r].values()) for r in per_call]
    return "fast" if wins and all(wins) else "lean"


def _timed(repeats: int, fn: Callable[[], Any], *, warm: bool = True) -> float:
    if warm:
        fn()  # warm-up: packs built, caches allocated
    best = float("inf")
    for _ in range(repeats):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


# -- choosing and caching ------------------------------------------------------------------
def plan_key(runner: Any, *, int8: bool = False) -> str:
    """The key of ``runner``'s plan in a plan file: machine, memory mode, int8, exactness,
    whether the native kernels load here (`kernels.cpu_native.available`) and on AMX tiles
    (their ``amx`` build, `settings.Settings.amx`), and the activations setting.

    The CPU alone does not say whether q4 / q8 can run: that also takes a compiler and a
    library that loads, both of which can come and go on the same machine. A plan measured
    with them names kernels that cannot run without them, so a key from a process where they
    do not load (``|no-native``) never finds it (and the reverse: one measured without them is
    measured again once they load). Plans stored before this part of the key keep their key
    where the kernels load."""
    from constrained_spec.kernels import cpu_native

    exact = bool(getattr(runner, "exact", False))
    native = runner.device.type != "cpu" or cpu_native.available()
    amx = native and runner.device.type == "cpu" and cpu_native.build_for_this_cpu() == "amx"
    act = settings().activations
    return (machine_key(runner.device) + "|" + settings().memory + ("|int8" if int8 else "")
            + ("|exact" if exact else "") + ("" if native else "|no-native")
            + ("|amx" if amx else "") + ("" if act == "bf16" else f"|act-{act}"))


def _cached(path: Path | None, key: str) -> KernelPlan | None:
    if path is None:
        return None
    try:
        stored = json.loads(path.read_text())
        if stored.get("version") == _PLAN_VERSION and key in stored.get("plans", {}):
            return KernelPlan.from_json(stored["plans"][key])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        pass
    return None


def plan_to_measure(runner: Any, *, dtype: str, cache: Path | None, int8: bool = False) -> bool:
    """Whether `choose_plan` would measure a plan now: only when asked
    (``CONSTRAINED_SPEC_PLAN=measure``), on a CPU, with no dtype fixed. Without a measured
    plan cached for this machine a load takes `flag_plan` and times nothing."""
    del cache, int8  # a cached plan no longer decides: measuring is asked for, never implied
    return settings().plan == "measure" and runner.device.type == "cpu" \
        and dtype not in ("float32", "bfloat16", "float16")


def plan_candidates(runner: Any, *, int8: bool = False) -> list[str]:
    """The kernels `choose_plan` times for ``runner``: those that run any of its weights
    (int8, a re-quantization, only when ``int8``)."""
    return [k for k in ("fp32", "bf16", "int4", "q4", "int8")
            if runner.supports_kernel(k) and (k != "int8" or int8)]


# Bounds on measuring a plan in a child process (`loading._measure_plan_apart`): the child
# loads the model (seconds: the parent converted it already), then times every candidate
# kernel twice over 128- and 512-row prompts and 1-, 6- and 24-row decodes. The slowest
# candidate seen, bf16 emulated on an AVX2-only CPU, takes about 30 s of that for the 135M
# embedded model on 2 threads (benchmarks/RESULTS.md, "Kernel plan per machine"); a kernel is
# given 3x that per 135M weights (a busy machine), and no less than a minute.
MEASURE_START_S = 120.0
MEASURE_KERNEL_S_PER_GWEIGHT = 670.0
MEASURE_KERNEL_MIN_S = 60.0


def measure_timeout(runner: Any, *, int8: bool = False) -> float:
    """Seconds a child measuring ``runner``'s plan may take before it is taken for hung:
    `MEASURE_START_S`, plus per candidate kernel (`plan_candidates`)
    `MEASURE_KERNEL_S_PER_GWEIGHT` per billion weights of its matrices (the LM head's
    included; at least `MEASURE_KERNEL_MIN_S`), more for fewer than 2 threads. For the
    embedded model on 2 threads (4 candidates): 8 minutes, against about 70 s for the whole
    child on an AVX-512 CPU with the machine half busy."""
    linears = [*runner.linears(), runner.lm_head_weight] if hasattr(runner, "linears") else []
    weights = sum(lin.shape[0] * lin.shape[1] for lin in linears)
    slower = max(1.0, 2 / max(1, torch.get_num_threads()))
    per_kernel = max(MEASURE_KERNEL_MIN_S, MEASURE_KERNEL_S_PER_GWEIGHT * weights / 1e9 * slower)
    return MEASURE_START_S + per_kernel * max(1, len(plan_candidates(runner, int8=int8)))


def choose_plan(runner: Any, *, dtype: str, cache: Path | None, int8: bool = False,
                quiet: bool = False) -> KernelPlan:
    """The plan for ``runner``: fixed by an explicit ``dtype`` ("float32" / "bfloat16" /
    "float16"), by ``CONSTRAINED_SPEC_PLAN``, read from ``cache / plan.json`` for this machine,
    or `flag_plan`; with ``CONSTRAINED_SPEC_PLAN=measure``, measured now and written there
    unless the machine disturbed the measurement (then `flag_plan`, with a warning)."""
    env = settings().plan or ""  # "measure", a fixed plan, or "" (cached, else from the flags)
    if dtype == "float32":
        return KernelPlan.uniform("fp32")
    if runner.device.type != "cpu":
        return KernelPlan.uniform("bf16")
    int4 = runner.supports_kernel("int4")
    exact = bool(getattr(runner, "exact", False))
    if dtype in ("bfloat16", "float16"):  # as before the plan: 4-bit for few rows where exact
        decode = [(ALL_ROWS, "int4")] if int4 and exact else \
            [(12, "int4" if int4 else "bf16"), (ALL_ROWS, "bf16")]
        return KernelPlan(prefill=[(ALL_ROWS, "bf16")], decode=decode, lm_head="bf16")
    memory = settings().memory
    if env and env != "measure":
        return _with_act(runner, KernelPlan.parse(env, memory=_fixed_memory(memory)), fixed=True)
    key = plan_key(runner, int8=int8)
    path = None if cache is None else cache / PLAN_FILE
    if env != "measure":
        cached = _cached(path, key)
        return _with_act(runner, cached if cached is not None else flag_plan(runner, memory=memory))
    plan = _measure_now(runner, int8=int8, memory=memory, exact=exact, quiet=quiet)
    disturbed = Conditions(**plan.conditions).disturbed()
    if disturbed is not None:
        logger.warning("the kernel plan measured here is not kept: %s. The plan from the CPU's "
                       "flags runs instead; measure again on a quiet machine with "
                       "`constrained-spec info --measure`", disturbed)
        return _with_act(runner, flag_plan(runner, memory=memory))
    logger.info("kernel plan: %s", plan.describe())
    if path is not None:
        _store(path, key, plan)
    return _with_act(runner, plan)


def _measure_now(runner: Any, *, int8: bool, memory: str, exact: bool, quiet: bool) -> KernelPlan:
    """`measure` over `plan_candidates`, two rounds, with a progress bar unless ``quiet``."""
    candidates = plan_candidates(runner, int8=int8)
    from tqdm.auto import tqdm

    rounds = 2
    with tqdm(total=rounds * len(candidates), desc="measure the kernel plan",
              disable=quiet, file=sys.stderr) as bar:
        def advance(kernel: str) -> None:
            bar.set_postfix_str(kernel)
            bar.update(1)

        return measure(runner, candidates, memory=memory, repeats=rounds, exact=exact,
                       progress=advance, activations=settings().activations)


def _with_act(runner: Any, plan: KernelPlan, *, fixed: bool = False) -> KernelPlan:
    """``plan`` with the activations ``CONSTRAINED_SPEC_ACTIVATIONS`` asks for: "int8" sets
    them where they can run (`LeanRunner.act_choices` of the 1-row decode kernel), "bf16"
    clears them; "auto" keeps the measured choice. A fixed plan's ``act=int8`` where int8
    activations cannot run is a `ConfigError` (it would be silently bf16 otherwise)."""
    asked = settings().activations
    can = "int8" in _act_choices(runner, plan.decode_kernel(1))
    if fixed and plan.act == "int8" and not can:
        raise ConfigError("act=int8 needs exact decode rows on the native layer stack with "
                          f"4-bit weights; with decode={plan.decode_kernel(1)} here it cannot run",
                          option="CONSTRAINED_SPEC_PLAN")
    if asked == "int8" and can:
        plan.act = "int8"
    elif asked == "bf16" and not fixed:
        plan.act = "bf16"
    return plan


def _store(path: Path, key: str, plan: KernelPlan) -> None:
    """Add this machine's plan to ``path`` (`cache.write_private`: an owner-only temp file,
    then renamed)."""
    try:
        stored = json.loads(path.read_text())
        if stored.get("version") != _PLAN_VERSION:
            stored = {}
    except (OSError, ValueError):
        stored = {}
    plans = stored.get("plans", {})
    plans[key] = plan.to_json()
    from constrained_spec.cache import write_private

    try:  # owner-only (0600), atomically: the plan decides which kernels run
        write_private(path, json.dumps({"version": _PLAN_VERSION, "plans": plans}, indent=1))
    except OSError as e:
        logger.warning("could not cache the kernel plan in %s: %s", path.parent, e)
