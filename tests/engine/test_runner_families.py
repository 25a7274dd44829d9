"""The lean runner on every decoder family it covers, against transformers' own forward.

For each family (every row of `families.FAMILIES` has at least one tiny config here: a test
checks it) a tiny random model (hidden 64, 3 layers, 4 query / 2 kv heads, vocabulary
100, a sliding window of 5 where the family has one, rope scaling where asked, soft-capping
for gemma2) in float32:

- logits equal transformers' within 1e-4 for a full prefill, incremental appends (one and
  several tokens), a batch of ragged slots with non-contiguous slot ids, and after
  ``truncate`` and re-append;
- the kept features equal transformers' ``output_hidden_states`` at the layers drafters read;
- greedy output through the public API is the same with an MTP head drafting and without;
- a config switch the lean runner does not implement falls back to ``HFRunner``, and a
  feature drafter on that runner is a ConfigError, not an AttributeError.

Weights are redrawn (norm weights and biases too, which transformers initialises to constants)
so that every switch changes the logits.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from cs_testlib import byte_level_bpe

from constrained_spec import ConfigError, Generator, SpeculativeConfig
from constrained_spec.drafters.heads import DraftHead, HeadConfig
from constrained_spec.model.families import FAMILIES as FAMILY_TABLE
from constrained_spec.model.families import Family
from constrained_spec.model.runner import HFRunner, LeanRunner, lean_runner_supports, make_runner

CPU = torch.device("cpu")
V = 100
WINDOW = 5
COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# phi3: longrope picks the long factors once a sequence is past 8 positions
PHI3_ORIGINAL = 8
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
            "original_max_position_embeddings": PHI3_ORIGINAL}


def _config(name: str, vocab: int):
    import transformers as tf

    c = dict(COMMON, vocab_size=vocab)
    if name == "llama3":  # biases on every linear too (attention_bias, mlp_bias)
        return tf.LlamaConfig(**c, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3)
    if name == "llama-linear":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    if name == "llama-dynamic":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    if name == "llama-yarn":
        return tf.LlamaConfig(**c, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 32})
    if name == "mistral":
        return tf.MistralConfig(**c, sliding_window=WINDOW)
    if name == "qwen2":  # q/k/v biases; layers from max_window_layers on slide
        c.pop("head_dim")
        return tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if name == "qwen3":
        return tf.Qwen3Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if name == "gemma2":  # layers alternate sliding / global
        return tf.Gemma2Config(**c, query_pre_attn_scalar=24, sliding_window=WINDOW,
                               attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    if name == "gemma3":  # a separate (local) RoPE base on sliding layers, linear scaling on global ones
        return tf.Gemma3TextConfig(
            **c, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=5.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0}})
    if name == "phi3":  # fused qkv / gate_up, longrope, partial rotary, a window on every layer
        c.pop("head_dim")
        return tf.Phi3Config(**dict(c, max_position_embeddings=64), sliding_window=WINDOW + 1,
                             original_max_position_embeddings=PHI3_ORIGINAL, rope_parameters=dict(LONGROPE))
    raise KeyError(name)


FAMILIES = ["llama3", "llama-linear", "llama-dynamic", "llama-yarn", "mistral", "qwen2", "qwen3",
            "gemma2", "gemma3", "phi3"]


def tiny_of_family(model_type: str) -> str:
    """The first tiny config of ``FAMILIES`` whose model is of ``model_type`` (a row of
    `families.FAMILIES`): every row needs one, so that every test here runs it."""
    for name in FAMILIES:
        if _config(name, V).model_type == model_type:
            return name
    raise KeyError(f"no tiny model of family {model_type!r}: add its config to _config and "
                   "its name to FAMILIES in tests/engine/test_runner_families.py")


def test_every_row_of_the_family_table_has_a_tiny_model():
    """A row of `families.FAMILIES` runs against transformers' own model of its family (the
    tests here and in test_skeleton.py) only through a tiny config of it: every row has one,
    and every tiny config is of a row."""
    assert {_config(name, V).model_type for name in FAMILIES} == set(FAMILY_TABLE)


def tiny_family(name: str, vocab: int = V, seed: int = 0):
    """A tiny random model of family ``name`` (float32, eval), every weight redrawn."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(name, vocab)).eval()
    gemma = name.startswith("gemma")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.ndim == 2:  # linears and embeddings: O(1) activations
                p.copy_(r / p.shape[1] ** 0.5)
            elif "norm" in pname:  # gemma norms scale by (1 + w)
                p.copy_((0.0 if gemma else 1.0) + 0.2 * r)
            else:  # biases
                p.copy_(0.2 * r)
    return model


model_of = functools.lru_cache(maxsize=None)(tiny_family)


