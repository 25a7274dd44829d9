"""The kernel plan's words, without torch: kernel names, memory modes, and the text of a fixed
plan (``CONSTRAINED_SPEC_PLAN=prefill=fp32,decode=int4:12/bf16,lm_head=bf16``), and the
activations of a decode forward's 4-bit products (``act=bf16`` or ``act=int8``).

`constrained_spec.settings` checks a fixed plan with `parse_plan` when it reads the environment
(before torch is imported); `constrained_spec.model.plan` builds its `KernelPlan` from the same
fields. What each kernel is lives in `constrained_spec.model.weights`.
"""

from __future__ import annotations

from typing import Any, Literal

from constrained_spec.errors import ConfigError

Kernel = Literal["fp32", "bf16", "int8", "int4", "q4", "q8"]
KERNELS: tuple[Kernel, ...] = ("fp32", "bf16", "int8", "int4", "q4", "q8")
MEMORY_MODES = ("fast", "lean")  # what a plan holds; CONSTRAINED_SPEC_MEMORY may also say "auto"
# what a decode forward's 4-bit products multiply: the model's bf16 activations, or each row's
# groups of 32 quantized to int8 (integer dot products; CONSTRAINED_SPEC_ACTIVATIONS)
ACTIVATIONS = ("bf16", "int8")
PHASES = ("prefill", "decode", "lm_head", "kv", "memory", "act")
ALL_ROWS = 1 << 30  # the row limit of a bucket that covers every row count
_OPTION = "CONSTRAINED_SPEC_PLAN"


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ConfigError(f"unknown kernel {kernel!r} in the kernel plan; use one of "
                          f"{', '.join(KERNELS)}", option=_OPTION)


def parse_plan(text: str, *, memory: str = "fast") -> dict[str, Any]:
    """``prefill=fp32,decode=int4:12/bf16,lm_head=bf16[,kv=bf16][,memory=lean][,act=int8]`` ->
    the `KernelPlan` fields (``prefill``, ``decode``, ``lm_head``, ``kv``, ``memory``, ``act``),
    checked: missing phases take the decode kernel of 1 row; a missing ``memory`` is
    ``memory``, a missing ``act`` is bf16."""
    parts: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in PHASES:
            raise ConfigError(f"cannot read kernel plan entry {item!r}: write phase=kernel "
                              f"with phase in {', '.join(PHASES)} "
                              "(e.g. prefill=fp32,decode=int4,lm_head=bf16)", option=_OPTION)
        parts[key] = value.strip()
    if "decode" not in parts:
        raise ConfigError("a kernel plan needs decode=KERNEL", option=_OPTION)
    if parts.get("memory", "fast") not in MEMORY_MODES:
        raise ConfigError(f"memory={parts['memory']!r} in the kernel plan: use fast or lean",
                          option=_OPTION)
    if parts.get("act", "bf16") not in ACTIVATIONS:
        raise ConfigError(f"act={parts['act']!r} in the kernel plan: use bf16 or int8",
                          option=_OPTION)
    decode = parse_buckets(parts["decode"])
    first = sorted(decode)[0][1]
    fields: dict[str, Any] = {"prefill": parse_buckets(parts.get("prefill", first)), "decode": decode,
              "lm_head": parts.get("lm_head", first),
              "kv": parts.get("kv", "fp32" if first == "fp32" else "bf16"),
              "memory": parts.get("memory") or memory, "act": parts.get("act", "bf16")}
    for kernel in [fields["lm_head"], *(k for _, k in fields["prefill"]), *(k for _, k in decode)]:
        check_kernel(kernel)
    return fields


def parse_buckets(text: str) -> list[tuple[int, str]]:
    """``int4:12/bf16`` -> ``[(12, "int4"), (ALL_ROWS, "bf16")]``.

    A row limit is a whole number of rows, at least 1: a forward has at least one row, so a
    limit of 0 or below would be a bucket no forward reaches (and a negative one sorted first
    would have looked like a real bucket).

    Raises
    ------
    ConfigError
        A limit that is not a whole number, or is below 1; ``option`` is
        ``CONSTRAINED_SPEC_PLAN`` and the message names the bucket.
    """
    out = []
    for piece in text.split("/"):
        kernel, _, rows = piece.partition(":")
        try:
            limit = int(rows) if rows else ALL_ROWS
        except ValueError:
            raise ConfigError(f"bad row limit in kernel plan bucket {piece!r}: write kernel:rows",
                              option=_OPTION) from None
        if limit < 1:
            raise ConfigError(f"row limit {limit} in kernel plan bucket {piece!r} is below 1: a "
                              "bucket covers forwards of up to that many rows (e.g. int4:12)",
                              option=_OPTION)
        out.append((limit, kernel))
    return out


def bucket_kernel(buckets: list[tuple[int, str]], rows: int) -> str:
    """The kernel of the first bucket whose row limit covers ``rows``."""
    for limit, kernel in buckets:
        if rows <= limit:
            return kernel
    return buckets[-1][1]


def describe_buckets(buckets: list[tuple[int, str]]) -> str:
    """The inverse of `parse_buckets`."""
    return "/".join(f"{k}:{r}" if i < len(buckets) - 1 else k for i, (r, k) in enumerate(buckets))
