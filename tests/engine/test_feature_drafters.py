"""Drafters that read the target's hidden states (``method="eagle3"`` / ``"mtp"``) on tiny models.

- Training equals inference: `DraftHead.unrolled` (all positions, unrolled draft steps) gives
  what `FeatureDrafter` computes with its per-request head cache (catch-up, then draft steps).
- The target runner keeps exactly the hidden states transformers returns, across prefill,
  single-token steps, batching, truncation and cache growth.
- Lossless: greedy output is token-identical with and without speculation (random heads, whose
  drafts are mostly rejected, and a head that predicts the target exactly); sampled sequences
  keep the exact distribution (chi-square).
- Misconfiguration is a ConfigError naming ``speculative.model``.

The "perfect" MTP head works on `bigram_llama`, whose next token depends on the last token
alone: with zero output projections the head's output is ``eh_proj([enorm(e) ; .])`` = the
normed one-hot of the token it was fed, and the shared head turns that into the target's row.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from dataclasses import replace

import pytest
import torch
from cs_testlib import (
    bigram_llama,
    exact_distribution,
    gof,
    tiny_loaded_model,
)
from test_draft_model import CPU, EOS, ID, PROMPTS, SCHEMAS, V
from test_lossless_sampling import ALPHA, PROMPT

from constrained_spec import ConfigError, Generator, Regex, SpeculativeConfig
from constrained_spec.config import SamplingParams
from constrained_spec.drafters import make_drafter
from constrained_spec.drafters.base import DraftState, GrammarCursor
from constrained_spec.drafters.feature import (
    FeatureDrafter,
    HeadSeq,
    load_feature_drafter,
)
from constrained_spec.drafters.heads import DraftHead, HeadConfig, HeadKind
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import normalize_schema

KINDS = ["eagle3", "mtp"]
# the drafting tests also run an mtp head that drafts over part of the shared LM head's rows
HEADS = KINDS + ["mtp-pruned"]


# the head method each kind runs
_METHODS: dict[str, HeadKind] = {"eagle3": "eagle3", "mtp": "mtp", "mtp-pruned": "mtp"}


def method(kind: str) -> HeadKind:
    return _METHODS[kind]


# -- heads -------------------------------------------------------------------------------------
def random_head(kind: str, model, *, seed: int, draft_vocab: int = 24,
                layers: tuple[int, ...] = (0, 1, 2), lm_scale: float = 4.0,
                d2t: list[int] | None = None) -> DraftHead:
    """A random head for ``model`` (every weight random, norms around 1); eagle3 with
    ``layers`` as features; eagle3, "mtp-pruned" and an mtp head given ``d2t`` draft over a
    compressed vocabulary: ``d2t`` or a random injective map (plain mtp: the full vocabulary)."""
    compressed = kind != "mtp" or d2t is not None
    kind = method(kind)
    draft_vocab = len(d2t) if d2t is not None else draft_vocab
    cfg = HeadConfig.for_target(model.config, kind,
                                draft_vocab_size=draft_vocab if compressed else None,
                                feature_layers=layers if kind == "eagle3" else None,
                                intermediate_size=96)
    head = DraftHead(cfg, model.model.embed_tokens.weight, model.lm_head.weight)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                scale = lm_scale if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
        if compressed:
            ids = torch.randperm(cfg.target_vocab_size, generator=g)[:draft_vocab]
            head.d2t.copy_(torch.tensor(d2t) if d2t is not None else ids)
    return head.eval()


def perfect_mtp_head(model, noise: float = 0.0, seed: int = 5) -> DraftHead:
    """An MTP head for ``bigram_llama(table)`` that predicts the target's next-token row exactly
    (up to the RMS eps); ``noise`` on eh_proj makes it wrong some of the time."""
    cfg = HeadConfig.for_target(model.config, "mtp")
    D = cfg.hidden_size
    head = DraftHead(cfg, model.model.embed_tokens.weight, model.lm_head.weight)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        eh = torch.zeros(D, 2 * D)
        eh[:, :D] = torch.eye(D)  # take the token's embedding, drop the hidden state
        head.eh_proj.weight.copy_(eh + noise * torch.randn(eh.shape, generator=g))
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
    return head.eval()


class FeatureTable:
    """A stand-in for the target runner (a `protocols.FeatureSource`): the features of slot b
    are ``feats[b]``."""

    max_context = 10**6
    device = CPU

    def __init__(self, feats: torch.Tensor) -> None:
        self.feats = feats  # [B, T, F]
        self.dtype = feats.dtype
        self.embed = self.lm_head = torch.zeros(V, 4)  # unread: the heads here bring their own
        self.enabled: tuple[int, ...] = ()

    def enable_features(self, layers) -> None:
        self.enabled = tuple(layers)

    def features(self, slot: int, start: int, end: int, layers) -> torch.Tensor:
        assert tuple(layers) == self.enabled
        return self.feats[slot, start:end]

    def length(self, slot: int) -> int:
        return self.feats.shape[1]


def random_features(head: DraftHead, B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    F = len(head.config.feature_layers) * head.config.hidden_size
    return torch.randn(B, T, F, generator=g), torch.randint(1, V, (B, T), generator=g)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# -- training == inference --------------------------------------------------------------------
@pytest.mark.parametrize("incremental", [False, True], ids=["one_catch_up", "two_catch_ups"])
@pytest.mark.parametrize("kind", HEADS)
def test_unrolled_steps_equal_the_cached_inference_path(tiny_model, kind, incremental):
    head = random_head(kind, tiny_model, seed=1)
    B, T = 2, 12
    feats, tokens = random_features(head, B, T, seed=2)
    with torch.no_grad():
        outs = head.unrolled(feats, tokens, steps=3)  # [B, T, D] per step
    drafter = FeatureDrafter(head, FeatureTable(feats), vocab_size=V)
    anchors = [0, 1, 4, 8]
    pairs = list(itertools.product(range(B), anchors))

    def states(length_of):
        # the target slot of request (b, a) is b; its context ends with the pending token a + 1
        return [DraftState(i, tokens[b, : length_of(a)].tolist(), None, None, None, slot=b)
                for i, (b, a) in enumerate(pairs)]

    seqs = [HeadSeq(drafter.cache.new_slot()) for _ in pairs]
    with torch.inference_mode():
        if incremental:  # a first catch-up over part of the context, as after earlier steps
            drafter._catch_up(list(zip(states(lambda a: a // 2 + 2), seqs)))
        todo = list(zip(states(lambda a: a + 2), seqs))  # all anchors in one padded batch
        drafter._catch_up(todo)
        cur = {id(st): (seq.anchor_out, seq.true_len) for st, seq in todo}
        got = [[seq.anchor_out] for _, seq in todo]
        for j in (1, 2):
            drafter._advance(todo, [int(tokens[b, a + 1 + j]) for b, a in pairs], cur)
            for i, (st, _) in enumerate(todo):
                got[i].append(cur[id(st)][0])
    for i, (b, a) in enumerate(pairs):
        assert seqs[i].true_len == a + 1
        for j in range(3):  # step j of the unrolled head at position a + j
            close(got[i][j], outs[j][b, a + j])


@pytest.mark.parametrize("pushed", [0, 2], ids=["drafts_only", "after_forced"])
@pytest.mark.parametrize("kind", HEADS)
def test_greedy_proposal_follows_the_unrolled_argmax_chain(tiny_model, kind, pushed):
    head = random_head(kind, tiny_model, seed=3)
    B, T, k = 2, 14, 3
    feats, tokens = random_features(head, B, T, seed=4)
    drafter = FeatureDrafter(head, FeatureTable(feats), vocab_size=V)
    words = (V + 31) // 32
    for b, a in itertools.product(range(B), [0, 3, 7]):
        cursor = GrammarCursor(None, torch.empty((12, words), dtype=torch.int32))
        st = DraftState(0, tokens[b, : a + 2].tolist(), cursor, SamplingParams(), None, slot=b)
        for t in tokens[b, a + 2: a + 2 + pushed].tolist():  # e.g. forced tokens
            assert st.push(t)
        drafter.propose([st], k)
        assert len(st.tokens) == pushed + k and st.q == [None] * (pushed + k)
        seq = tokens[b, : a + 2].tolist() + st.tokens
        with torch.no_grad():
            outs = head.unrolled(feats[b: b + 1, : len(seq)], torch.tensor([seq]), pushed + k)
        for j in range(k):
            step = pushed + j  # the entry at a + step predicts the (j + 1)-th draft
            want = int(head.target_ids()[head.logits(outs[step][0, a + step]).argmax()])
            assert st.tokens[pushed + j] == want
        drafter.release(st.drafter_state)
    assert drafter.cache.slots_in_use == 0  # every head slot came back


@pytest.mark.parametrize("kind", HEADS)
def test_quantized_head_follows_the_dense_head(tiny_model, kind):
    """On the CPU in bf16 a head's linears (and an mtp head's shared rows) run on the int8
    kernel for few-row forwards: outputs within ~1% of the dense head's."""
    from constrained_spec.drafters.heads import QuantLinear, quantize_for_drafting

    dense = random_head(kind, tiny_model, seed=6).to(torch.bfloat16)
    quant = quantize_for_drafting(copy.deepcopy(dense))
    assert any(isinstance(m, QuantLinear) for m in quant.modules())
    feats, tokens = random_features(dense, 1, 4, seed=7)
    pos = torch.arange(4)[None]
    with torch.inference_mode():
        outs = []
        for head in (dense, quant):
            hidden = head.fuse(feats.to(torch.bfloat16))
            q, k, v, residual = head.project(hidden, tokens, pos)
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True)
            out = head.finish(attn.transpose(1, 2).flatten(2), residual)
            outs.append(head.logits(out).float())
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1)
    assert bool((cos > 0.995).all()), cos
    assert not torch.equal(outs[0], outs[1])