def feature_layers(config) -> tuple[int, ...]:
    """The hidden-state indices the eagle3 and mtp heads read, plus the first and the last."""
    n = config.num_hidden_layers
    used = set(HeadConfig.for_target(config, "eagle3").feature_layers)
    used |= set(HeadConfig.for_target(config, "mtp").feature_layers)
    return tuple(sorted(used | {0, n}))


def lean(model) -> LeanRunner:
    runner = make_runner(model, dtype=torch.float32, device=CPU)
    assert isinstance(runner, LeanRunner)
    runner.enable_features(feature_layers(model.config))
    return runner


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def hf_features(model, seq: list[int], layers) -> torch.Tensor:
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], dim=-1)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_full_prefill_logits_equal_transformers(name):
    model = model_of(name)
    seq = tokens(24, 1)
    runner = lean(model)
    s = runner.new_slot()
    close(runner.forward([s], [seq], [len(seq)]), hf_logits(model, seq))


@pytest.mark.parametrize("name", FAMILIES)
def test_incremental_appends_equal_transformers(name):
    model = model_of(name)
    seq = tokens(26, 2)
    want = hf_logits(model, seq)
    runner = lean(model)
    s = runner.new_slot()
    got = [runner.forward([s], [seq[:10]], [10])]  # past phi3's original length from the start
    for p in range(10, 13):  # single tokens
        got.append(runner.forward([s], [[seq[p]]], [1]))
    got.append(runner.forward([s], [seq[13:17]], [4]))  # several tokens, all logits
    got.append(runner.forward([s], [seq[17:26]], [2]))  # several tokens, the last two logits
    close(torch.cat(got), torch.cat([want[:17], want[24:26]]))


@pytest.mark.parametrize("name", FAMILIES)
def test_ragged_batch_of_non_contiguous_slots_equals_transformers(name):
    model = model_of(name)
    # the short slot stays within phi3's original length, the others start past it
    seqs = [tokens(16, 3), tokens(5, 4), tokens(27, 5)]
    want = [hf_logits(model, s) for s in seqs]
    runner = lean(model)
    all_slots = [runner.new_slot() for _ in range(4)]
    slots = [all_slots[3], all_slots[0], all_slots[2]]  # non-contiguous, out of order
    got = runner.forward(slots, [seqs[0][:12], seqs[1][:3], seqs[2][:20]], [12, 3, 20])
    close(got, torch.cat([want[0][:12], want[1][:3], want[2][:20]]))
    got = runner.forward(slots, [seqs[0][12:16], seqs[1][3:5], seqs[2][20:27]], [2, 1, 7])
    close(got, torch.cat([want[0][14:16], want[1][4:5], want[2][20:27]]))
    assert [runner.length(s) for s in slots] == [16, 5, 27]
    # a new request's prefill beside a long one's single token: the long slot's padded rows sit
    # far past every key, in sliding layers out of every window (no NaN may reach its cache:
    # the next forward reads those positions, masked)
    new = tokens(38, 13)
    want_new = hf_logits(model, new)
    more = seqs[2] + tokens(2, 14)
    want_more = hf_logits(model, more)
    got = runner.forward([all_slots[1], all_slots[2]], [new[:32], more[27:28]], [32, 1])
    close(got, torch.cat([want_new[:32], want_more[27:28]]))
    got = runner.forward([all_slots[2], all_slots[1]], [more[28:29], new[32:38]], [1, 6])
    close(got, torch.cat([want_more[28:29], want_new[32:38]]))


@pytest.mark.parametrize("name", FAMILIES)
def test_truncate_and_reappend_equals_transformers_and_features_follow(name):
    model = model_of(name)
    layers = feature_layers(model.config)
    seqs = [tokens(30, 6), tokens(22, 7)]
    junk = tokens(6, 8)
    runner = lean(model)
    a, b = runner.new_slot(), runner.new_slot()
    runner.forward([a, b], [seqs[0][:14], seqs[1][:11]], [1, 1])
    runner.forward([a, b], [junk, junk[:3]], [6, 3])  # drafts that are rejected ...
    runner.truncate(a, 14)
    runner.truncate(b, 11)
    got = runner.forward([b, a], [seqs[1][11:22], seqs[0][14:20]], [11, 6])  # ... overwritten
    close(got, torch.cat([hf_logits(model, seqs[1])[11:22], hf_logits(model, seqs[0])[14:20]]))
    runner.forward([a], [junk], [1])
    runner.truncate(a, 20)
    close(runner.forward([a], [seqs[0][20:30]], [10]), hf_logits(model, seqs[0])[20:30])
    for slot, seq in ((a, seqs[0]), (b, seqs[1])):
        close(runner.features(slot, 0, len(seq), layers), hf_features(model, seq, layers))


