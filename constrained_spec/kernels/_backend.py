"""Backend choice shared by every kernel dispatcher.

Each op has a plain-torch reference that defines it, a vectorised torch path, and a Triton
kernel. `resolve_backend` picks one by device: Triton on CUDA when it imports, torch elsewhere.
Triton is imported lazily (on the first Triton launch), so the library imports without it and
`TRITON_INTERPRET=1` set by a test before that first launch still takes effect.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from constrained_spec.errors import ConfigError

Backend = Literal["auto", "torch", "triton"]

_TRUTHY = ("1", "true", "yes", "on", "y")


@functools.cache
def triton_available() -> bool:
    """Whether `import triton` works (cached; the import is slow)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


def resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    """Turn `backend` into the implementation to run for tensors on `device`.

    Raises
    ------
    ConfigError
        `backend` is not one of auto / torch / triton, or triton was asked for where it
        cannot run (not installed, or CPU tensors without `TRITON_INTERPRET=1`).
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        check_triton_can_run(device)
        return "triton"
    raise ConfigError(f"unknown kernel backend {backend!r}; use 'auto', 'torch' or 'triton'",
                      option="backend")


def check_triton_can_run(device: torch.device) -> None:
    """Raise a clear `ConfigError` instead of Triton's own when a launch cannot work."""
    if not triton_available():
        raise ConfigError("backend='triton' needs Triton; install the 'triton' extra",
                          option="backend")
    if device.type == "cpu" and not triton_interpreting():
        raise ConfigError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set "
                          "before the first launch to run the kernels on the CPU",
                          option="backend")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), for launch grids (without importing triton)."""
    return -(-a // b)
