"""The draft-model drafter (``method="draft_model"``) on tiny random Llamas.

Draft models: the target itself (its drafts are then the target's own choices, so nearly all
are accepted), a different, smaller random Llama with the same vocabulary (most drafts are
rejected: verification must still give the target's output), and for sampling the target with
a noisy head (about half accepted: the chi-square test then sees a wrong q).
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest
import torch
from cs_testlib import CHARS, byte_level_bpe, exact_distribution, gof, tiny_llama
from test_lossless_sampling import ALPHA, PROMPT

from constrained_spec import (
    ConfigError,
    Generator,
    ModelLoadError,
    Regex,
    SpeculativeConfig,
)
from constrained_spec.config import SamplingParams
from constrained_spec.drafters import DraftModelDrafter, make_drafter
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import compile_spec
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import normalize_schema

ID = {c: i for i, c in enumerate(CHARS)}
EOS = (0,)
V = len(CHARS) + 2  # the tiny models' logits width
CPU = torch.device("cpu")
PROMPTS = [[ID[c] for c in "abababab"], [ID[c] for c in "abcab"],
           [ID[t] for t in ['{', '"', 'a', '"', ':', ' ', '1', ',']], [ID[c] for c in "dddd"]]
SCHEMAS = {
    "regex": Regex(r"(ab|c)+d{2,4}"),
    "json": {"type": "object", "properties": {"a": {"type": "integer"},
                                              "b": {"type": "string", "maxLength": 5}},
             "required": ["a", "b"], "additionalProperties": False},
    "choice": ["abc", "abd", "e"],
    "free": None,
}


@pytest.fixture(scope="module")
def small_draft():
    """A different random Llama with the target's vocabulary: one layer, another seed."""
    return tiny_llama(seed=1, layers=1)


def draft_spec(k: int = 4, forced: bool = True, model: object = "draft",
               adaptive: bool = False) -> SpeculativeConfig:
    # the engine reads k and the forced options; the model is only loaded by make_drafter.
    # adaptive off: the cache checks below count every fed draft as verified, and the load
    # budget (generation/budget.py) drops fed drafts from a proposal
    return SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=k,
                             forced=forced, adaptive=adaptive)


def drafter_for(model) -> DraftModelDrafter:
    return DraftModelDrafter(LeanRunner(model, dtype=torch.float32, device=CPU), vocab_size=V)


def run(target, tok, schema, prompts, params, spec=None, drafter=None):
    compiled = compile_spec(normalize_schema(schema), tok) if schema is not None else None
    eng = Engine(LeanRunner(target, dtype=torch.float32, device=CPU), speculative=spec,
                 drafter=drafter)
    reqs = [Request(list(p), compiled.new_matcher() if compiled else None, params, EOS)
            for p in prompts]
    eng.run(reqs)
    return reqs


_BASELINE: dict = {}


def baseline(target, tok, name, params):
    """Outputs without speculation (cached per schema and params)."""
    key = (name, params)
    if key not in _BASELINE:
        _BASELINE[key] = run(target, tok, SCHEMAS[name], PROMPTS, params)
    return _BASELINE[key]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("mode", ["other+forced", "other", "self+forced"])
def test_greedy_draft_model_is_token_identical(tiny_model, tiny_tok, small_draft, name, mode):
    params = SamplingParams(max_tokens=30)
    draft = tiny_model if mode.startswith("self") else small_draft
    base = baseline(tiny_model, tiny_tok, name, params)
    spec = run(tiny_model, tiny_tok, SCHEMAS[name], PROMPTS, params,
               draft_spec(forced="forced" in mode, adaptive=True), drafter_for(draft))
    for a, b in zip(base, spec):
        assert (b.output_ids, b.finish_reason) == (a.output_ids, a.finish_reason)
    assert sum(r.stats.drafted_tokens - r.stats.forced_drafted for r in spec) > 0


@pytest.mark.parametrize("name", ["regex", "json", "free"])
def test_target_as_its_own_draft_model_accepts_its_greedy_drafts(tiny_model, tiny_tok, name):
    params = SamplingParams(max_tokens=30)
    reqs = run(tiny_model, tiny_tok, SCHEMAS[name], PROMPTS, params, draft_spec(forced=False),
               drafter_for(tiny_model))
    drafted = sum(r.stats.drafted_tokens for r in reqs)
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    assert drafted > 0 and accepted >= 0.95 * drafted
    # per-position stats: every proposed position was (nearly) always accepted
    for r in reqs:
        rates = r.stats.acceptance_rate_by_position
        assert rates and min(rates) >= 0.9, rates
    base = baseline(tiny_model, tiny_tok, name, params)
    assert sum(r.stats.target_forwards for r in reqs) < sum(r.stats.target_forwards for r in base)


