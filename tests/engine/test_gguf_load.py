"""A user's GGUF on the lean runner: converted once (cached by content hash), 4-bit tensors kept
4-bit (never a dense float32 copy), the same logits as transformers' own load of the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cs_testlib import byte_level_bpe

gguf = pytest.importorskip("gguf")
from test_gguf_weights import T, finish, llama_cpp_permute, llama_writer, quantize  # noqa: E402

from constrained_spec.cache import cache_complete  # noqa: E402
from constrained_spec.kernels import cpu_native  # noqa: E402
from constrained_spec.model import loading as models  # noqa: E402
from constrained_spec.model.gguf import read_gguf  # noqa: E402
from constrained_spec.model.loading import load_model  # noqa: E402
from constrained_spec.model.plan import KernelPlan  # noqa: E402
from constrained_spec.model.runner import LeanRunner  # noqa: E402

HIDDEN, FFN, HEADS, KV = 256, 512, 4, 2
# layer 0 all 4-bit (fused groups), layer 1 mixes in 8-bit parts (those matrices stay dense)
TYPES = [{"attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_0"},
         {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q6_K",
          "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_K"}]


def write_tiny_llama(path, *, vocab_multiple: int = 1):
    """A two-layer llama GGUF with a byte-level BPE tokenizer in its metadata (its vocabulary
    padded with unused tokens to a multiple of ``vocab_multiple``: the q8 kernel's LM head
    takes whole tiles of 16 rows)."""
    tok = byte_level_bpe()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    vocab += [(f"<unused{i}>", len(vocab) + i) for i in range(-len(vocab) % vocab_multiple)]
    rng = np.random.default_rng(0)
    w = llama_writer(path, layers=len(TYPES), context=256, hidden=HIDDEN, ffn=FFN, heads=HEADS,
                     kv_heads=KV, vocab=len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([1] * len(vocab))
    w.add_token_merges(["Ġ a", '" :', '{ "'])
    w.add_eos_token_id(0)
    w.add_bos_token_id(0)

    def add(name, shape, type_name, n_head=0):
        weight = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        stored = llama_cpp_permute(weight, n_head) if n_head else weight
        w.add_tensor(name, quantize(stored, type_name, rng), raw_dtype=T[type_name])

    add("token_embd.weight", (len(vocab), HIDDEN), "F32")
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV * HIDDEN // HEADS, HIDDEN),
              "attn_v": (KV * HIDDEN // HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for i, types in enumerate(TYPES):
        for leaf, t in types.items():
            add(f"blk.{i}.{leaf}.weight", shapes[leaf], t, {"attn_q": HEADS, "attn_k": KV}.get(leaf, 0))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    add("output.weight", (len(vocab), HIDDEN), "Q8_0")
    finish(w)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch, cs_env):
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"),
           CONSTRAINED_SPEC_PLAN="prefill=fp32,decode=int4,lm_head=fp32")
    monkeypatch.setattr(models, "_LOADED", {})
    path = tmp_path / "tiny.Q4_K_M.gguf"
    write_tiny_llama(path)
    return path


def test_gguf_runs_on_the_lean_runner_with_the_files_own_4bit_groups(tiny_gguf):
    lean = load_model(tiny_gguf, quiet=True)
    runner = lean.runner
    assert isinstance(runner, LeanRunner)
    four_bit = {(i, name) for i, L in enumerate(runner.layers)
                for name in ("qkv", "o", "gate_up", "down") if getattr(L, name).int4 is not None}
    # every fused matrix whose parts are all Q4_0 / Q4_1 / Q4_K, and no other
    assert four_bit == {(0, "qkv"), (0, "o"), (0, "gate_up"), (0, "down"), (1, "down")}
    # no dense copy of a 4-bit weight anywhere: the transformers model holds them on meta
    assert lean.model.model.layers[0].self_attn.q_proj.weight.is_meta

    full = load_model(tiny_gguf, full_model=True, dtype="float32", quiet=True)
    ids = byte_level_bpe()("Ada Lovelace, 36")["input_ids"]
    with torch.no_grad():
        want = full.model(torch.tensor([ids])).logits[0, -3:]
    slot = runner.new_slot()
    runner.forward([slot], [ids[:-3]], [0], phase="prefill")
    got = runner.forward([slot], [ids[-3:]], [3], phase="decode")
    # the same model: 4-bit weights exact (bf16 scales in the int4 kernel), the rest bf16
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_second_load_reuses_the_converted_checkpoint(tiny_gguf, monkeypatch):
    first = load_model(tiny_gguf, quiet=True)
    monkeypatch.setattr(models, "_LOADED", {})

    def no_second_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_convert_gguf", no_second_conversion)
    again = load_model(tiny_gguf, quiet=True)
    assert again.path == first.path and cache_complete(again.path)
    assert again.runner.layers[0].qkv.int4 is not None


def test_info_describes_the_plan_and_weights_of_a_gguf(tiny_gguf, capsys):
    from constrained_spec import cli

    assert cli.main(["info", "--model", str(tiny_gguf), "--json", "--quiet"]) == 0
    d = json.loads(capsys.readouterr().out)["model"]
    assert d["runner"] == "LeanRunner" and d["plan_source"] == "env"
    assert d["plan"].startswith("prefill=fp32") and d["resident_bytes"] > 0
    assert d["weights"].startswith("5 of 8 linears exact 4-bit groups")


def test_a_first_load_takes_the_flag_plan_and_measures_nothing(tiny_gguf, cs_env, monkeypatch):
    from constrained_spec.model import loading, plan
    cs_env(CONSTRAINED_SPEC_PLAN=None)
    monkeypatch.setattr(plan, "measure", lambda *a, **k: pytest.fail("measured at a first load"))
    monkeypatch.setattr(loading, "_measure_plan_apart", lambda *a, **k: pytest.fail("child started"))
    loaded = load_model(tiny_gguf, quiet=True)
    d = loaded.describe_kernels()
    assert d["plan_source"] == "flags" and d["times_ms"] == {} and d["plan_conditions"] == {}
    assert not (loaded.plan_cache / plan.PLAN_FILE).exists()


def test_an_asked_measurement_runs_in_a_child_process(tiny_gguf, cs_env, monkeypatch):
    # measuring builds dense copies of the weights for the candidates: in the serving process
    # their peak would stay in its peak RSS; a child measures and stores, the parent reads
    from constrained_spec.model import plan
    cs_env(CONSTRAINED_SPEC_PLAN="measure")
    monkeypatch.setattr(plan, "measure", lambda *a, **k: pytest.fail("measured in this process"))
    loaded = load_model(tiny_gguf, quiet=True)
    d = loaded.describe_kernels()
    # the child keeps the plan unless this machine disturbed its timings (then the flag plan)
    if (loaded.plan_cache / plan.PLAN_FILE).is_file():
        assert d["plan_source"] == "measured" and d["times_ms"] and d["plan_conditions"]["at"]
    else:
        assert d["plan_source"] == "flags"


def test_a_plan_the_child_could_not_measure_is_measured_here(tiny_gguf, cs_env, monkeypatch, caplog):
    import os
    import sys

    from constrained_spec.model import plan

    ticks = iter(range(10**9))  # a quiet machine, as the measurement here sees it
    monkeypatch.setattr(plan, "_clock", lambda: next(ticks) * 1e-3)
    monkeypatch.setattr(plan, "_load_average", lambda: 0.0)
    monkeypatch.setattr(plan, "_cpu_times", lambda: None)
    cs_env(CONSTRAINED_SPEC_PLAN="measure")
    monkeypatch.setattr(models, "plan_child_command", lambda spec, *, threads: (
        [sys.executable, "-c", "import sys; sys.exit('boom')"], dict(os.environ)))
    with caplog.at_level("WARNING"):
        d = load_model(tiny_gguf, quiet=True).describe_kernels()
    assert d["plan_source"] == "measured" and "boom" in caplog.text


def test_generate_on_a_gguf_returns_a_valid_choice(tiny_gguf):
    from constrained_spec import generate

    out = generate(str(tiny_gguf), "Is the sky blue?", schema=["yes", "no"], max_tokens=8)
    assert out in ("yes", "no")


def test_int8_is_a_plan_candidate_only_for_files_quantized_past_4_bits(tiny_gguf, tmp_path):
    from constrained_spec.model.loading import int8_worth_it

    # the tiny file mixes 4-bit groups with Q8_0 / Q6_K matrices: int8 may win their decode
    assert int8_worth_it(tiny_gguf)
    assert load_model(tiny_gguf, quiet=True).int8_plan
    assert not int8_worth_it(tmp_path / "missing.gguf")  # an unreadable file: no claim


def test_the_embedded_model_keeps_its_own_numbers_no_int8():
    from constrained_spec.model.embedded import fetch_default_gguf
    from constrained_spec.model.loading import int8_worth_it

    assert not int8_worth_it(fetch_default_gguf(quiet=True))


@pytest.mark.skipif(not cpu_native.available(), reason="the native kernels do not build here")
def test_an_untied_lm_head_run_packed_keeps_no_dense_copy(tmp_path, monkeypatch, cs_env):
    # bf16 activations: the two forwards below differ in their LM head only
    cs_env(CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"),
           CONSTRAINED_SPEC_PLAN="prefill=bf16,decode=q4,lm_head=q8", CONSTRAINED_SPEC_ACTIVATIONS="bf16")
    monkeypatch.setattr(models, "_LOADED", {})
    tiny_gguf = tmp_path / "tiny.Q4_K_M.gguf"
    write_tiny_llama(tiny_gguf, vocab_multiple=16)
    lean = load_model(tiny_gguf, quiet=True)
    runner = lean.runner
    assert runner._kernel(runner.lm_head_weight, "q8") == "q8"
    # the file's Q8_0 values live in the q8 pack only: no bf16 copy in the runner or the model
    assert runner.lm_head_weight.dense is None and lean.model.lm_head.weight.is_meta
    head = read_gguf(tiny_gguf).tensors["lm_head.weight"].dequantize(torch.float32)
    assert torch.equal(runner.lm_head.float(), head.bfloat16().float())  # rebuilt from the pack
    ids = byte_level_bpe()("Ada Lovelace, 36")["input_ids"]
    slot = runner.new_slot()
    runner.forward([slot], [ids[:-3]], [0], phase="prefill")
    got = runner.forward([slot], [ids[-3:]], [3], phase="decode")
    runner.set_plan(KernelPlan.parse("prefill=bf16,decode=q4,lm_head=bf16"))  # dense again, from the pack
    runner.forward([slot], [ids[:-3]], [0], phase="prefill")
    dense = runner.forward([slot], [ids[-3:]], [3], phase="decode")
    assert (got - dense).abs().max() <= 0.01 * dense.abs().max()
