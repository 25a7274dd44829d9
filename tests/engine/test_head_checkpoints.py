"""Draft heads read from disk: our own folders, public EAGLE-3 checkpoints, DeepSeek-V3-layout
MTP layers (``constrained_spec.drafters.checkpoints``).

The public formats are written here, tiny, tensor by tensor as the public checkpoints name
them, and the loaded head is checked against a small reference implementation written from
the formats' definitions (one Llama layer over entries fed one at a time with a growing KV
list), not from our `DraftHead`. Then the loaded head drives generation, token-identical to
generation without speculation.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cs_testlib import byte_level_bpe, tiny_llama, tiny_loaded_model
from safetensors.torch import load_file, save_file
from test_feature_drafters import KINDS, close, random_head

from constrained_spec import ConfigError, Generator, SpeculativeConfig
from constrained_spec.config import SamplingParams
from constrained_spec.drafters import make_drafter
from constrained_spec.drafters.base import DraftState, GrammarCursor
from constrained_spec.drafters.checkpoints import find_mtp_layer, load_head
from constrained_spec.drafters.feature import FeatureDrafter, load_feature_drafter
from constrained_spec.model.loading import load_model
from constrained_spec.model.protocols import Runner

D, H, KV = 64, 4, 2  # the tiny targets' shape (cs_testlib.tiny_llama)
HD = D // H
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPTS = ["Ada Lovelace, 36", "Alan Turing, 41", "x"]


def randomize_norms(model, seed: int) -> None:
    """Random RMSNorm weights (tiny_llama leaves them at 1, which would hide a feature taken
    before instead of after the final norm: the heads' own norms undo a unit-weight norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def target():
    """A LoadedModel over a tiny random Llama and a byte-level BPE (vocab 262)."""
    loaded = tiny_loaded_model(seed=3)
    randomize_norms(loaded.model, seed=3)  # before its runner copies the weights
    return loaded


def assert_same_outputs(a, b) -> int:
    """Generator results (or errors: max_tokens reached, invalid output) of speculation off
    (a) and on (b) are the same; returns the model drafts of b."""
    for x, y in zip(a, b):
        assert type(y) is type(x)
        for attr in ("token_ids", "partial_text", "text"):
            assert getattr(y, attr, None) == getattr(x, attr, None)
    return sum(y.stats.drafted_tokens - y.stats.forced_drafted for y in b)


def hf_features(model, ids: list[int], layers) -> torch.Tensor:
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], dim=-1)


def propose_greedy(drafter: FeatureDrafter, runner: Runner, ctx: list[int], k: int) -> list[int]:
    """k greedy drafts after ``ctx`` (free text), with the target runner's own features
    (``runner``: the target's, the one ``drafter`` reads)."""
    slot = runner.new_slot()
    try:
        runner.forward([slot], [ctx[:-1]], [0])  # the engine's prefill: the last token pends
        words = (drafter.vocab_size + 31) // 32
        cursor = GrammarCursor(None, torch.empty((k + 2, words), dtype=torch.int32))
        st = DraftState(0, list(ctx), cursor, SamplingParams(), None, slot=slot)
        drafter.propose([st], k)
        drafter.release(st.drafter_state)
        return st.tokens
    finally:
        runner.free_slot(slot)


# -- the reference ----------------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Llama RoPE of x [heads, hd] at position ``pos`` (halves rotated)."""
    hd = x.shape[-1]
    ang = pos * theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd / 2]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class RefLayer:
    """One Llama decoder layer; entries are fed one at a time and attend to every entry fed
    before (and themselves). ``W``: q, k, v, o, post, gate, up, down."""

    def __init__(self, W: dict, eps: float, theta: float) -> None:
        self.W, self.eps, self.theta = W, eps, theta
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, pos: int) -> torch.Tensor:
        W = self.W
        q = rope((W["q"] @ x).view(H, HD), pos, self.theta)
        self.ks.append(rope((W["k"] @ x).view(KV, HD), pos, self.theta))
        self.vs.append((W["v"] @ x).view(KV, HD))
        K, Vv = torch.stack(self.ks), torch.stack(self.vs)  # [L, KV, hd]
        heads = []
        for h in range(H):
            g = h // (H // KV)  # grouped-query attention: query head h reads kv head g
            p = torch.softmax(K[:, g] @ q[h] / HD ** 0.5, dim=0)  # [L]
            heads.append(p @ Vv[:, g])
        y = residual + W["o"] @ torch.cat(heads)
        m = rms(y, W["post"], self.eps)
        return y + W["down"] @ (F.silu(W["gate"] @ m) * (W["up"] @ m))