# -- the target runner's features -------------------------------------------------------------
def hf_features(model, ids: list[int], layers) -> torch.Tensor:
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], dim=-1)


def test_runner_features_are_transformers_hidden_states(tiny_model):
    layers = (0, 1, -1)  # embeddings, after layer 0, after the final norm
    runner = LeanRunner(tiny_model, dtype=torch.float32, device=CPU)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, V, (300,), generator=g).tolist()
    b = torch.randint(1, V, (30,), generator=g).tolist()
    junk = torch.randint(1, V, (6,), generator=g).tolist()
    s0, s1 = runner.new_slot(), runner.new_slot()
    runner.forward([s0], [[1, 2, 3]], [1])  # before enable_features: not kept
    runner.truncate(s0, 0)
    runner.enable_features(layers)
    runner.enable_features((1,))  # a second drafter asking for a subset changes nothing
    assert runner.feature_layers == (-1, 0, 1)
    runner.forward([s0, s1], [a[:20], b[:7]], [1, 1])  # batched prefill, padded
    for i in range(3):  # single tokens, both slots
        runner.forward([s1, s0], [[b[7 + i]], [a[20 + i]]], [1, 1])
    runner.forward([s0], [junk], [len(junk)])  # drafts that are rejected ...
    runner.truncate(s0, 23)
    runner.forward([s0, s1], [a[23:30], b[10:13]], [2, 1])  # ... and overwritten
    runner.forward([s1], [junk], [1])
    runner.truncate(s1, 13)
    runner.forward([s1], [b[13:30]], [1])
    runner.forward([s0], [a[30:250]], [1])
    others = [runner.new_slot() for _ in range(3)]
    s5 = runner.new_slot()  # a fifth slot and > 256 positions: the caches grow, rows are kept
    runner.forward([s5, s0], [b[:5], a[250:300]], [1, 1])
    assert (runner.length(s0), runner.length(s1), runner.length(s5)) == (300, 30, 5)
    for slot, seq in ((s0, a), (s1, b), (s5, b[:5])):
        want = hf_features(tiny_model, seq, layers)
        close(runner.features(slot, 0, len(seq), layers), want)
        close(runner.features(slot, 3, 5, (-1, 0)),
              torch.cat([want[3:5, 128:], want[3:5, :64]], dim=-1))
        close(runner.features(slot, 0, len(seq), runner.feature_layers),
              torch.cat([want[:, 128:], want[:, :128]], dim=-1))
    for s in others:
        runner.free_slot(s)