def test_longrope_picks_its_factors_per_slot_as_transformers_does_per_sequence():
    """transformers switches phi3's longrope to the long factors when a forward's last position
    passes the original length (keys cached before keep the short ones): the runner does the
    same per slot, whatever the other slots of the batch hold."""
    model = model_of("phi3")
    seqs = [tokens(20, 9), tokens(7, 10)]
    runner, ref = lean(model), HFRunner(model, dtype=torch.float32, device=CPU)
    for r in (runner, ref):
        assert [r.new_slot(), r.new_slot()] == [0, 1]
    got, want = [], []
    for chunks in ([5, 3], [2, 1], [6, 2], [1, 1]):  # slot 0 crosses 8 positions, slot 1 never
        parts = [s[runner.length(i): runner.length(i) + n] for i, (s, n) in enumerate(zip(seqs, chunks))]
        got.append(runner.forward([0, 1], parts, chunks))
        want.append(ref.forward([0, 1], parts, chunks))
    close(torch.cat(got), torch.cat(want))


def test_dynamic_rope_refuses_positions_past_its_original_length():
    model = model_of("llama-dynamic")
    runner = lean(model)
    s = runner.new_slot()
    runner.forward([s], [[5] * 127], [1])
    runner.forward([s], [[5]], [1])  # position 127: the last one transformers leaves unscaled
    with pytest.raises(ValueError, match="dynamic RoPE"):
        runner.forward([s], [[5]], [1])


def test_sliding_window_layers_never_read_keys_before_the_window():
    model = model_of("mistral")  # every layer slides
    seq = tokens(24, 11)
    runner = lean(model)
    runner.exact = False  # exact runners read from a block boundary (the test below)
    s = runner.new_slot()
    runner.forward([s], [seq[:20]], [1])
    with torch.inference_mode():  # positions 0..15 are outside every window of 20..23
        for cache in runner.k_cache + runner.v_cache:
            cache[s, : 20 - WINDOW + 1] = float("nan")
    close(runner.forward([s], [seq[20:24]], [4]), hf_logits(model, seq)[20:24])


def test_exact_sliding_window_layers_read_from_the_windows_key_block():
    from constrained_spec.model.runner import WINDOW_KEY_BLOCK

    model = model_of("mistral")
    n = WINDOW_KEY_BLOCK + 40
    seq = tokens(n + 4, 12)
    runner = lean(model)
    assert runner.exact
    s = runner.new_slot()
    runner.forward([s], [seq[:n]], [1])
    with torch.inference_mode():  # keys before the block that holds the window's first key
        for cache in runner.k_cache + runner.v_cache:
            cache[s, : WINDOW_KEY_BLOCK] = float("nan")
    close(runner.forward([s], [seq[n:]], [4]), hf_logits(model, seq)[n:])


def test_family_switches_follow_the_config():
    fam = {name: Family.of(model_of(name)) for name in ("qwen2", "gemma2", "gemma3", "phi3", "llama3")}
    assert fam["qwen2"].windows == (None, WINDOW, WINDOW)  # max_window_layers=1
    assert fam["gemma2"].windows == (WINDOW, None, WINDOW)
    assert fam["gemma2"].attn_softcap == 2.0 and fam["gemma2"].final_softcap == 5.0
    assert fam["gemma3"].rope_keys == ("sliding_attention", "full_attention", "sliding_attention")
    assert fam["gemma3"].qk_norm and fam["gemma3"].embed_scale == 8.0
    assert fam["phi3"].rope == "per_slot"
    phi3 = model_of("phi3").model.layers[0]  # fused in the checkpoint, fused in the runner
    runner = LeanRunner(model_of("phi3"), dtype=torch.float32, device=CPU)
    assert torch.equal(runner.layers[0].qkv.dense, phi3.self_attn.qkv_proj.weight)
    assert torch.equal(runner.layers[0].gate_up.dense, phi3.mlp.gate_up_proj.weight)
    assert fam["llama3"].rope == "batched" and fam["llama3"].windows == (None,) * 3


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                    reason="this torch build has no CPU int4 kernel")
@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_int4_packs_cover_biased_and_fused_linears_and_follow_the_float32_model(name):
    import copy

    from test_runner_int4 import q4_1

    from constrained_spec.model.runner import exact_4bit_groups

    model = copy.deepcopy(model_of(name))
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in layer.modules():
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.copy_(q4_1(lin.weight))
    packs = exact_4bit_groups(model)
    assert packs is not None and len(packs) == 4 * model.config.num_hidden_layers
    ref = LeanRunner(model, dtype=torch.float32, device=CPU)
    fast = LeanRunner(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16, device=CPU, groups=packs)
    dense = LeanRunner(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16, device=CPU)
    seq = tokens(12, 15)
    outs = []
    for runner in (ref, fast, dense):
        s = runner.new_slot()
        outs.append(torch.cat([runner.forward([s], [seq[:10]], [10]),  # 10 rows: the int4 kernel
                               runner.forward([s], [seq[10:]], [2])]))
    want, got, bf16 = outs
    # the kernel rounds each group's scale and zero point to bf16 (~1% here); a wrong fused
    # layout or a lost bias moves the logits by O(their scale)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= max(2 * (bf16 - want).abs().max().item(), 0.05 * scale)
    assert fast.quantized_linears == len(packs) and dense.quantized_linears == 0