def test_batched_mixed_requests_match_runs_without_speculation(tiny_model, tiny_tok, small_draft):
    params = SamplingParams(max_tokens=30)
    compiled = {n: compile_spec(normalize_schema(s), tiny_tok) for n, s in SCHEMAS.items()
                if s is not None}
    combos = list(itertools.product(range(len(PROMPTS)), SCHEMAS))
    eng = Engine(LeanRunner(tiny_model, dtype=torch.float32, device=CPU),
                 speculative=draft_spec(), drafter=drafter_for(small_draft))
    reqs = [Request(list(PROMPTS[i]), compiled[n].new_matcher() if n in compiled else None,
                    params, EOS) for i, n in combos]
    eng.run(reqs)
    for (i, n), r in zip(combos, reqs):
        want = baseline(tiny_model, tiny_tok, n, params)[i]
        assert (r.output_ids, r.finish_reason) == (want.output_ids, want.finish_reason)


class CheckedDrafter(DraftModelDrafter):
    """Checks, after every proposal, that each draft cache holds exactly the tokens the
    drafter saw (context + proposal, less the last draft, which is never fed); counts the
    tokens fed to the draft model and the slots held at once."""

    def __init__(self, runner, **kw):
        super().__init__(runner, **kw)
        self.fed = self.checked = self.max_slots = self.resumed = 0
        forward = runner.forward

        def counting_forward(slots, tokens, num_logits, **kw):
            self.fed += sum(len(t) for t in tokens)
            return forward(slots, tokens, num_logits, **kw)

        runner.forward = counting_forward

    def propose(self, states, k):
        for st in states:  # a later round of the same step, after forced tokens
            seq = st.drafter_state
            if seq is not None and seq.last_state is st and seq.last_len < len(st.tokens):
                self.resumed += 1
        super().propose(states, k)
        self.max_slots = max(self.max_slots, self.runner.slots_in_use)
        for st in states:
            seq = st.drafter_state
            seen = st.context + st.tokens
            assert self.runner.length(seq.slot) == len(seq.tokens)
            assert seq.tokens == seen[:len(seq.tokens)]
            if seq.last_state is st and st.tokens:
                assert len(seq.tokens) == len(seen) - 1  # all but the last draft
            self.checked += 1


@pytest.mark.parametrize("forced", [False, True])
def test_draft_cache_stays_in_step_with_the_context(tiny_model, tiny_tok, small_draft, forced):
    params = SamplingParams(max_tokens=40)
    drafter = CheckedDrafter(LeanRunner(small_draft, dtype=torch.float32, device=CPU),
                             vocab_size=V)
    reqs = run(tiny_model, tiny_tok, SCHEMAS["json"], PROMPTS, params, draft_spec(forced=forced),
               drafter)
    assert drafter.checked > 4 * len(reqs)
    assert (drafter.resumed > 0) == forced  # drafting resumed after forced tokens
    # no re-prefill: the draft model saw each context token once, plus the drafts it fed
    assert drafter.fed <= sum(len(r.prompt_ids) + len(r.output_ids) + r.stats.drafted_tokens
                              for r in reqs)


def test_draft_slots_are_freed_when_requests_finish(tiny_model, tiny_tok, small_draft):
    params = SamplingParams(max_tokens=20)
    drafter = CheckedDrafter(LeanRunner(small_draft, dtype=torch.float32, device=CPU),
                             vocab_size=V)
    compiled = compile_spec(normalize_schema(SCHEMAS["regex"]), tiny_tok)
    eng = Engine(LeanRunner(tiny_model, dtype=torch.float32, device=CPU),
                 speculative=draft_spec(), drafter=drafter, max_batch_size=2)

    def boom(_ids):
        raise RuntimeError("callback failed")

    reqs = [Request(list(p), compiled.new_matcher(), params, EOS) for p in PROMPTS * 2]
    reqs[1].on_tokens = boom  # one request fails (stage "callback"): its slot is freed too
    eng.run(reqs)
    assert reqs[1].finish_reason == "error"
    assert all(r.finish_reason in ("stop", "length") for r in reqs if r is not reqs[1])
    assert drafter.max_slots <= 2  # continuous batching: at most the running requests hold one
    assert drafter.runner.slots_in_use == 0
    assert all(r.drafter_state is None for r in reqs)


