"""Where things are in a GGUF file, read in milliseconds: its metadata entries, its tensor table
and where the tensor data starts -- and a copy of the metadata without the tokenizer's arrays.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every metadata value: for a
262,144-token vocabulary (Gemma 3) that is millions of views and 11-12 s of Python on a 2-core
machine, and ``transformers`` parses the file with it again for the config
(``load_gguf_checkpoint``) and once more for the tokenizer's config. This module walks the
same bytes with ``struct`` and keeps only offsets (the layout is the GGUF specification's:
little-endian, versions 2 and 3). transformers 5.25's own fast reader (``GgufHeader``) gives
the tensor table but not the entries' byte spans the copy below needs, and older releases (the
vLLM environment's) do not have it:

- `read_layout` -- every metadata entry (its key, type, byte span and, but for arrays of
  strings, its value), every tensor's name, dimensions, GGML type and offset, the alignment and
  the start of the data section;
- `tensor_data` -- each tensor's bytes as the numpy view ``GGUFReader`` would give (same dtype,
  same shape), over one memory map of the file;
- `write_metadata_copy` -- the file with the tokenizer's arrays left out (``tokenizer.*``
  arrays: the vocabulary, its scores and token types, the merges; gguf-py's reader walks them
  element by element) and the data section as a hole (a sparse file: nothing is written
  there), for ``transformers``' config translation, which reads no tokenizer array into the
  config: it then reads the same entries it would read from the file itself, in a fraction of
  the time. Where the file leaves the vocabulary size to the
  length of its token list (transformers then counts the tokens), the copy says the size as
  ``{arch}.vocab_size``, so the translation gives the same number.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# metadata value types (GGUF specification): the fixed-size ones by struct format
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_VERSIONS = (2, 3)
_TOKENIZER = "tokenizer."
_DEFAULT_ALIGNMENT = 32
# tensors of these GGML types are stored as values (gguf-py gives typed views); every other type
# is blocks of bytes
_VALUE_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                27: np.int64, 28: np.float64}


class LayoutError(ValueError):
    """The file is not a GGUF this module reads (magic, version, byte order, a truncated
    table)."""


@dataclass(frozen=True)
class Entry:
    """One metadata entry: ``value`` is the decoded value, except for an array of strings,
    whose ``value`` is its length (``strings`` True)."""

    key: str
    vtype: int
    start: int  # the entry's first byte (its key's length)
    end: int
    value: Any
    strings: bool = False


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # GGML order: fastest-moving first
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class Layout:
    path: Path
    version: int
    entries: dict[str, Entry]
    tensors: tuple[TensorEntry, ...]
    table: tuple[int, int]  # byte span of the tensor table
    alignment: int
    data_start: int
    size: int  # the file's size

    @property
    def architecture(self) -> str:
        entry = self.entries.get("general.architecture")
        if entry is None or not isinstance(entry.value, str):
            raise LayoutError(f"{self.path.name} has no general.architecture entry")
        return entry.value


class _Cursor:
    def __init__(self, buf: Any, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def many(self, fmt: str, count: int) -> tuple[Any, ...]:
        """``count`` values of the one-letter struct format ``fmt``, little-endian."""
        width = struct.calcsize(f"<{fmt}") * count
        if self.pos + width > self.size:
            raise LayoutError("the file ends inside its metadata")
        values = struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)
        self.pos += width
        return values

    def take(self, fmt: str) -> Any:
        """One value of the struct format ``fmt`` (``"<Q"``)."""
        return self.many(fmt.removeprefix("<"), 1)[0]

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > self.size:
            raise LayoutError("the file ends inside a string of its metadata")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self.take("<Q")
            self.pos += n
        if self.pos > self.size:
            raise LayoutError("the file ends inside an array of strings")

    def value(self, vtype: int) -> tuple[Any, bool]:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype]), False
        if vtype == _STRING:
            return self.string(), False
        if vtype != _ARRAY:
            raise LayoutError(f"metadata value of unknown type {vtype}")
        item, count = self.take("<I"), self.take("<Q")
        if item == _STRING:
            self.skip_strings(count)
            return count, True
        if item in _SCALAR:
            fmt = _SCALAR[item]
            width = struct.calcsize(fmt)
            if self.pos + width * count > self.size:
                raise LayoutError("the file ends inside an array of its metadata")
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
            self.pos += width * count
            return values.tolist(), False
        if item == _ARRAY:
            return [self.value(_ARRAY)[0] for _ in range(count)], False
        raise LayoutError(f"metadata array of unknown item type {item}")


def read_layout(path: str | Path) -> Layout:
    """The metadata entries and tensor table of ``path`` (see the module docstring); raises
    `LayoutError` for a file that is not a little-endian GGUF of version 2 or 3."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise LayoutError(f"{path.name} is too short to be a GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, size)