def test_final_feature_is_the_normed_hidden_the_lm_head_reads(tiny_model):
    runner = LeanRunner(tiny_model, dtype=torch.float32, device=CPU)
    runner.enable_features((2,))  # n_layers: the same state as -1
    ids = [ID[c] for c in "abcabd"]
    s = runner.new_slot()
    logits = runner.forward([s], [ids], [len(ids)])
    h = runner.features(s, 0, len(ids), (2,))
    close(h @ tiny_model.lm_head.weight.detach().T, logits)


# -- greedy: token-identical ------------------------------------------------------------------
def compiled_schemas(tok):
    return {n: compile_spec(normalize_schema(s), tok) for n, s in SCHEMAS.items() if s is not None}


def run(target, tok, combos, params, *, kind=None, k=3, forced=True, head=None,
        drafter_cls=FeatureDrafter, max_batch_size=64, prompts=PROMPTS, dtype=torch.float32):
    """Requests ``(prompt index, schema name)``, batched, through an Engine over a fresh
    runner; with a FeatureDrafter reading that runner when ``kind`` is given."""
    compiled = compiled_schemas(tok)
    runner = LeanRunner(target, dtype=dtype, device=CPU)
    drafter = spec = None
    if kind is not None:
        drafter = drafter_cls(head, runner, vocab_size=V)
        spec = SpeculativeConfig(method=method(kind), num_speculative_tokens=k, forced=forced)
    eng = Engine(runner, speculative=spec, drafter=drafter, max_batch_size=max_batch_size)
    reqs = [Request(list(prompts[i]), compiled[n].new_matcher() if n in compiled else None,
                    params, EOS) for i, n in combos]
    eng.run(reqs)
    return reqs, drafter