def ref_run(entry, logits, true_inputs: list[tuple[torch.Tensor, int]], k: int):
    """Outputs of the true entries (hidden_p, token_{p+1}) at p = 0.., then a greedy chain of
    k drafts from the last: ``entry(hidden, token, pos) -> output``, ``logits(out) -> [V]``."""
    outs = [entry(h, t, p) for p, (h, t) in enumerate(true_inputs)]
    o, drafts = outs[-1], []
    for j in range(k):
        d = int(logits(o).argmax())
        drafts.append(d)
        if j + 1 < k:
            o = entry(o, d, len(true_inputs) + j)
    return outs, drafts


# -- our format -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_saved_head_loads_back_as_its_bf16_rounding(target, kind, tmp_path):
    head = random_head(kind, target.model, seed=7, draft_vocab=100)
    head.save(tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["constrained_spec_head"]["kind"] == kind
    rounded = copy.deepcopy(head)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    drafter = load_feature_drafter(kind, str(tmp_path / "head"), target)
    direct = load_head(tmp_path / "head", kind, target.model.config, target.runner.embed,
                       target.runner.lm_head)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 9, len(head.config.feature_layers) * D, generator=g)
    tokens = torch.randint(0, target.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        want = rounded.unrolled(feats, tokens, 3)
        unrounded = head.unrolled(feats, tokens, 3)
    assert not torch.allclose(want[2], unrounded[2], rtol=1e-4, atol=1e-5)  # bf16 did round
    for loaded in (drafter.head, direct):
        assert loaded.config == head.config
        state = loaded.state_dict()
        assert set(state) == set(rounded.state_dict())
        for name, value in rounded.state_dict().items():
            assert torch.equal(state[name], value), name
        with torch.no_grad():
            got = loaded.unrolled(feats, tokens, 3)
            for a, b in zip(got, want):
                close(a, b)
            close(loaded.logits(got[1]), rounded.logits(want[1]))
        assert torch.equal(loaded.target_ids(), head.target_ids())


def test_our_head_folder_loaded_under_the_other_method_is_a_config_error(target, tmp_path):
    random_head("eagle3", target.model, seed=7, draft_vocab=100).save(tmp_path)
    with pytest.raises(ConfigError, match="is an eagle3 head, not mtp"):
        load_feature_drafter("mtp", str(tmp_path), target)


# -- public EAGLE-3 checkpoints ---------------------------------------------------------------
EAGLE3_EPS, EAGLE3_THETA = 1e-5, 5000.0  # unlike the target's: the head must read its own


def write_eagle3(folder: Path, vocab: int, draft_vocab: int, *, seed: int = 0,
                 layers: tuple[int, ...] = (0, 1, 2), drop: tuple[str, ...] = (),
                 intermediate: int = 96, embed: bool = False) -> dict[str, torch.Tensor]:
    """A tiny checkpoint in the public EAGLE-3 layout (LlamaForCausalLMEagle3); returns its
    tensors. The draft vocabulary is a sorted random subset of the target's; ``embed``: the
    checkpoint carries its own token embedding (``embed_tokens.weight``)."""
    g = torch.Generator().manual_seed(seed)

    def lin(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * scale / inp ** 0.5

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(D, generator=g)

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w = {
        "fc.weight": lin(D, len(layers) * D),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": lin(H * HD, 2 * D),
        "midlayer.self_attn.k_proj.weight": lin(KV * HD, 2 * D),
        "midlayer.self_attn.v_proj.weight": lin(KV * HD, 2 * D),
        "midlayer.self_attn.o_proj.weight": lin(D, H * HD),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": lin(intermediate, D),
        "midlayer.mlp.up_proj.weight": lin(intermediate, D),
        "midlayer.mlp.down_proj.weight": lin(D, intermediate),
        "norm.weight": norm(),
        "lm_head.weight": lin(draft_vocab, D, scale=4.0),
        "d2t": ids - torch.arange(draft_vocab),  # offsets: target id = draft id + d2t[id]
        "t2d": t2d,
    }
    if embed:
        w["embed_tokens.weight"] = torch.randn(vocab, D, generator=g)
    for name in drop:
        del w[name]
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": KV,
              "intermediate_size": intermediate, "rms_norm_eps": EAGLE3_EPS,
              "rope_theta": EAGLE3_THETA, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "num_hidden_layers": 1, "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}
    (folder / "config.json").write_text(json.dumps(config))
    return w


def eagle3_reference(w: dict, embed: torch.Tensor, vocab: int):
    """``entry(hidden, token, pos)`` and ``logits(out)`` (target vocabulary, -inf off the draft
    vocabulary) of a public EAGLE-3 head ``w``; step-0 hiddens are ``fc(features)``."""
    layer = RefLayer({"q": w["midlayer.self_attn.q_proj.weight"],
                      "k": w["midlayer.self_attn.k_proj.weight"],
                      "v": w["midlayer.self_attn.v_proj.weight"],
                      "o": w["midlayer.self_attn.o_proj.weight"],
                      "post": w["midlayer.post_attention_layernorm.weight"],
                      "gate": w["midlayer.mlp.gate_proj.weight"],
                      "up": w["midlayer.mlp.up_proj.weight"],
                      "down": w["midlayer.mlp.down_proj.weight"]}, EAGLE3_EPS, EAGLE3_THETA)

    def entry(hidden, token, pos):
        x = torch.cat([rms(embed[token], w["midlayer.input_layernorm.weight"], EAGLE3_EPS),
                       rms(hidden, w["midlayer.hidden_norm.weight"], EAGLE3_EPS)])
        return layer(x, hidden, pos)

    target_ids = torch.arange(w["d2t"].shape[0]) + w["d2t"]

    def logits(out):
        full = torch.full((vocab,), float("-inf"))
        full[target_ids] = w["lm_head.weight"] @ rms(out, w["norm.weight"], EAGLE3_EPS)
        return full

    return entry, logits


@pytest.mark.parametrize("own_embed", [False, True], ids=["target_embedding", "own_embedding"])
def test_public_eagle3_checkpoint_matches_a_reference_implementation(target, tmp_path, own_embed):
    V = target.vocab_size
    w = write_eagle3(tmp_path, V, 100, seed=1, embed=own_embed)
    drafter = make_drafter(SpeculativeConfig(method="eagle3", model=str(tmp_path)), target)
    head = drafter.head
    assert head.config.feature_layers == (0, 1, 2) and head.config.draft_vocab_size == 100
    assert head.config.rope_theta == EAGLE3_THETA and head.config.intermediate_size == 96
    embed = w["embed_tokens.weight"] if own_embed else target.model.model.embed_tokens.weight.detach()
    ctx = target.tokenizer.encode('{"name": "Ada", "age": 3')
    n = len(ctx)
    feats = hf_features(target.model, ctx, head.config.feature_layers)  # [n, 3D]
    for anchor in (n - 2, 3):  # true entries 0..anchor, then 3 greedy drafts
        entry, logits = eagle3_reference(w, embed, V)
        fused = [w["fc.weight"] @ feats[p] for p in range(anchor + 1)]
        outs, drafts = ref_run(entry, logits, [(h, ctx[p + 1]) for p, h in enumerate(fused)], 3)
        with torch.no_grad():
            step0 = head.unrolled(feats[None], torch.tensor([ctx]), 1)[0][0]
        for p, o in enumerate(outs):
            close(step0[p], o)
            close(drafter._to_target(head.logits(step0[p])), logits(o))
        assert propose_greedy(drafter, target.runner, ctx[: anchor + 2], 3) == drafts


def test_public_eagle3_checkpoint_generates_as_without_speculation(target, tmp_path):
    write_eagle3(tmp_path, target.vocab_size, 100, seed=2)
    # single attempts: a retry samples, and sampling keeps the distribution, not the tokens
    off = Generator(target, schema=SCHEMA, speculative=False, max_tokens=40, max_retries=0)
    a = off.batch(PROMPTS, return_result=True)
    for k in (1, 4):
        on = Generator(target, schema=SCHEMA, max_tokens=40, max_retries=0,
                       speculative=SpeculativeConfig(method="eagle3", model=str(tmp_path),
                                                     num_speculative_tokens=k))
        assert isinstance(on.drafter, FeatureDrafter)
        b = on.batch(PROMPTS, return_result=True)
        assert assert_same_outputs(a, b) > 0
        assert len(on.drafter.cache._free) == on.drafter.cache._next
    free = Generator(target, speculative=False, max_tokens=20, max_retries=0)  # free text too
    spec = Generator(target, max_tokens=20, max_retries=0, speculative=SpeculativeConfig(
        method="eagle3", model=str(tmp_path), num_speculative_tokens=3))
    assert_same_outputs(free.batch(PROMPTS, return_result=True),
                        spec.batch(PROMPTS, return_result=True))


EAGLE3_TENSORS = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                  "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                  "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                  "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                  "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
                  "lm_head.weight"]


@pytest.mark.parametrize("name", EAGLE3_TENSORS)
def test_eagle3_checkpoint_missing_a_tensor_is_a_config_error_naming_it(target, tmp_path, name):
    write_eagle3(tmp_path, target.vocab_size, 100, drop=(name,))
    with pytest.raises(ConfigError) as info:
        load_feature_drafter("eagle3", str(tmp_path), target)
    assert info.value.option == "speculative.model"
    assert name in str(info.value)


def test_eagle3_checkpoint_without_d2t(target, tmp_path):
    V = target.vocab_size
    write_eagle3(tmp_path / "compressed", V, 100, drop=("d2t",))
    with pytest.raises(ConfigError, match="d2t") as info:
        load_feature_drafter("eagle3", str(tmp_path / "compressed"), target)
    assert info.value.option == "speculative.model"
    # the full vocabulary needs no map: draft id i is target id i
    write_eagle3(tmp_path / "full", V, V, drop=("d2t", "t2d"))
    drafter = load_feature_drafter("eagle3", str(tmp_path / "full"), target)
    assert torch.equal(drafter.d2t, torch.arange(V))


def test_eagle3_checkpoint_with_other_feature_layers_than_its_fc_is_a_config_error(target, tmp_path):
    write_eagle3(tmp_path, target.vocab_size, 100)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="fc takes 192 features"):
        load_feature_drafter("eagle3", str(tmp_path), target)


