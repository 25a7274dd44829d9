"""The per-tensor mappings of a safetensors file (`model.mapped`)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from constrained_spec.model.mapped import map_tensors


def _mappings_of(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(str(path) in line for line in f)


def test_mapped_tensors_equal_the_files_tensors(tmp_path):
    path = tmp_path / "w.safetensors"
    gen = torch.Generator().manual_seed(0)
    want = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).bfloat16(),
            "c": torch.randint(-128, 127, (4, 9), dtype=torch.int8, generator=gen),
            "d": torch.randint(0, 255, (11,), dtype=torch.uint8, generator=gen),
            "empty": torch.zeros(0, 4)}
    save_file(want, str(path))
    got = map_tensors(path)
    assert set(got) == set(want) == set(load_file(str(path)))
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    got["a"].add_(1)  # private mappings: the file does not change
    assert torch.equal(map_tensors(path, {"a"})["a"], want["a"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_dropped_tensor_is_unmapped(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(1 << 16), "y": torch.ones(1 << 16)}, str(path))
    got = map_tensors(path)
    assert _mappings_of(path) == 2  # one mapping per tensor, the file itself closed
    del got["x"]
    gc.collect()
    assert _mappings_of(path) == 1
    assert got["y"].sum() == 1 << 16
    del got
    gc.collect()
    assert _mappings_of(path) == 0