# -- fallbacks ---------------------------------------------------------------------------------
def _unsupported(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "activation":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**dict(COMMON, vocab_size=V), hidden_act="gelu_new")).eval()
    if kind == "bidirectional":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**dict(COMMON, vocab_size=V),
                                                        use_bidirectional_attention=True)).eval()
    if kind == "architecture":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4)).eval()
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["activation", "bidirectional", "architecture"])
def test_configs_the_lean_runner_does_not_implement_run_on_transformers(kind):
    model = _unsupported(kind)
    assert not lean_runner_supports(model)
    runner = make_runner(model, dtype=torch.float32, device=CPU)
    assert isinstance(runner, HFRunner)
    seq = tokens(9, 12)
    s = runner.new_slot()
    close(runner.forward([s], [seq], [len(seq)]), hf_logits(model, seq))


def _loaded(model, tok):
    from constrained_spec.model.loading import load_model

    for cfg in (model.config, model.generation_config):  # the eos id must be a token of tok
        cfg.bos_token_id = cfg.eos_token_id = tok.eos_token_id
    return load_model((model, tok))


def _mtp_head(model) -> DraftHead:
    torch.manual_seed(4)
    return DraftHead(HeadConfig.for_target(model.config, "mtp"), model.get_input_embeddings().weight,
                     model.get_output_embeddings().weight).eval()


def test_feature_drafter_on_the_transformers_runner_is_a_config_error():
    import transformers as tf

    tok = byte_level_bpe()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**dict(COMMON, vocab_size=len(tok) + 2),
                                               hidden_act="gelu_new")).eval()
    loaded = _loaded(model, tok)
    assert isinstance(loaded.runner, HFRunner)
    with pytest.raises(ConfigError, match="hidden states") as err:
        Generator(loaded, speculative=SpeculativeConfig(method="mtp", model=_mtp_head(model)))
    assert err.value.option == "speculative.method"


# -- the public path ---------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}
PROMPTS = ["Ada Lovelace, 36", "Alan Turing, 41, from London"]


@pytest.mark.parametrize("model_type", list(FAMILY_TABLE))
def test_greedy_output_with_an_mtp_head_drafting_equals_no_speculation(model_type):
    tok = byte_level_bpe()
    model = tiny_family(tiny_of_family(model_type), vocab=len(tok) + 2, seed=2)
    loaded = _loaded(model, tok)
    assert isinstance(loaded.runner, LeanRunner)
    # single attempts: a retry samples, and sampling keeps the distribution, not the tokens
    off = Generator(loaded, schema=SCHEMA, speculative=False, max_tokens=40, max_retries=0)
    on = Generator(loaded, schema=SCHEMA, max_tokens=40, max_retries=0,
                   speculative=SpeculativeConfig(method="mtp", model=_mtp_head(model),
                                                 num_speculative_tokens=3))
    a = off.batch(PROMPTS, return_result=True)
    b = on.batch(PROMPTS, return_result=True)
    drafted = 0
    for x, y in zip(a, b):
        if isinstance(x, Exception):
            assert type(y) is type(x) and getattr(y, "token_ids", None) == getattr(x, "token_ids", None)
        else:
            assert y.token_ids == x.token_ids
            drafted += y.stats.drafted_tokens - y.stats.forced_drafted
    assert drafted > 0 or all(isinstance(x, Exception) for x in a)


@pytest.mark.parametrize("name", ["gemma3", "llama3"])
def test_buffers_of_a_model_built_on_meta_are_rebuilt_as_at_init(name):
    # the lean GGUF path builds the transformers model on the meta device; every buffer made
    # at init (RoPE frequencies, gemma3's embedding scale) must come back with its init value
    from transformers import AutoModelForCausalLM

    from constrained_spec.model.loading import _materialize_buffers

    config = _config(name, V)
    want = dict(AutoModelForCausalLM.from_config(config).named_buffers())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    _materialize_buffers(meta, config)
    got = dict(meta.named_buffers())
    assert set(got) == set(want) and want
    for key, value in want.items():
        assert not got[key].is_meta and torch.equal(got[key], value), key