def near_copy(model, noise: float = 1.0):
    """The target with noise on its head: about half of its sampled drafts are accepted, so
    a wrong q (say, one of another temperature) shows as a chi-square p-value below 1e-20."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std() * noise)
    return draft


@pytest.mark.parametrize("draft", ["near", "self"])
def test_sampled_drafts_keep_the_sequence_distribution(tiny_model, tiny_tok, draft):
    compiled = compile_spec(normalize_schema(Regex("(a|b|ab|c){2,3}")), tiny_tok)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, max_tokens=8)
    exact = exact_distribution(tiny_model, compiled, params, tiny_tok.vocab_size, PROMPT)
    n = 1500
    drafter = drafter_for(near_copy(tiny_model) if draft == "near" else tiny_model)
    eng = Engine(LeanRunner(tiny_model, dtype=torch.float32, device=CPU),
                 speculative=draft_spec(k=3, forced=False), drafter=drafter, max_batch_size=n)
    reqs = [Request(PROMPT, compiled.new_matcher(),
                    SamplingParams(**{**params.__dict__, "seed": 1000 + i}), EOS) for i in range(n)]
    eng.run(reqs)
    assert all(r.finish_reason == "stop" for r in reqs)
    drafted = sum(r.stats.drafted_tokens for r in reqs)
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    if draft == "near":
        assert drafted > n and 0.2 * drafted < accepted < 0.8 * drafted  # accepted and rejected
    else:
        # q is the target's own processed distribution: (almost) every draft is accepted
        assert drafted > n and accepted >= 0.98 * drafted
    assert gof(Counter(tuple(r.output_ids) for r in reqs), exact, n) > ALPHA


# -- through the public API: make_drafter, tokenizer check, vocabulary padding ---------------
@pytest.mark.parametrize("extra", [12, 0], ids=["wider", "narrower"])
def test_generator_with_a_draft_model_matches_no_speculation(tiny_loaded, extra):
    tok = tiny_loaded.tokenizer
    # the same tokenizer, another logits width than the target's (len + 2): the draft's rows
    # are cut or padded to the target's width
    draft = tiny_llama(vocab_size=len(tok) + extra, seed=3, layers=1)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompts = ["Ada Lovelace, 36", "Alan Turing, 41"]
    # single attempts: a retry samples, and sampling keeps the distribution, not the tokens
    off = Generator(tiny_loaded, schema=schema, speculative=False, max_tokens=60, max_retries=0)
    on = Generator(tiny_loaded, schema=schema, max_tokens=60, max_retries=0,
                   speculative=SpeculativeConfig(method="draft_model", model=(draft, tok)))
    assert isinstance(on.drafter, DraftModelDrafter)
    a = off.batch(prompts, return_result=True)
    b = on.batch(prompts, return_result=True)
    for x, y in zip(a, b):
        if isinstance(x, Exception):
            assert type(y) is type(x)
        else:
            assert y.token_ids == x.token_ids
            assert y.stats.drafted_tokens > y.stats.forced_drafted
    assert on.drafter.runner.slots_in_use == 0


def test_target_as_its_own_draft_model_through_make_drafter(tiny_loaded):
    drafter = make_drafter(draft_spec(model=tiny_loaded), tiny_loaded)
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.runner is not tiny_loaded.runner  # its own cache, never the target's slots
    assert drafter.vocab_size == tiny_loaded.vocab_size


def other_tokenizer():
    """The test byte-level BPE with one merge swapped: same size, one different token."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = byte_level_bpe()
    vocab = dict(tok.get_vocab())
    merges = [("Ġ", "a"), ('"', ":"), ("{", "{")]  # '{"' becomes '{{'
    del vocab['{"']
    vocab["{{"] = len(vocab)
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def test_draft_model_with_another_tokenizer_is_a_config_error(tiny_loaded):
    other = other_tokenizer()
    draft = tiny_llama(vocab_size=len(other) + 2, seed=3, layers=1)
    with pytest.raises(ConfigError) as info:
        make_drafter(draft_spec(model=(draft, other)), tiny_loaded)
    assert info.value.option == "speculative.model"
    first = tiny_loaded.tokenizer.get_vocab()['{"']
    assert f"token id {first}" in str(info.value) and "'{{'" in str(info.value)


def test_missing_draft_model_is_a_config_error_naming_it(tiny_loaded):
    with pytest.raises(ConfigError, match="no/such/model") as info:
        make_drafter(draft_spec(model="/no/such/model"), tiny_loaded)
    assert info.value.option == "speculative.model"
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig(method="draft_model")  # no model at all: fails in the config object
    assert info.value.option == "speculative.model"


def test_unloadable_draft_model_is_a_model_load_error(tiny_loaded, tmp_path):
    with pytest.raises(ModelLoadError, match="could not load the draft model"):
        make_drafter(draft_spec(model=str(tmp_path)), tiny_loaded)  # an empty folder


def test_draft_model_loaded_from_a_checkpoint_folder(tiny_loaded, tmp_path):
    tok = tiny_loaded.tokenizer
    draft = tiny_llama(vocab_size=len(tok) + 2, seed=4, layers=1)
    draft.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    drafter = make_drafter(draft_spec(model=str(tmp_path)), tiny_loaded)  # tokenizers compared
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.runner.vocab_size == len(tok) + 2
