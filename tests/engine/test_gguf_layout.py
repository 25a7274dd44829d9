"""gguf_layout: one walk over a GGUF's metadata gives what gguf-py's reader gives (entries,
tensors, their views), and the metadata copy without the tokenizer's arrays gives transformers' own
config of the file -- for files with and without their tokenizer, with and without a vocabulary
size entry, and for the embedded model's file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from test_gguf_weights import finish, write_from_meta_model, write_llama  # noqa: E402

from constrained_spec.errors import ModelLoadError  # noqa: E402
from constrained_spec.model.gguf import gguf_config, read_gguf  # noqa: E402
from constrained_spec.model.gguf_layout import (  # noqa: E402
    LayoutError,
    read_layout,
    tensor_data,
    write_metadata_copy,
)

_PIECES = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz0123456789", "\u0120", "\u2581",
           "to", "tok"]
TOKENS = _PIECES + [f"tok{i}" for i in range(96 - len(_PIECES))]


def _with_tokenizer(path: Path, *, vocab_size: bool, arch: str = "llama",
                    tokenizer_model: str = "gpt2") -> Path:
    """A tiny GGUF of ``arch`` whose tokenizer is in its metadata (tokens, scores, types,
    merges, a chat template); without ``{arch}.vocab_size`` when ``vocab_size`` is False."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if vocab_size:
        w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(TOKENS)
    w.add_token_scores([float(-i) for i in range(len(TOKENS))])
    w.add_token_types([1] * len(TOKENS))
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(TOKENS), 64)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    finish(w)
    return path


@pytest.fixture(params=["tokenizer+vocab_size", "tokenizer, no vocab_size", "llama", "qwen2",
                        "gemma2"])
def gguf_file(request, tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    if request.param.startswith("tokenizer"):
        return _with_tokenizer(path, vocab_size=request.param == "tokenizer+vocab_size")
    if request.param == "llama":
        write_llama(path)
        return path
    kv = {"key_length": 32, "value_length": 32, "sliding_window": 64} if request.param == "gemma2" else {}
    write_from_meta_model(path, request.param, **kv)
    return path


def test_entries_and_tensors_equal_gguf_readers(gguf_file):
    reader = gguf.GGUFReader(gguf_file)
    layout = read_layout(gguf_file)
    header = ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"]
    assert header + list(layout.entries) == list(reader.fields)
    for key, entry in layout.entries.items():
        field = reader.fields[key]
        if entry.strings:
            assert entry.value == len(field.data)
        else:
            theirs = field.contents()
            assert entry.value == pytest.approx(theirs) if isinstance(theirs, float) else entry.value == theirs, key
    ours = tensor_data(layout)
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape.tolist() == theirs.shape.tolist()
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8)), mine.name
    assert layout.data_start == reader.data_offset


def test_the_metadata_copy_gives_transformers_config_of_the_file(gguf_file, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    theirs = load_gguf_checkpoint(str(gguf_file), return_tensors=False)["config"]
    ours, config = gguf_config(read_layout(gguf_file))
    assert ours == theirs
    assert config.vocab_size == theirs.get("vocab_size", config.vocab_size)
    copy = write_metadata_copy(read_layout(gguf_file), tmp_path / "copy.gguf")
    reader = gguf.GGUFReader(copy)  # a valid GGUF: same tensors and entries, no tokenizer arrays
    full = gguf.GGUFReader(gguf_file)
    assert [t.name for t in reader.tensors] == [t.name for t in full.tensors]
    arrays = {k for k, f in full.fields.items() if k.startswith("tokenizer.") and len(f.types) > 1
              and f.types[0] == gguf.GGUFValueType.ARRAY}
    arch = read_layout(gguf_file).architecture
    assert set(full.fields) - arrays <= set(reader.fields)
    assert set(reader.fields) - set(full.fields) <= {f"{arch}.vocab_size"}
    assert all(k not in reader.fields for k in arrays)
    assert copy.stat().st_size == gguf_file.stat().st_size - read_layout(gguf_file).data_start \
        + read_layout(copy).data_start


def test_vocab_size_comes_from_the_token_count_when_the_file_has_none(tmp_path):
    path = _with_tokenizer(tmp_path / "m.gguf", vocab_size=False)
    layout = read_layout(path)
    assert "llama.vocab_size" not in layout.entries
    config_dict, _ = gguf_config(layout)
    assert config_dict["vocab_size"] == len(TOKENS)


def test_read_gguf_never_parses_the_whole_file_with_gguf_pys_reader(gguf_file, monkeypatch):
    real = gguf.GGUFReader
    parsed: list[Path] = []

    def spy(path, *a, **k):
        parsed.append(Path(path))
        return real(path, *a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", spy)
    try:
        read_gguf(gguf_file)
    except ModelLoadError:  # a file without decoder layers (the tokenizer ones)
        pass
    # transformers' config translation parses the metadata copy, never the file itself
    assert parsed and all(p.resolve() != gguf_file.resolve() for p in parsed)


def _valid(tmp_path: Path) -> bytes:
    return _with_tokenizer(tmp_path / "ok.gguf", vocab_size=True).read_bytes()


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"GGUX" + b[4:], "magic"),
    (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "version 7"),
    (lambda b: b[:4] + struct.pack(">I", 3) + b[8:], "big-endian"),
    (lambda b: b[:200], "ends inside"),
    (lambda b: b[:16], "too short"),
])
def test_a_damaged_header_is_a_clear_error(tmp_path, damage, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(_valid(tmp_path)))
    with pytest.raises(LayoutError, match=message):
        read_layout(path)
    with pytest.raises(ModelLoadError, match="bad.gguf is not a readable GGUF file"):
        read_gguf(path)