_BASELINE: dict = {}


def baseline(target, tok, combos, params, prompts=PROMPTS, dtype=torch.float32):
    """Outputs without speculation, each request run alone (cached)."""
    out = []
    for i, n in combos:
        key = (id(target), tuple(prompts[i]), n, params, dtype)
        if key not in _BASELINE:
            reqs, _ = run(target, tok, [(i, n)], params, prompts=prompts, dtype=dtype)
            _BASELINE[key] = (reqs[0].output_ids, reqs[0].finish_reason)
        out.append(_BASELINE[key])
    return out


COMBOS = list(itertools.product(range(len(PROMPTS)), SCHEMAS))


@pytest.fixture(scope="module")
def heads(tiny_model):
    return {kind: random_head(kind, tiny_model, seed=11) for kind in HEADS}


def assert_released(drafter, reqs) -> None:
    assert all(r.drafter_state is None for r in reqs)
    assert drafter.cache._next > 0 and drafter.cache.slots_in_use == 0


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "no_forced"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", HEADS)
def test_greedy_feature_drafter_is_token_identical(tiny_model, tiny_tok, heads, kind, k, forced):
    params = SamplingParams(max_tokens=30)
    reqs, drafter = run(tiny_model, tiny_tok, COMBOS, params, kind=kind, k=k, forced=forced,
                        head=heads[kind])
    assert [(r.output_ids, r.finish_reason) for r in reqs] == baseline(tiny_model, tiny_tok,
                                                                       COMBOS, params)
    assert sum(r.stats.drafted_tokens - r.stats.forced_drafted for r in reqs) > len(reqs)
    assert_released(drafter, reqs)


