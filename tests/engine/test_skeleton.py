"""The lean runner's light view of a model (`constrained_spec.model.skeleton`) against transformers'.

For every family the lean runner covers (the tiny random models of test_runner_families):

- the skeleton has exactly the transformers model's parameters (names and shapes), and its
  rotary module the same cos / sin at every position (longrope's short and long factors,
  gemma3's per-layer-type bases);
- a LeanRunner built from the skeleton (config + state dict) gives BIT-IDENTICAL logits to a
  LeanRunner built from the transformers model, for a prefill and incremental appends, in
  float32 and bfloat16;
- a GGUF opened for the lean runner (already converted) never imports
  ``transformers.modeling_utils``, a transformers config class (through which
  ``transformers.activations``, torch.distributed and sympy come), nor torch._dynamo / triton
  (checked in a fresh interpreter): each costs resident memory the runner never uses.

Every row of `families.FAMILIES` is checked against transformers' model of its family (a tiny
config of each: test_runner_families), its bias switches off and on. The skeletons here are
built, as `loading._open_lean` builds them, over a `LightConfig` of the transformers config's
resolved attributes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from test_runner_families import FAMILIES, PHI3_ORIGINAL, close, hf_logits, model_of, tiny_of_family, tokens

from constrained_spec.errors import ModelLoadError
from constrained_spec.model.families import FAMILIES as FAMILY_TABLE
from constrained_spec.model.runner import LeanRunner
from constrained_spec.model.skeleton import (
    LightConfig,
    light_config,
    parameter_shapes,
    skeleton_model,
)

CPU = torch.device("cpu")


def skeleton_of(model):
    """The skeleton over ``model``'s weights, from a `LightConfig` of its config's resolved
    attributes (nothing shared but the tensors)."""
    return skeleton_model(LightConfig(copy.deepcopy(model.config.to_dict())), model.state_dict())


@pytest.mark.parametrize("model_type", sorted(FAMILY_TABLE))
def test_each_row_of_the_family_table_lays_out_and_runs_its_family_as_transformers(model_type):
    """A row of `families.FAMILIES` against transformers' own model of its family: the
    skeleton's parameters with every bias switch of the config off and on (a row's bias
    facts), and the lean runner's logits on the skeleton."""
    from transformers import AutoModelForCausalLM

    model = model_of(tiny_of_family(model_type))
    assert model.config.model_type == model_type
    for biases in (False, True):
        config = copy.deepcopy(model.config)
        config.attention_bias = config.mlp_bias = biases
        with torch.device("meta"):
            theirs = AutoModelForCausalLM.from_config(config)
        assert parameter_shapes(config) == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    seq = tokens(12, 16)
    runner = LeanRunner(skeleton_of(model), dtype=torch.float32, device=CPU)
    slot = runner.new_slot()
    close(runner.forward([slot], [seq], [len(seq)]), hf_logits(model, seq))


@pytest.mark.parametrize("name", FAMILIES)
def test_skeleton_has_the_parameters_of_the_transformers_model(name):
    model = model_of(name)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert parameter_shapes(model.config) == want
    got = {k: tuple(v.shape) for k, v in skeleton_of(model).state_dict().items()}
    assert got == want


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_gives_transformers_cos_and_sin(name, dtype):
    model = model_of(name)
    ours, theirs = skeleton_of(model).model.rotary_emb, model.model.rotary_emb
    assert ours.rope_type == theirs.rope_type
    x = torch.zeros(1, dtype=dtype)
    keys = list(theirs.rope_type) if isinstance(theirs.rope_type, dict) else [None]
    # a call ending before phi3's original length (short factors), one past it (long factors),
    # and one at positions up to max_position_embeddings - 1
    for pos in (torch.arange(PHI3_ORIGINAL)[None], torch.arange(3, 20)[None],
                torch.arange(model.config.max_position_embeddings)[None]):
        for key in keys:
            args = () if key is None else (key,)
            for a, b in zip(ours(x, pos, *args), theirs(x, pos, *args)):
                assert a.dtype == b.dtype and torch.equal(a, b)
        prefix = "" if keys == [None] else f"{keys[0]}_"
        assert getattr(ours, prefix + "attention_scaling") == getattr(theirs, prefix + "attention_scaling")
        assert torch.equal(getattr(ours, prefix + "original_inv_freq"),
                           getattr(theirs, prefix + "original_inv_freq"))