def _parse(path: Path, buf: Any, size: int) -> Layout:
    c = _Cursor(buf, size)
    if bytes(buf[:4]) != b"GGUF":
        raise LayoutError(f"{path.name} does not start with GGUF's magic bytes")
    c.pos = 4
    version = c.take("<I")
    if version not in _VERSIONS:
        byte_swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        order = " (a big-endian file)" if byte_swapped in _VERSIONS else ""
        raise LayoutError(f"{path.name}: GGUF version {version}{order}; little-endian versions "
                          f"{_VERSIONS} are read")
    n_tensors, n_entries = c.take("<Q"), c.take("<Q")
    entries: dict[str, Entry] = {}
    for _ in range(n_entries):
        start = c.pos
        key = c.string()
        vtype = c.take("<I")
        value, strings = c.value(vtype)
        entries[key] = Entry(key, vtype, start, c.pos, value, strings)
    table_start = c.pos
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        dims = tuple(int(d) for d in c.many("Q", n_dims))
        ggml_type, offset = c.take("<I"), c.take("<Q")
        tensors.append(TensorEntry(name, dims, ggml_type, offset))
    align_entry = entries.get("general.alignment")
    alignment = int(align_entry.value) if align_entry is not None else _DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise LayoutError(f"{path.name}: general.alignment {alignment} is not a power of two")
    data_start = -(-c.pos // alignment) * alignment
    return Layout(path, version, entries, tuple(tensors), (table_start, c.pos), alignment,
                  data_start, size)


@dataclass(frozen=True)
class FileTensor:
    """A tensor of the file as ``GGUFReader`` describes it: ``shape`` in GGML order,
    ``tensor_type`` gguf-py's `GGMLQuantizationType`, ``data`` its bytes or values as gguf-py's
    view (rows first; quantized types as uint8 ``[..., bytes per row]``)."""

    name: str
    tensor_type: Any
    shape: np.ndarray
    data: np.ndarray


def tensor_data(layout: Layout) -> list[FileTensor]:
    """Every tensor of ``layout`` over one read-only memory map of its file (nothing is read
    until a view is used). Raises `LayoutError` for a tensor past the end of the file or of a
    type gguf-py does not know."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    blob = np.memmap(layout.path, mode="r", dtype=np.uint8)
    out = []
    for t in layout.tensors:
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
        except ValueError as e:
            raise LayoutError(f"tensor {t.name!r} has unknown GGML type {t.ggml_type}") from e
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(t.dims))
        np_dims: tuple[int, ...] = tuple(reversed(t.dims))
        start = layout.data_start + t.offset
        if t.ggml_type in _VALUE_TYPES:
            dtype = np.dtype(_VALUE_TYPES[t.ggml_type])
            n_bytes = n_elems * dtype.itemsize
        else:
            dtype = np.dtype(np.uint8)
            n_bytes = n_elems * type_size // block
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        if start + n_bytes > layout.size:
            raise LayoutError(f"tensor {t.name!r} runs past the end of the file (truncated?)")
        data = blob[start:start + n_bytes].view(dtype).reshape(np_dims)
        out.append(FileTensor(t.name, qtype, np.array(t.dims, dtype=np.uint64), data))
    return out


def write_metadata_copy(layout: Layout, dest: str | Path) -> Path:
    """``dest``: ``layout``'s file without its tokenizer arrays and with its data section as a
    hole of the same size (module docstring). Every other entry and the tensor table are the
    file's own bytes."""
    dest = Path(dest)
    arch = layout.architecture
    with open(layout.path, "rb") as f:
        kept = [e for e in layout.entries.values()
                if not (e.vtype == _ARRAY and e.key.startswith(_TOKENIZER))]
        parts = []
        for e in kept:
            f.seek(e.start)
            parts.append(f.read(e.end - e.start))
        tokens = layout.entries.get("tokenizer.ggml.tokens")
        if tokens is not None and tokens.strings and f"{arch}.vocab_size" not in layout.entries:
            parts.append(_entry_bytes(f"{arch}.vocab_size", _UINT32, struct.pack("<I", tokens.value)))
        f.seek(layout.table[0])
        table = f.read(layout.table[1] - layout.table[0])
    head = b"GGUF" + struct.pack("<IQQ", layout.version, len(layout.tensors), len(parts))
    body = head + b"".join(parts) + table
    data_start = -(-len(body) // layout.alignment) * layout.alignment
    with open(dest, "wb") as out:
        out.write(body + b"\0" * (data_start - len(body)))
        out.truncate(data_start + layout.size - layout.data_start)
    return dest


def _entry_bytes(key: str, vtype: int, value: bytes) -> bytes:
    raw = key.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype) + value