@pytest.mark.parametrize("kind", HEADS)
def test_greedy_feature_drafter_is_token_identical_in_bfloat16(tiny_model, tiny_tok, heads, kind):
    # the exact runner's verify rows equal 1-row decodes in bf16 too (test_exact_rows)
    params = SamplingParams(max_tokens=30)
    reqs, _ = run(tiny_model, tiny_tok, COMBOS, params, kind=kind, k=3, head=heads[kind],
                  dtype=torch.bfloat16)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == baseline(
        tiny_model, tiny_tok, COMBOS, params, dtype=torch.bfloat16)


class CheckedFeatureDrafter(FeatureDrafter):
    """After every proposal, checks that the head holds a true entry for every verified
    position and that its last output is the unrolled head's over transformers' features of
    the context (so the runner's slots, positions and lengths line up with the contexts)."""

    target = None
    checked = 0

    def propose(self, states, k):
        super().propose(states, k)
        for st in states:
            seq = st.drafter_state
            if seq.last_state is not st or seq.anchor_out is None:
                continue
            n = len(st.context)
            assert seq.true_len == n - 1 == self.runner.length(st.slot)
            feats = hf_features(self.target, st.context, self.layers)
            with torch.no_grad():
                want = self.head.unrolled(feats[None], torch.tensor([st.context]), 1)[0][0, n - 2]
            close(seq.anchor_out, want)
            self.checked += 1


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "no_forced"])
@pytest.mark.parametrize("kind", HEADS)
def test_head_cache_follows_the_verified_context(tiny_model, tiny_tok, heads, kind, forced):
    CheckedFeatureDrafter.target = tiny_model
    params = SamplingParams(max_tokens=20)
    combos = [(0, "json"), (1, "free"), (2, "regex"), (3, "choice")]
    reqs, drafter = run(tiny_model, tiny_tok, combos, params, kind=kind, k=3, forced=forced,
                        head=heads[kind], drafter_cls=CheckedFeatureDrafter)
    assert drafter.checked > 3 * len(reqs)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == baseline(tiny_model, tiny_tok,
                                                                       combos, params)


@pytest.mark.parametrize("kind", HEADS)
def test_head_slots_are_reused_under_continuous_batching(tiny_model, tiny_tok, heads, kind):
    params = SamplingParams(max_tokens=15)
    combos = COMBOS[:6]
    reqs, drafter = run(tiny_model, tiny_tok, combos, params, kind=kind, head=heads[kind],
                        max_batch_size=2)
    assert [(r.output_ids, r.finish_reason) for r in reqs] == baseline(tiny_model, tiny_tok,
                                                                       combos, params)
    assert drafter.cache._next <= 2  # at most the running requests hold a head slot
    assert_released(drafter, reqs)


@pytest.fixture(scope="module")
def bigram():
    g = torch.Generator().manual_seed(3)
    return bigram_llama(torch.randn(V, V, generator=g) * 2.0)


@pytest.mark.parametrize("k", [1, 5])
def test_mtp_head_that_predicts_the_target_has_its_drafts_accepted(bigram, tiny_tok, k):
    params = SamplingParams(max_tokens=30)
    combos = [(i, n) for i, n in COMBOS if n != "choice"]  # choices are mostly forced
    # no forced drafts: one of several tokenizations of a forced string can be rejected
    reqs, drafter = run(bigram, tiny_tok, combos, params, kind="mtp", k=k, forced=False,
                        head=perfect_mtp_head(bigram))
    assert [(r.output_ids, r.finish_reason) for r in reqs] == baseline(bigram, tiny_tok, combos,
                                                                       params)
    model_drafted = sum(r.stats.drafted_tokens - r.stats.forced_drafted for r in reqs)
    model_accepted = sum(r.stats.accepted_tokens - r.stats.forced_tokens for r in reqs)
    assert model_drafted > 2 * len(reqs) and model_accepted >= 0.95 * model_drafted
    forwards = sum(r.stats.target_forwards for r in reqs)
    emitted = sum(len(r.output_ids) for r in reqs)
    assert forwards < emitted / 1.5
    assert_released(drafter, reqs)


