"""The tensors of a safetensors file, each on a memory mapping of its own.

A converted folder's weights are read this way (`loading._open_lean`) because of what a load
does with them: most are packed into the kernels' layouts and then let go, the rest are used
as stored. Read into the process's own memory, every byte would be copied once more and the
packed ones would leave holes in the heap; mapped as ONE file (safetensors' own ``mmap``), every
page a pack reads stays resident for as long as any tensor of the file lives. One mapping per
tensor gives neither: a tensor used as stored costs its pages once (the page cache's), a packed
one's pages go back when it is dropped (the last reference unmaps it), and a tensor nobody asks
for is never read.

The mappings are private (copy-on-write): writing into a tensor changes this process's pages,
never the file.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

# safetensors' dtype names -> torch's
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """``(entries, data_start)``: the file's tensor entries by name (dtype, shape, data_offsets
    relative to ``data_start``), metadata left out."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def map_tensors(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` (those in ``names`` when given), each a view
    of a private mapping of its own bytes (see the module docstring)."""
    entries, start = read_header(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        for name, entry in entries.items():
            if names is None or name in names:
                begin, end = entry["data_offsets"]
                out[name] = _mapped(f.fileno(), start + begin, end - begin,
                                    DTYPES[entry["dtype"]], entry["shape"])
    return out


def _mapped(fd: int, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``nbytes`` at ``offset`` of the open file ``fd`` as a tensor on a mapping of its own (a
    copy when it is empty or its offset is not a multiple of its element size)."""
    item = torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or offset % item:
        with open(fd, "rb", closefd=False) as f:
            f.seek(offset)
            raw = bytearray(f.read(nbytes))
        flat = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        return flat.clone().view(shape)
    lead = offset % mmap.ALLOCATIONGRANULARITY
    view = mmap.mmap(fd, lead + nbytes, offset=offset - lead, access=mmap.ACCESS_COPY)
    # the tensor holds the mapping (a buffer export): it is unmapped with the tensor's storage
    return torch.frombuffer(view, dtype=dtype, count=nbytes // item, offset=lead).view(shape)