def test_a_file_cut_inside_its_tensor_data_is_a_clear_error(tmp_path):
    data = _valid(tmp_path)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-100])
    with pytest.raises(LayoutError, match="past the end of the file"):
        tensor_data(read_layout(path))


@pytest.mark.model
def test_the_embedded_models_file_reads_the_same_both_ways():
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from constrained_spec.cache import cache_dir
    from constrained_spec.model import embedded

    cached = cache_dir() / "gguf" / Path(embedded._GGUF_MEMBER).name
    if not cached.exists():
        pytest.skip("the embedded model's GGUF is not in the cache")
    layout = read_layout(cached)
    reader = gguf.GGUFReader(cached)
    assert layout.entries["tokenizer.ggml.tokens"].value == len(reader.fields["tokenizer.ggml.tokens"].data)
    for mine, theirs in zip(tensor_data(layout), reader.tensors, strict=True):
        assert mine.name == theirs.name and mine.data.shape == theirs.data.shape
        assert mine.data.dtype == theirs.data.dtype and mine.tensor_type == theirs.tensor_type
        assert np.array_equal(mine.data[-1], theirs.data[-1]) and np.array_equal(mine.data[0], theirs.data[0])
    assert gguf_config(layout)[0] == load_gguf_checkpoint(str(cached), return_tensors=False)["config"]


@pytest.mark.parametrize("arch, tokenizer_model", [
    ("llama", "gpt2"), ("llama", "llama"), ("qwen2", "gpt2"), ("gemma2", "llama"), ("gemma3", "llama"),
    ("phi3", "llama"), ("mistral", "llama"),
])
def test_the_tokenizer_is_autotokenizers_without_its_parse_of_the_file(tmp_path, arch, tokenizer_model):
    from transformers import AutoTokenizer

    from constrained_spec.model.gguf import gguf_tokenizer

    path = _with_tokenizer(tmp_path / "m.gguf", vocab_size=True, arch=arch,
                           tokenizer_model=tokenizer_model)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = gguf_tokenizer(path, gguf_config(read_layout(path))[1])
    _same_tokenizer(ours, theirs)


def _same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.chat_template == theirs.chat_template
    for text in ("tok1 tok2 tok3", "to ktok", " tok95tok0"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def test_a_tokenizer_config_beside_the_file_leaves_the_choice_to_autotokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from constrained_spec.model import gguf as gguf_module

    path = _with_tokenizer(tmp_path / "m.gguf", vocab_size=True)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    config = gguf_config(read_layout(path))[1]
    assert gguf_module._tokenizer_class(path, config) is None
    called = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: called.append(a) or real(*a, **k))
    gguf_module.gguf_tokenizer(path, config)
    assert called


@pytest.mark.model
def test_the_embedded_models_tokenizer_is_autotokenizers():
    from transformers import AutoTokenizer

    from constrained_spec.cache import cache_dir
    from constrained_spec.model import embedded
    from constrained_spec.model.gguf import gguf_tokenizer

    cached = cache_dir() / "gguf" / Path(embedded._GGUF_MEMBER).name
    if not cached.exists():
        pytest.skip("the embedded model's GGUF is not in the cache")
    theirs = AutoTokenizer.from_pretrained(str(cached.parent), gguf_file=cached.name)
    ours = gguf_tokenizer(cached, gguf_config(read_layout(cached))[1])
    _same_tokenizer(ours, theirs)
    text = 'Extract the person: {"name": "Ada Lovelace", "age": 36} <|im_end|>'
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