# -- sampling: the sequence distribution is unchanged -----------------------------------------
def sample(target, compiled, params, head, kind, n, k=3):
    runner = LeanRunner(target, dtype=torch.float32, device=CPU)
    drafter = FeatureDrafter(head, runner, vocab_size=V)
    eng = Engine(runner, speculative=SpeculativeConfig(method=kind, num_speculative_tokens=k,
                                                       forced=False),
                 drafter=drafter, max_batch_size=n)
    reqs = [Request(PROMPT, compiled.new_matcher(),
                    SamplingParams(**{**params.__dict__, "seed": 1000 + i}), EOS) for i in range(n)]
    eng.run(reqs)
    assert all(r.finish_reason == "stop" for r in reqs)
    assert_released(drafter, reqs)
    drafted = sum(r.stats.drafted_tokens for r in reqs)
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    return Counter(tuple(r.output_ids) for r in reqs), drafted, accepted


@pytest.mark.parametrize("case", ["eagle3_plain", "eagle3_topk_topp", "mtp_plain", "mtp_topk_topp",
                                  "mtp_noisy", "mtp_perfect"])
def test_sampled_feature_drafts_keep_the_sequence_distribution(tiny_model, bigram, tiny_tok, case):
    kind, variant = case.split("_", 1)
    compiled = compile_spec(normalize_schema(Regex("(a|b|ab|c){2,3}")), tiny_tok)
    params = (SamplingParams(temperature=0.8, top_k=4, top_p=0.9, max_tokens=8)
              if variant == "topk_topp" else SamplingParams(temperature=1.0, max_tokens=8))
    if variant in ("noisy", "perfect"):
        target = bigram
        head = perfect_mtp_head(bigram, noise=0.3 if variant == "noisy" else 0.0)
    else:
        target = tiny_model
        # the draft vocabulary holds 'a', 'b', 'c' and eos but not 'ab': q is 0 where p is not
        d2t = [ID["c"], 0, ID["a"], 5, 6, ID["b"], 20, 21, 30, 31, 2, 3]
        # (fixed seeds: about half of the drafts are accepted with these heads)
        head = random_head(kind, tiny_model, seed=23 if kind == "eagle3" else 21, d2t=d2t)
    exact = exact_distribution(target, compiled, params, tiny_tok.vocab_size, PROMPT)
    n = 1500
    counts, drafted, accepted = sample(target, compiled, params, head, kind, n)
    if variant == "perfect":  # q is the target's own row: (almost) every draft is accepted
        assert drafted > n and accepted >= 0.98 * drafted
    else:  # drafts accepted and rejected: a wrong q would show
        assert drafted > n and 0.1 * drafted < accepted < 0.9 * drafted
    assert gof(counts, exact, n) > ALPHA


# -- configuration errors ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    """A LoadedModel of our own (its runner's features are switched on here)."""
    return tiny_loaded_model(seed=5)


@pytest.mark.parametrize("kind", KINDS)
def test_no_head_for_a_non_default_target_is_a_config_error(loaded, kind):
    with pytest.raises(ConfigError) as info:
        make_drafter(SpeculativeConfig(method=kind, model=None), loaded)
    assert info.value.option == "speculative.model"
    assert "speculative.model" in str(info.value)
    with pytest.raises(ConfigError, match="speculative.model"):
        Generator(loaded, speculative=SpeculativeConfig(method=kind))


def test_head_of_another_hidden_size_is_a_config_error(loaded, tmp_path):
    cfg = replace(HeadConfig.for_target(loaded.model.config, "eagle3", feature_layers=(0, 1, 2)),
                  hidden_size=32, head_dim=8, intermediate_size=48)
    head = DraftHead(cfg, torch.zeros(loaded.vocab_size, 32))
    with pytest.raises(ConfigError, match="hidden size 32") as info:
        load_feature_drafter("eagle3", head, loaded)
    assert info.value.option == "speculative.model"
    head.save(tmp_path / "small")
    with pytest.raises(ConfigError, match="hidden size 32"):
        make_drafter(SpeculativeConfig(method="eagle3", model=str(tmp_path / "small")), loaded)