def _run(runner: LeanRunner, seqs: list[list[int]], cuts: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill of ``seqs[b][:cuts[0]]`` for every slot, then appends up to each
    following cut (several tokens, then one at a time)."""
    slots = [runner.new_slot() for _ in seqs]
    out = [runner.forward(slots, [s[: cuts[0]] for s in seqs], [cuts[0]] * len(seqs), phase="prefill")]
    for a, b in zip(cuts, cuts[1:]):
        out.append(runner.forward(slots, [s[a:b] for s in seqs], [b - a] * len(seqs), phase="decode"))
    return out


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_on_the_skeleton_gives_bit_identical_logits(name, dtype):
    model = model_of(name)
    g = torch.Generator().manual_seed(3)
    # 14 positions: past gemma's / mistral's sliding window and phi3's original length (its
    # longrope switches to the long factors mid-sequence)
    seqs = [torch.randint(3, 100, (14,), generator=g).tolist() for _ in range(2)]
    cuts = [5, 9, 10, 11, 14]
    want = _run(LeanRunner(model, dtype=dtype, device=CPU), seqs, cuts)
    got = _run(LeanRunner(skeleton_of(model), dtype=dtype, device=CPU), seqs, cuts)
    for w, o in zip(want, got):
        assert torch.equal(w, o)


def test_skeleton_refuses_tensors_that_do_not_fit_its_config():
    model = model_of("llama3")
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelLoadError, match="q_proj.weight has shape"):
        skeleton_model(model.config, state)
    state = dict(model.state_dict(), **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match="no parameter for"):
        skeleton_model(model.config, state)


def test_skeleton_leaves_missing_weights_on_meta_and_has_no_forward():
    model = model_of("qwen2")
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp" not in k}
    sk = skeleton_model(model.config, state)
    meta = {n for n, p in sk.named_parameters() if p.is_meta}
    assert meta == {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    with pytest.raises(ModelLoadError, match="full_model=True"):
        sk(torch.tensor([[1, 2]]))


def test_tied_skeleton_reads_its_head_from_the_embedding():
    model = model_of("gemma2")  # tie_word_embeddings: one tensor, as transformers ties it
    sk = skeleton_of(model)
    assert model.config.tie_word_embeddings
    assert sk.get_output_embeddings().weight is sk.model.embed_tokens.weight
    assert sk.generation_config.eos_token_id == model.generation_config.eos_token_id


def test_a_lean_gguf_load_does_not_import_transformers_modeling_code(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_load import write_tiny_llama

    gguf = tmp_path / "tiny.Q4_K_M.gguf"
    write_tiny_llama(gguf)
    env = dict(os.environ, CONSTRAINED_SPEC_CACHE=str(tmp_path / "cache"),
               CONSTRAINED_SPEC_PLAN="prefill=fp32,decode=int4,lm_head=fp32")
    # the first load converts the file (that reads it through transformers' GGUF code); the
    # checked load opens the converted folder, as every later load does
    convert = ("import sys; from constrained_spec.model.loading import load_model; "
               f"load_model({str(gguf)!r}, quiet=True)")
    subprocess.run([sys.executable, "-c", convert], env=env, check=True, timeout=300)
    check = (
        "import sys; from constrained_spec.model.loading import load_model; "
        f"m = load_model({str(gguf)!r}, quiet=True); "
        "r = m.runner; s = r.new_slot(); r.forward([s], [[5, 6, 7]], [1]); "
        "assert type(r).__name__ == 'LeanRunner', type(r); "
        "assert m.eos_token_ids == (0,), m.eos_token_ids; "
        "bad = [k for k in ('transformers.modeling_utils', 'transformers.models.llama.modeling_llama', "
        "'transformers.models.llama.configuration_llama', 'transformers.activations', 'sympy', "
        "'torch._dynamo', 'triton') if k in sys.modules]; "
        "assert type(m.model.config).__name__ == 'LightConfig', type(m.model.config); "
        "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_light_config_is_written_once_and_read_back_with_the_same_attributes(tmp_path):
    model = model_of("qwen3")
    model.config.save_pretrained(tmp_path)
    first = light_config(tmp_path)  # transformers' class, its attributes kept beside it
    assert not isinstance(first, LightConfig)
    second = light_config(tmp_path)
    assert isinstance(second, LightConfig)
    expected = {**first.to_dict(), "transformers_version": second.transformers_version}
    assert second.to_dict() == json.loads(json.dumps(expected))  # JSON's str keys (id2label)
    assert second.get_text_config() is second
    with pytest.raises(ValueError):
        second.per_layer_config  # noqa: B018 -- modeling_rope_utils catches exactly this


def test_light_config_from_another_transformers_version_is_not_trusted(tmp_path):
    model = model_of("llama3")
    model.config.save_pretrained(tmp_path)
    light_config(tmp_path)
    path = tmp_path / "light_config.json"
    stale = json.loads(path.read_text())
    stale.update(transformers_version="0.0.0", num_hidden_layers=1000)
    path.write_text(json.dumps(stale))
    assert not isinstance(light_config(tmp_path), LightConfig)  # read by transformers again
    assert isinstance(light_config(tmp_path), LightConfig)
    assert light_config(tmp_path).num_hidden_layers == model.config.num_hidden_layers


@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_releasing_the_weights_a_runner_copied_keeps_its_logits_and_frees_the_parts(name):
    from constrained_spec.model.loading import _tensors_held
    from constrained_spec.model.skeleton import release_copied_weights

    model = model_of(name)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 100, (9,), generator=g).tolist()]
    want = _run(LeanRunner(skeleton_of(model), dtype=torch.bfloat16, device=CPU), seqs, [5, 7, 9])
    sk = skeleton_of(copy.deepcopy(model).to(torch.bfloat16))  # bf16: the runner shares o / down
    runner = LeanRunner(sk, dtype=torch.bfloat16, device=CPU)
    released = release_copied_weights(sk, _tensors_held(runner))
    layer = sk.model.layers[0]
    if name == "phi3":  # stored fused: the runner shares every matrix, nothing is released
        assert released == 0 and not layer.self_attn.qkv_proj.weight.is_meta
    else:  # q/k/v and gate/up were concatenated: copies, released; o / down are shared
        assert layer.self_attn.q_proj.weight.is_meta and layer.mlp.up_proj.weight.is_meta
        assert not layer.self_attn.o_proj.weight.is_meta and not layer.mlp.down_proj.weight.is_meta
        assert released > 0
    assert not sk.model.embed_tokens.weight.is_meta and not sk.model.norm.weight.is_meta
    for w, o in zip(want, _run(runner, seqs, [5, 7, 9])):
        assert torch.equal(w, o)
