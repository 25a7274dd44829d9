"""A user's GGUF file, tensor by tensor, in the forms the packed kernels want.

``transformers`` loads a GGUF by dequantizing every tensor to float32 (about 3.6x the peak
memory of llama.cpp on the same file), and only a Q4_1 file reaches a packed kernel afterwards
(``runner.exact_4bit_groups`` finds the exact 4-bit groups again in the float weights). Here the
file is memory-mapped (its layout read by `gguf_layout`: one walk over the metadata, where
gguf-py's ``GGUFReader`` takes seconds for a large vocabulary) and each tensor is unpacked only
when asked for, straight from its blocks. What each GGML type unpacks to is its row of `quant.TYPES`:

- `QuantTensor.dequantize` -- the file's own dequantization (gguf-py's ``dequantize``, the one
  ``transformers`` runs), equal to ``transformers``' load of the same file;
- `QuantTensor.int4_groups` -- ``w = scale * q + min`` per group of the type's inputs, read
  from the blocks without a float round trip, for the types whose groups are ``"int4"``
  (None for other types);
- `QuantTensor.q8_groups` -- ``w = scale * q (+ min)`` per group, ``q`` int8, for the types
  whose groups are ``"int8"`` (exact; the LM head of most files and the 5-bit matrices of
  Q4_K_M mixes: the ``q8`` kernel runs them);
- `QuantTensor.int8_rows` -- symmetric per-row int8 (torch's ``_weight_int8pack_mm`` layout),
  for any type, re-quantized from the dequantized rows.

None of them holds a dense float32 copy of more than one tensor; ``int8_rows`` and
``dequantize`` work through the rows in chunks of about 4 MB of float32.

Everything model-specific is ``transformers``' own, so the result equals its GGUF loading:
the config (``load_gguf_checkpoint(..., return_tensors=False)``, on a copy of the metadata
without the tokenizer's arrays: `gguf_config`), the tokenizer (the class AutoTokenizer picks:
`gguf_tokenizer`), the tensor names (its
``get_gguf_hf_weights_map`` over the model's state-dict keys, built on the meta device, which
uses gguf-py's ``TensorNameMap``) and the per-architecture fix-ups (its ``TENSOR_PROCESSORS``).
A fix-up that only reorders rows -- the q/k un-permutation of llama-arch files, which
llama.cpp's converter permutes for its RoPE layout -- is found by running the processor on a
column of row indices; it is applied to the raw block rows (a block never spans two rows), so
``int4_groups`` and ``int8_rows`` see the same rows as ``dequantize``. A fix-up that changes
values (gemma2/3 and nemotron norms stored as ``w + 1``, mamba's ``A``) is applied by the
processor itself to the dequantized tensor; such a tensor has no ``int4_groups``. Architectures
whose processor merges, splits or transposes tensors (MoE experts, gpt2, t5) and those
``transformers`` loads through its own packed path (qwen3.5, lfm2) raise `ModelLoadError`.

Why the groups are exact: `quant`'s docstring.

Relative error of ``int8_rows`` against ``dequantize()`` (Frobenius norm of the difference
over that of the weight; every element is within half a step, ``scale / 2``, by
construction), measured on Gaussian weights [256 x 1024] quantized to each type by the tests'
writer, and on the embedded model's tensors:

| type | int8 rows | the type's own error |
| --- | --- | --- |
| F32  | 0.80% | 0 |
| F16  | 0.80% | 0.02% |
| BF16 | 0.80% | 0.17% |
| Q8_0 | 0.78% | 0.54% |
| Q6_K | 0.78% | 1.9% |
| Q5_K | 0.80% | 3.8% |
| Q5_1 | 0.80% | 3.8% |
| Q5_0 | 0.77% | 4.3% |
| Q4_K | 0.80% | 7.9% |
| Q4_1 | 0.79% | 7.8% |
| Q4_0 | 0.75% | 8.6% |
| Q3_K | 0.83% | (random blocks) |
| Q2_K | 0.86% | (random blocks) |
| embedded model, Q4_1 linears | 0.85% | |
| embedded model, Q8_0 embeddings | 1.17% | |

(The K-quant files come from a plain round-to-nearest writer, not llama.cpp's quantizer, so
their own error is an upper bound of what llama.cpp gets; the int8 error hardly depends on the
type: it is the int8 grid's.)

What a load costs (time, peak memory, against transformers' own GGUF load):
benchmarks/RESULTS.md, "GGUF loading (embedded model)" (``benchmarks/gguf_load.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from constrained_spec.errors import ModelLoadError
from constrained_spec.model.gguf_layout import Layout, LayoutError, read_layout, tensor_data, write_metadata_copy
from constrained_spec.model.quant import TYPES, GroupKind

logger = logging.getLogger(__name__)

# Types this reader unpacks (gguf-py dequantizes them), and those with exact 4-bit and 8-bit
# groups: all read off the one table, `quant.TYPES`.
SUPPORTED_TYPES: tuple[str, ...] = tuple(TYPES)
INT4_TYPES: tuple[str, ...] = tuple(n for n, t in TYPES.items() if t.groups == "int4")
INT8_TYPES: tuple[str, ...] = tuple(n for n, t in TYPES.items() if t.groups == "int8")
# Rows are unpacked in chunks of about this many elements (4 MB of float32).
_CHUNK_ELEMENTS = 1 << 20


@dataclass(eq=False)
class QuantTensor:
    """One tensor of a GGUF file, still in its blocks (a view of the memory-mapped file).

    ``shape`` is the transformers parameter's shape (rows first: ``[out_features,
    in_features]`` for a linear); ``ggml_type`` the GGML type name (``"Q4_K"``, ``"F16"``...).
    """

    name: str
    gguf_name: str
    shape: tuple[int, ...]
    ggml_type: str
    _data: np.ndarray = field(repr=False)
    _qtype: Any = field(repr=False)
    # HF row r is the file's row _row_perm[r] (llama q/k un-permutation), None: same order
    _row_perm: np.ndarray | None = field(default=None, repr=False)
    # transformers' processor, for fix-ups that change values (applied to the dense tensor)
    _fixup: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    @property
    def rows_permuted(self) -> bool:
        """Whether the file stores the rows in another order (llama-arch q / k projections)."""
        return self._row_perm is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor as gguf-py dequantizes it (float32), fixed up like ``transformers``
        does, then cast to ``dtype``; only one chunk of rows is float32 at a time."""
        if self._fixup is not None:
            # value fix-ups are norms and small SSM tensors: whole, exactly as transformers
            w = self._fixup(self._dense_all())
            return torch.from_numpy(np.copy(w)).to(dtype)
        out = torch.empty(self.shape, dtype=dtype)
        for start, stop in self._chunks():
            out[start:stop] = torch.from_numpy(self._dense(start, stop))
        return out

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Exact 4-bit groups: ``(q, scale, min)`` with ``w = scale * q + min`` per group of
        ``G`` inputs (the type's `quant.QuantType.group`).

        ``q``: uint8 [N, K], values 0..15; ``scale``, ``min``: float32 [N, K / G]. Read from
        the blocks, no float round trip (the type's `quant.QuantType.unpack`). None for a type
        whose groups are not ``"int4"``, for a tensor that is not 2-D and for one whose fix-up
        changes values.
        """
        found = self._groups("int4")
        if found is None:
            return None
        q, scale, mn = found
        assert mn is not None  # 4-bit groups always carry a min (Q4_0's is -8 d)
        return q, scale, mn

    def q8_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Exact 8-bit groups: ``(q int8 [N, K], scale, min)`` (float32 [N, K / G]; min None
        for a type that stores none) with ``w = scale * q (+ min)`` per group of ``G`` inputs
        (the type's `quant.QuantType.group`), read from the blocks (their float16 ``d`` and
        ``m``: exact). None for a type whose groups are not ``"int8"``, a tensor that is not
        2-D and one whose fix-up changes values."""
        return self._groups("int8")

    def _groups(self, kind: GroupKind) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The ``kind`` groups of this tensor, unpacked chunk by chunk (see `int4_groups`)."""
        t = TYPES[self.ggml_type]
        if t.groups != kind or t.unpack is None or t.group is None or self._fixup is not None \
                or len(self.shape) != 2:
            return None
        N, K = self.shape
        q = np.empty((N, K), dtype=np.uint8 if kind == "int4" else np.int8)
        scale = np.empty((N, K // t.group), dtype=np.float32)
        mn = np.empty_like(scale) if kind == "int4" or t.has_min else None
        for start, stop in self._chunks():
            bq, bs, bm = t.unpack(self._raw_rows(start, stop).reshape(-1, t.block_bytes))
            q[start:stop] = bq.reshape(stop - start, K)
            scale[start:stop] = bs.reshape(stop - start, -1)
            if mn is not None and bm is not None:
                mn[start:stop] = bm.reshape(stop - start, -1)
        return torch.from_numpy(q), torch.from_numpy(scale), None if mn is None else torch.from_numpy(mn)

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Symmetric per-row int8: ``(q int8 [N, K], scale float32 [N])``, ``w ~ q * scale``.

        Re-quantized from the dequantized rows the way `weights.int8_pack` does (round to
        nearest, ``scale = max|row| / 127``), for any type; None for a tensor that is not 2-D.
        The error per type is in the module docstring.
        """
        if len(self.shape) != 2:
            return None
        N, K = self.shape
        q = torch.empty((N, K), dtype=torch.int8)
        scale = torch.empty(N, dtype=torch.float32)
        if self._fixup is not None:
            parts: Iterator[tuple[int, int, torch.Tensor]] = iter([(0, N, self.dequantize())])
        else:
            parts = ((a, b, torch.from_numpy(self._dense(a, b))) for a, b in self._chunks())
        for start, stop, w in parts:
            s = w.abs().amax(dim=1).clamp_min_(1e-12).div_(127)
            q[start:stop] = w.div(s[:, None]).round_().clamp_(-127, 127)
            scale[start:stop] = s
        return q, scale

    # -- rows of the file -------------------------------------------------------------------

    def _chunks(self) -> Iterator[tuple[int, int]]:
        n = self.shape[0]
        if len(self.shape) == 1:
            yield 0, n  # a 1-D quantized tensor's rows are not its elements
            return
        step = max(1, _CHUNK_ELEMENTS // max(1, int(np.prod(self.shape[1:]))))
        for start in range(0, n, step):
            yield start, min(n, start + step)

    def _raw_rows(self, start: int, stop: int) -> np.ndarray:
        if self._row_perm is None:
            return self._data[start:stop]
        return self._data[self._row_perm[start:stop]]

    def _dense(self, start: int, stop: int) -> np.ndarray:
        return self._dequantize_raw(self._raw_rows(start, stop))

    def _dense_all(self) -> np.ndarray:
        return self._dequantize_raw(self._data)

    def _dequantize_raw(self, raw: np.ndarray) -> np.ndarray:
        from gguf import dequantize

        w = dequantize(raw, self._qtype)
        # F32 comes back as a read-only view of the mapped file
        return w if w.flags.writeable else np.array(w, dtype=np.float32)


@dataclass(eq=False)
class GGUFModel:
    """A GGUF file read by `read_gguf`: its architecture, the ``transformers`` config and every
    tensor ``transformers`` would load, keyed by its parameter name
    (``model.layers.0.self_attn.q_proj.weight``, ``model.embed_tokens.weight``,
    ``lm_head.weight`` when the embeddings are untied)."""

    path: Path
    arch: str
    config: Any
    tensors: dict[str, QuantTensor]
    # file tensors transformers does not load either (e.g. llama3's rope_freqs)
    skipped: tuple[str, ...] = ()


# -- reading a file -------------------------------------------------------------------------------

def read_gguf(path: str | Path) -> GGUFModel:
    """Read ``path``'s metadata and index its tensors by ``transformers`` parameter name; the
    tensor data stays in the file (memory-mapped) until a `QuantTensor` method unpacks it.

    Raises `ModelLoadError` for a missing or malformed file, an architecture ``transformers``
    cannot load from GGUF (or loads through its own packed path), and a tensor of a type this
    reader does not unpack (`SUPPORTED_TYPES`: the types of `quant.TYPES`).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
        )
    except ImportError as e:  # an old transformers without the GGUF tensor processors
        raise ModelLoadError(f"reading GGUF weights needs gguf and a transformers with GGUF "
                             f"tensor processors: {e}") from e

    # one walk over the file's metadata and tensor table (gguf_layout: milliseconds where
    # gguf-py's reader takes seconds per parse of a large vocabulary)
    try:
        layout = read_layout(path)
        arch = layout.architecture
        file_tensors = tensor_data(layout)
    except (LayoutError, OSError) as e:  # strings decode with replacement, never raise
        raise ModelLoadError(f"{path.name} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    config_dict, config = gguf_config(layout)
    _check_legacy_path(arch, path)
    processor_cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if processor_cls not in _per_tensor_processors():
        raise ModelLoadError(
            f"{path.name}: architecture {arch!r} has tensors that transformers merges, splits or "
            f"transposes while loading ({processor_cls.__name__}); this reader maps tensors one to "
            f"one. Load the file with transformers (from_pretrained(..., gguf_file=...)).")
    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{path.name}: transformers has no causal LM for architecture "
                             f"{arch!r}: {type(e).__name__}: {e}") from e
    processor = processor_cls(config=config_dict)
    names = _hf_names(meta, processor, {t.name for t in file_tensors})

    tensors: dict[str, QuantTensor] = {}
    skipped = []
    for t in file_tensors:
        hf_name = names.get(t.name)
        if hf_name is None:
            skipped.append(t.name)
            continue
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path.name}: tensor {t.name!r} ({hf_name}) is stored as {type_name}, which this "
                f"reader does not unpack (supported: {', '.join(SUPPORTED_TYPES)}). Re-quantize "
                f"the file to one of those types (llama.cpp's llama-quantize).")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        row_perm, fixup = _fixups(processor, t.name, shape, typed=t.data.shape == shape)
        if fixup is not None:
            with np.errstate(all="ignore"):
                shape = tuple(fixup(np.zeros(shape, dtype=np.float32)).shape)
        tensors[hf_name] = QuantTensor(hf_name, t.name, shape, type_name, t.data, t.tensor_type,
                                       row_perm, fixup)
    if skipped:
        logger.info("%s: tensors transformers does not load either: %s", path.name, skipped)
    # the tensors are views of one memory map of the file, which they keep open
    return GGUFModel(path, arch, config, tensors, tuple(skipped))


def gguf_config(layout: Layout) -> tuple[dict[str, Any], Any]:
    """``transformers``' config of the file: its own translation (``load_gguf_checkpoint``) of
    a copy of the metadata without the tokenizer's arrays (`gguf_layout.write_metadata_copy`:
    the same entries, the same config, without parsing the vocabulary), as its dict and as a
    config object. Raises `ModelLoadError` when transformers cannot translate it."""
    import tempfile

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = layout.path
    try:
        with tempfile.TemporaryDirectory(prefix="cs-gguf-meta-") as tmp:
            copy = write_metadata_copy(layout, Path(tmp) / path.name)
            config_dict = load_gguf_checkpoint(str(copy), return_tensors=False)["config"]
        config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(dict(config_dict))
    except Exception as e:  # an architecture transformers lacks, a malformed entry
        raise ModelLoadError(f"{path.name}: could not read its config (transformers' GGUF "
                             f"metadata translation): {type(e).__name__}: {e}") from e
    return config_dict, config


def gguf_tokenizer(path: Path, config: Any) -> Any:
    """``transformers``' tokenizer of the GGUF file ``path`` (``config``: its `gguf_config`):
    the class ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` picks, built from the
    file by that class, without AutoTokenizer's own parse of the whole file for the config
    (``load_gguf_checkpoint``: 13 s for a 262k-token vocabulary). Where the class is not
    certain (`_tokenizer_class`), AutoTokenizer itself."""
    from transformers import AutoTokenizer

    cls = _tokenizer_class(path, config)
    if cls is None:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return cls.from_pretrained(str(path.parent), gguf_file=path.name)


def _tokenizer_class(path: Path, config: Any) -> Any:
    """The class AutoTokenizer picks for a GGUF whose folder holds no ``tokenizer_config.json``
    and whose config names no ``tokenizer_class``: the one registered for the config's class
    (``TOKENIZER_MAPPING``), ``TokenizersBackend`` where none is (transformers 5's rule; the
    tests compare it with AutoTokenizer on each family's files). None where AutoTokenizer may
    decide otherwise: a ``tokenizer_config.json`` beside the file, a config naming a class,
    a Mistral backend, a transformers without its GGUF tokenizer reader."""
    try:
        from transformers.integrations.gguf import get_gguf_tokenizer  # noqa: F401
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if (path.parent / "tokenizer_config.json").exists() or getattr(config, "tokenizer_class", None):
        return None
    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if not isinstance(cls, type) or cls.__name__ == "MistralCommonBackend":
        return None
    return cls


def _check_legacy_path(arch: str, path: Path) -> None:
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:  # transformers without the packed GGUF path: everything is legacy
        return
    if is_gguf_arch_supported(arch):
        raise ModelLoadError(
            f"{path.name}: transformers loads {arch!r} GGUF files through its own packed path "
            f"(with its own weight conversions), which this reader does not follow. Load the file "
            f"with transformers (from_pretrained(..., gguf_file=...)).")


def _per_tensor_processors() -> tuple[type, ...]:
    """``transformers``' processors that turn one GGUF tensor into one parameter, with no side
    effects: identity, the llama q/k un-permutation, norm offsets, mamba's reshapes."""
    from transformers import modeling_gguf_pytorch_utils as m

    names = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor",
             "NemotronTensorProcessor", "MambaTensorProcessor")
    return tuple(getattr(m, n) for n in names if hasattr(m, n))


def _hf_names(meta_model: Any, processor: Any, file_names: set[str]) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, by ``get_gguf_hf_weights_map``."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    # The full map recurses into every submodule and builds gguf-py's TensorNameMap once per
    # module (~400 times for a 30-layer model: seconds). The submodule maps only add names the
    # top-level map lacks, so the top level alone gives the same answer whenever it covers
    # every tensor the file has; only when it does not is the full map built.
    names = get_gguf_hf_weights_map(_TopLevel(meta_model), processor)
    if file_names - names.keys():
        names = get_gguf_hf_weights_map(meta_model, processor)
    return names


class _TopLevel:
    """A model seen without its submodules, for `get_gguf_hf_weights_map`."""

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self._state_dict = model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return self._state_dict

    def named_children(self) -> list[tuple[str, Any]]:
        return []


def _fixups(processor: Any, gguf_name: str, shape: tuple[int, ...], *, typed: bool
            ) -> tuple[np.ndarray | None, Callable[[np.ndarray], np.ndarray] | None]:
    """``(row_perm, None)`` when ``transformers``' processor only reorders this tensor's rows
    (None: it leaves them as they are), ``(None, fixup)`` when it changes values or shape.

    Found by running the processor on a column of row indices: a row permutation comes back
    as a permutation of the indices, anything else (an offset, a log, a reshape) does not.
    ``typed``: the file stores elements, not blocks, so a 1-D tensor's rows are its elements.
    """
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    if type(processor) is TensorProcessor:
        return None, None
    index = np.arange(shape[0], dtype=np.float64).reshape(shape[0], *([1] * (len(shape) - 1)))
    try:
        with np.errstate(all="ignore"):
            out = np.asarray(processor.process(weights=index, name=gguf_name).weights)
    except Exception:  # a processor that needs the real shape: let it see the real tensor
        out = None
    if (out is not None and out.shape == index.shape
            and np.array_equal(np.sort(out.ravel()), index.ravel())):
        perm = out.ravel().astype(np.int64)
        if np.array_equal(perm, index.ravel().astype(np.int64)):
            return None, None
        if len(shape) >= 2 or typed:
            return perm, None

    def fixup(w: np.ndarray) -> np.ndarray:
        return processor.process(weights=w, name=gguf_name).weights

    return None, fixup