def test_head_that_does_not_fit_the_target_is_a_config_error(loaded):
    n = loaded.model.config.num_hidden_layers
    model = loaded.model
    head = random_head("eagle3", model, seed=1, layers=(0, 1, n + 3))
    with pytest.raises(ConfigError, match=rf"feature layers \[{n + 3}\]"):
        load_feature_drafter("eagle3", head, loaded)
    head = random_head("eagle3", model, seed=1)
    with torch.no_grad():
        head.d2t[0] = loaded.vocab_size  # beyond the target's logits
    with pytest.raises(ConfigError, match="beyond the target"):
        load_feature_drafter("eagle3", head, loaded)
    with pytest.raises(ConfigError, match="not mtp"):
        load_feature_drafter("mtp", random_head("eagle3", model, seed=1), loaded)


@pytest.mark.parametrize("kind", KINDS)
def test_missing_head_folder_is_a_config_error_naming_it(loaded, kind):
    with pytest.raises(ConfigError, match="no/such/head") as info:
        make_drafter(SpeculativeConfig(method=kind, model="/no/such/head"), loaded)
    assert info.value.option == "speculative.model"


def test_a_random_head_through_the_public_api_matches_no_speculation(loaded):
    """A DraftHead passed as speculative.model: Generator output equals speculation off."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompts = ["Ada Lovelace, 36", "Alan Turing, 41"]
    # single attempts: a retry samples, and sampling keeps the distribution, not the tokens
    off = Generator(loaded, schema=schema, speculative=False, max_tokens=40, max_retries=0)
    a = off.batch(prompts, return_result=True)
    for kind in KINDS:
        head = random_head(kind, loaded.model, seed=9, draft_vocab=100)
        on = Generator(loaded, schema=schema, max_tokens=40, max_retries=0,
                       speculative=SpeculativeConfig(method=kind, model=head,
                                                     num_speculative_tokens=3))
        assert isinstance(on.drafter, FeatureDrafter)
        b = on.batch(prompts, return_result=True)
        for x, y in zip(a, b):  # results, or errors (max_tokens reached) with their tokens
            assert type(y) is type(x) and y.token_ids == x.token_ids
            assert y.stats.drafted_tokens > y.stats.forced_drafted
        assert on.drafter.cache.slots_in_use == 0


class NoWeights(FeatureTable):
    """Keeps features but exposes no embedding or LM head (what a head folder is built on)."""

    def __getattribute__(self, name):
        if name in ("embed", "lm_head"):
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("runner", ["transformers", "no_weights"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_feature_drafter_on_a_runner_that_is_no_feature_source_is_a_config_error(
        loaded, tmp_path, runner, kind):
    """Through the `protocols.FeatureSource` check, before anything reads the runner: never an
    AttributeError from a missing ``runner.embed``."""
    from types import SimpleNamespace

    from constrained_spec.model.runner import HFRunner

    if runner == "transformers":
        target_runner = HFRunner(loaded.model, dtype=torch.float32, device=CPU)
    else:
        target_runner = NoWeights(torch.zeros(1, 4, 8))
    head = random_head(kind, loaded.model, seed=1)
    head.save(tmp_path / "head")
    target = SimpleNamespace(runner=target_runner, model=loaded.model, vocab_size=loaded.vocab_size,
                             path=None, is_default=False, tokenizer=loaded.tokenizer)
    for source in (tmp_path / "head", head):
        with pytest.raises(ConfigError, match="does not keep hidden states") as info:
            load_feature_drafter(kind, source, target)
        assert info.value.option == "speculative.method"
    with pytest.raises(ConfigError, match="does not keep hidden states"):
        FeatureDrafter(head, target_runner, vocab_size=loaded.vocab_size)