# -- DeepSeek-V3-layout MTP layers ------------------------------------------------------------
MTP_INTERMEDIATE = 96  # unlike the target's 128: read from the MTP block's own weights


def mtp_tensors(layer: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inter = MTP_INTERMEDIATE

    def lin(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * scale / inp ** 0.5

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(D, generator=g)

    p = f"model.layers.{layer}."
    return {p + "enorm.weight": norm(), p + "hnorm.weight": norm(),
            p + "eh_proj.weight": lin(D, 2 * D),
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": lin(H * HD, D),
            p + "self_attn.k_proj.weight": lin(KV * HD, D),
            p + "self_attn.v_proj.weight": lin(KV * HD, D),
            p + "self_attn.o_proj.weight": lin(D, H * HD),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": lin(inter, D), p + "mlp.up_proj.weight": lin(inter, D),
            p + "mlp.down_proj.weight": lin(D, inter),
            p + "shared_head.norm.weight": norm(),
            p + "shared_head.head.weight": lin(vocab, D, scale=4.0)}


def write_mtp_checkpoint(folder: Path, model, tok, *, seed: int = 0, drop: tuple[str, ...] = (),
                         add: tuple[str, ...] = (), sharded: bool = False) -> dict[str, torch.Tensor]:
    """``model`` saved with save_pretrained, plus an MTP layer ``model.layers.{N}.*`` (in the
    same safetensors file, or in a second shard listed by an index); returns the MTP tensors.
    ``drop`` / ``add``: names after the layer prefix to leave out / add (random)."""
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    N = model.config.num_hidden_layers
    p = f"model.layers.{N}."
    mtp = mtp_tensors(N, model.config.vocab_size, seed)
    for name in drop:
        del mtp[p + name]
    for name in add:
        mtp[p + name] = torch.randn(D, D)
    main = load_file(str(folder / "model.safetensors"))
    if sharded:
        save_file(mtp, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
        weight_map = {**{k: "model.safetensors" for k in main},
                      **{k: "model-mtp.safetensors" for k in mtp}}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file({**main, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return mtp


def mtp_target_model(seed: int = 4):
    """A tiny Llama for the byte-level BPE (as cs_testlib.tiny_loaded_model) and its tokenizer."""
    tok = byte_level_bpe()
    model = tiny_llama(vocab_size=len(tok) + 2, seed=seed, max_positions=2048)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = cfg.eos_token_id = tok.eos_token_id
    randomize_norms(model, seed)
    return model, tok


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A LoadedModel read from a folder whose checkpoint holds an MTP layer (path set)."""
    folder = tmp_path_factory.mktemp("mtp_target")
    model, tok = mtp_target_model()
    mtp = write_mtp_checkpoint(folder, model, tok, seed=1)
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert loaded.path == folder
    return loaded, mtp


def mtp_reference(w: dict, layer: int, embed: torch.Tensor, eps: float, theta: float):
    """``entry(hidden, token, pos)`` and ``logits(out)`` of a DeepSeek-V3 MTP layer ``w``."""
    p = f"model.layers.{layer}."
    block = RefLayer({"q": w[p + "self_attn.q_proj.weight"], "k": w[p + "self_attn.k_proj.weight"],
                      "v": w[p + "self_attn.v_proj.weight"], "o": w[p + "self_attn.o_proj.weight"],
                      "post": w[p + "post_attention_layernorm.weight"],
                      "gate": w[p + "mlp.gate_proj.weight"], "up": w[p + "mlp.up_proj.weight"],
                      "down": w[p + "mlp.down_proj.weight"]}, eps, theta)

    def entry(hidden, token, pos):
        h = w[p + "eh_proj.weight"] @ torch.cat([rms(embed[token], w[p + "enorm.weight"], eps),
                                                 rms(hidden, w[p + "hnorm.weight"], eps)])
        return block(rms(h, w[p + "input_layernorm.weight"], eps), h, pos)

    def logits(out):
        return w[p + "shared_head.head.weight"] @ rms(out, w[p + "shared_head.norm.weight"], eps)

    return entry, logits


def test_mtp_layer_beside_the_target_matches_a_reference_implementation(mtp_target):
    target, w = mtp_target
    N = target.model.config.num_hidden_layers
    assert find_mtp_layer(target.path) == N
    drafter = load_feature_drafter("mtp", None, target)  # the target's own folder
    head = drafter.head
    assert head.config.kind == "mtp" and head.config.intermediate_size == MTP_INTERMEDIATE
    assert torch.equal(head.target_head, w[f"model.layers.{N}.shared_head.head.weight"])
    cfg = target.model.config
    embed = target.model.model.embed_tokens.weight.detach()
    ctx = target.tokenizer.encode('{"name": "Alan", "age": 4')
    n = len(ctx)
    feats = hf_features(target.model, ctx, (-1,))  # the final normed hidden states
    for anchor in (n - 2, 2):
        entry, logits = mtp_reference(w, N, embed, cfg.rms_norm_eps, 10000.0)
        outs, drafts = ref_run(entry, logits, [(feats[p], ctx[p + 1]) for p in range(anchor + 1)], 3)
        with torch.no_grad():
            step0 = head.unrolled(feats[None], torch.tensor([ctx]), 1)[0][0]
        for p, o in enumerate(outs):
            close(step0[p], o)
            close(head.logits(step0[p]), logits(o))
        assert propose_greedy(drafter, target.runner, ctx[: anchor + 2], 3) == drafts
    # the folder named explicitly gives the same head
    again = load_feature_drafter("mtp", str(target.path), target).head
    for name, value in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], value)


def test_mtp_layer_beside_the_target_generates_as_without_speculation(mtp_target):
    target, _ = mtp_target
    # single attempts: a retry samples, and sampling keeps the distribution, not the tokens
    off = Generator(target, schema=SCHEMA, speculative=False, max_tokens=40, max_retries=0)
    a = off.batch(PROMPTS, return_result=True)
    for k in (1, 5):
        on = Generator(target, schema=SCHEMA, max_tokens=40, max_retries=0,
                       speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=k))
        assert isinstance(on.drafter, FeatureDrafter) and on.drafter.name == "mtp"
        b = on.batch(PROMPTS, return_result=True)
        assert assert_same_outputs(a, b) > 0
        assert len(on.drafter.cache._free) == on.drafter.cache._next


def variant(mtp_target, folder: Path, **kw):
    """The mtp_target's model with another checkpoint folder as its path."""
    target, _ = mtp_target
    model, tok = mtp_target_model()
    write_mtp_checkpoint(folder, model, tok, seed=1, **kw)
    return replace(target, path=folder, _runner=None)


def test_sharded_checkpoint_with_an_index_finds_its_mtp_layer(mtp_target, tmp_path):
    target, _ = mtp_target
    sharded = variant(mtp_target, tmp_path, sharded=True)
    assert find_mtp_layer(tmp_path) == target.model.config.num_hidden_layers
    got = load_feature_drafter("mtp", None, sharded).head.state_dict()
    for name, value in load_feature_drafter("mtp", None, target).head.state_dict().items():
        assert torch.equal(got[name], value)


@pytest.mark.parametrize("key", ["self_attn.kv_a_proj_with_mqa.weight",
                                 "mlp.experts.0.gate_proj.weight"])
def test_mla_or_moe_mtp_layer_is_a_config_error(mtp_target, tmp_path, key):
    target = variant(mtp_target, tmp_path, add=(key,))
    with pytest.raises(ConfigError, match="MLA attention or MoE") as info:
        load_feature_drafter("mtp", None, target)
    assert info.value.option == "speculative.model"


@pytest.mark.parametrize("name,said", [("hnorm.weight", "hnorm"), ("self_attn.q_proj.weight", "q_proj"),
                                       ("shared_head.norm.weight", "shared")])
def test_mtp_layer_missing_a_tensor_is_a_config_error(mtp_target, tmp_path, name, said):
    target = variant(mtp_target, tmp_path, drop=(name,))
    with pytest.raises(ConfigError, match=said) as info:
        load_feature_drafter("mtp", str(tmp_path), target)
    assert info.value.option == "speculative.model"


def test_checkpoint_without_an_mtp_layer_gives_no_mtp_head(mtp_target, tmp_path):
    target, _ = mtp_target
    model, _ = mtp_target_model()
    model.save_pretrained(tmp_path)
    plain = replace(target, path=tmp_path, _runner=None)
    assert find_mtp_layer(tmp_path) is None
    with pytest.raises(ConfigError) as info:
        load_feature_drafter("mtp", None, plain)
    assert info.value.option == "speculative.model"
    with pytest.raises(ConfigError, match="neither a constrained_spec head nor an MTP layer"):
        load_feature_drafter("mtp", str(tmp_path), plain)

