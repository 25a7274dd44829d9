"""Reasoning models: free thinking, then the grammar after the end-of-reasoning marker.

Matcher properties on a raw-string vocabulary (no model); engine properties on a scripted bigram
model whose greedy output is a think block then an answer (the marker landing inside draft
windows of the forced and n-gram drafters, budget forcing, greedy identity with speculation on
and off, the sampled distribution); the public API on a byte-level BPE with ``<think>`` /
``</think>`` tokens and a chat template that names them.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from cs_testlib import CHARS, bigram_llama, bigram_loaded, byte_level_bpe, exact_distribution, gof, tiny_llama

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import NgramDrafter
from constrained_spec.errors import ConfigError
from constrained_spec.frontend.reasoning import (
    ReasoningMarkers,
    detect_reasoning,
    resolve_reasoning,
    split_reasoning,
)
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.grammar import TokenizerData, compile_spec
from constrained_spec.grammar.reasoning import ReasoningMatcher, ReasoningTables
from constrained_spec.model.runner import LeanRunner
from constrained_spec.schemas import Regex, normalize_schema

VOCAB = CHARS + ["<think>", "</think>", "</", "th", "ink", ">", "k>", "k>{", "\n", "i", "h", "k", "bab", "aa",
                 "x"]
ID = {t: i for i, t in enumerate(VOCAB)}
V = len(VOCAB) + 2  # padded ids past the vocabulary are never allowed
EOS = 0
ANSWER = Regex(r'\{"a": [0-9]\}')


def ids(tokens: list[str]) -> list[int]:
    return [ID[t] for t in tokens]


@pytest.fixture(scope="module")
def tok():
    return TokenizerData.from_tokens(VOCAB, eos_token_id=EOS, vocab_size=V)


@pytest.fixture(scope="module")
def compiled(tok):
    return compile_spec(normalize_schema(ANSWER), tok)


def tables(tok, multi: bool = False) -> ReasoningTables:
    """The markers as one token each, or (``multi``) the end marker as four tokens."""
    end = ids(["</", "th", "ink", ">"]) if multi else ids(["</think>"])
    return ReasoningTables(tok, ids(["<think>"]), end, b"</think>")


def allowed(m, vocab: int = V) -> set[int]:
    mask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    return {t for t in range(vocab) if (int(mask[0, t >> 5]) >> (t & 31)) & 1}


def feed(m, tokens: list[str]) -> None:
    for t in tokens:
        assert m.accept(ID[t]), t


# -- the matcher ---------------------------------------------------------------------------
def test_thinking_allows_every_text_token_but_no_stop_or_padded_id(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    got = allowed(m)
    assert EOS not in got and V - 1 not in got and V - 2 not in got
    # "}" and "\n" are forbidden by the answer grammar at its start, free while thinking
    assert {ID["}"], ID["\n"], ID["xyz"], ID["</think>"], ID["<think>"]} <= got
    assert not m.is_completed() and not m.must_stop() and not m.is_terminated()
    assert not m.accept(EOS)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_grammar_applies_right_after_a_one_token_marker(tok, backend):
    compiled = compile_spec(normalize_schema(ANSWER), tok, backend=backend)
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["}", "x", "</think>"])
    assert m.phase == "answer" and m.answer_start == 3 and m.reasoning_tokens == 3
    assert allowed(m) == allowed(compiled.new_matcher()) == {ID["{"]}
    assert not m.accept(ID["\n"])
    feed(m, ["{", '"a', '": ', "7", "}"])
    assert m.must_stop()


def test_marker_spelled_across_tokens_ends_reasoning(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["</", "t", "h", "i", "n"])
    assert m.phase == "thinking"
    feed(m, ["k>"])
    assert m.phase == "answer" and m.answer_start == 6


def test_token_running_past_the_marker_is_masked_in_thinking(tok, compiled):
    """"k>{" would complete "</think>" and start the answer inside a reasoning token: masked
    after "</thin", allowed where it completes nothing."""
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    assert ID["k>{"] in allowed(m)
    feed(m, ["</", "th", "i", "n"])
    assert ID["k>{"] not in allowed(m) and ID["k>"] in allowed(m)
    assert not m.accept(ID["k>{"])
    feed(m, ["x"])  # the partial match is broken: "k>{" completes nothing now
    assert ID["k>{"] in allowed(m)


@pytest.mark.parametrize("marker", [b"</think>", b"abab", b"aa"])
def test_thinking_mask_forbids_exactly_the_tokens_that_run_past_the_marker(tok, compiled, marker):
    """Random walks through thinking, self-overlapping markers included: at each step a token
    is masked iff the text so far plus a strict prefix of it ends with the marker (and, when
    the walk ends the reasoning, it ended exactly at the marker)."""
    import random

    t = ReasoningTables(tok, ids(["<think>"]), ids(["</think>"]), marker)
    ordinary = [i for i in range(1, len(VOCAB)) if VOCAB[i] not in ("<think>", "</think>")]
    def matched(x: bytes) -> int:  # the longest marker prefix x ends with
        return max(L for L in range(len(marker) + 1) if x.endswith(marker[:L]))

    rng = random.Random(0)
    ended = masked = 0
    for _ in range(30):
        m = ReasoningMatcher(t, compiled.new_matcher, phase="thinking")
        text = b""
        for _ in range(20):
            got = allowed(m)
            for i in ordinary:
                b = tok.decoded[i]
                runs_past = any((text + b[:p]).endswith(marker) for p in range(1, len(b)))
                assert (i not in got) == runs_past, (text, VOCAB[i])
                masked += runs_past
            # most steps extend the partial match, so that walks do reach the marker
            near = [i for i in got if i in ordinary
                    and matched(text + tok.decoded[i]) >= len(tok.decoded[i])]
            i = rng.choice(near if near and rng.random() < 0.85 else
                           [i for i in ordinary if i in got])
            assert m.accept(i)
            text += tok.decoded[i]
            if m.phase != "thinking":
                assert text.endswith(marker) and marker not in text[:-1]
                ended += 1
                break
        else:
            assert marker not in text
    assert ended >= 5 and masked > 0


def test_multi_token_marker_rest_is_proposed_once_started(tok, compiled):
    m = ReasoningMatcher(tables(tok, multi=True), compiled.new_matcher, phase="thinking")
    assert m.forced_tokens() == []
    feed(m, ["</"])
    assert m.forced_tokens() == ids(["th", "ink", ">"])
    assert len(allowed(m)) > 3  # a proposal, not a mask: the model may write on
    feed(m, ["th", "ink", ">"])
    assert m.phase == "answer"


def test_budget_forces_the_end_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok, multi=True), compiled.new_matcher, max_reasoning_tokens=2,
                         phase="thinking")
    feed(m, ["x", "m"])
    assert m.phase == "closing" and m.forced_tokens() == ids(["</", "th", "ink", ">"])
    assert allowed(m) == {ID["</"]} and not m.accept(ID["x"])
    feed(m, ["</", "th"])
    assert allowed(m) == {ID["ink"]}
    feed(m, ["ink", ">"])
    assert m.phase == "answer" and m.reasoning_tokens == 2


def test_budget_zero_forces_start_and_end_then_the_grammar(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, max_reasoning_tokens=0)
    assert m.phase == "opening"
    assert m.forced_tokens() == ids(["<think>", "</think>"])
    feed(m, ["<think>", "</think>"])
    assert m.phase == "answer" and m.forced_tokens() == compiled.new_matcher().forced_tokens()


def test_opening_forces_the_start_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher)
    assert allowed(m) == {ID["<think>"]}
    feed(m, ["<think>"])
    assert m.phase == "thinking" and ID["x"] in allowed(m)


def test_prompt_that_closed_the_block_starts_in_the_answer(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="answer")
    assert m.answer_start == 0 and allowed(m) == {ID["{"]}


def test_rollback_across_the_boundary_restores_thinking(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["x", "</think>", "{", '"a'])
    m.rollback(3)  # '"a', "{", "</think>"
    assert m.phase == "thinking" and m.answer_start is None and m.reasoning_tokens == 1
    assert ID["}"] in allowed(m)
    feed(m, ["}", "</think>"])  # a fresh answer: the old grammar state is gone
    assert m.answer_start == 3 and allowed(m) == {ID["{"]}
    feed(m, ["{"])
    m.rollback(1)  # inside the answer: the inner matcher rolls back
    assert m.phase == "answer" and allowed(m) == {ID["{"]}
    with pytest.raises(ValueError):
        m.rollback(10)


def test_rollback_out_of_closing_lifts_the_forced_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok, multi=True), compiled.new_matcher, max_reasoning_tokens=1,
                         phase="thinking")
    feed(m, ["x", "</", "th"])
    m.rollback(3)
    assert m.phase == "thinking" and ID["x"] in allowed(m)


def test_fork_is_independent(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    feed(m, ["x"])
    f = m.fork()
    feed(f, ["</think>", "{"])
    assert m.phase == "thinking" and f.phase == "answer"
    g = f.fork()
    feed(g, ['"a'])
    fresh = compiled.new_matcher()
    assert fresh.accept(ID["{"])
    assert allowed(f) == allowed(fresh) != allowed(g)


def test_free_text_answer_ends_at_a_stop_token(tok):
    m = ReasoningMatcher(tables(tok), None, phase="thinking")
    feed(m, ["x", "</think>"])
    assert m.is_completed() and not m.must_stop() and EOS in allowed(m)
    assert m.accept(EOS) and m.is_terminated() and m.must_stop()
    assert allowed(m) == set()


def test_accepts_text_checks_the_answer_after_the_marker(tok, compiled):
    m = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking")
    assert m.accepts_text('a } b</think>{"a": 7}')
    assert not m.accepts_text('{"a": 7}')
    assert not m.accepts_text('x</think>{"a": 77')


# -- markers and options -------------------------------------------------------------------
class _Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("template,expected", [
    ("{% if enable_thinking %}<think>\n\n</think>{% endif %}", ReasoningMarkers()),
    ("[THINK]{{ m }}[/THINK]", ReasoningMarkers("[THINK]", "[/THINK]")),
    ({"default": "<seed:think>x</seed:think>"}, ReasoningMarkers("<seed:think>", "</seed:think>")),
    ("{{ bos_token }}{{ message['content'] }}", None),
    (None, None)])
def test_markers_are_detected_from_the_chat_template(template, expected):
    assert detect_reasoning(_Tok(template)) == expected


def test_reasoning_option_resolves():
    plain = _Tok("{{ message['content'] }}")
    assert resolve_reasoning("auto", plain) is None
    assert resolve_reasoning(True, plain) == ReasoningMarkers()
    assert resolve_reasoning(False, _Tok("</think>")) is None
    custom = ReasoningMarkers("<r>", "</r>")
    assert resolve_reasoning(custom, plain) is custom
    with pytest.raises(ConfigError, match="reasoning"):
        resolve_reasoning("yes", plain)
    with pytest.raises(ConfigError, match="reasoning"):
        ReasoningMarkers("", "</r>")


# -- the engine on a scripted model ----------------------------------------------------------
def script(marker: str = "one") -> torch.Tensor:
    """Bigram logits whose greedy path from ``<think>`` is ``m e } n``, the end marker (one
    token, or four with ``marker="multi"``), then ``{"a": 7}``. The model prefers a stop
    token after ``}`` (masked while thinking) and a newline after the marker (masked by the
    grammar): what it is allowed to write differs on each side of the marker."""
    end = ["</think>"] if marker == "one" else ["</", "th", "ink", ">"]
    path = ["<think>", "m", "e", "}", "n", *end, "{", '"a', '": ', "7", "}"]
    table = torch.full((V, V), -10.0)
    for a, b in zip(path, path[1:]):
        table[ID[a], ID[b]] = 5.0
    table[ID["}"], EOS] = 6.0  # "}" -> stop, second choice "n"
    table[ID["}"], ID["n"]] = 4.0
    table[ID[end[-1]], ID["\n"]] = 6.0  # marker -> newline, second choice "{"
    table[ID[end[-1]], ID["{"]] = 4.0
    return table


@pytest.fixture(scope="module")
def scripted():
    return {m: bigram_llama(script(m)) for m in ("one", "multi")}


class RecordingEngine(Engine):
    """An Engine that keeps every verified window: (drafts, their K + 1 mask rows)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.windows: list[tuple[list[int], torch.Tensor]] = []

    def _score(self, batch):
        for b, (s, n) in enumerate(zip(batch.states, batch.num_rows)):
            self.windows.append((list(s.tokens), batch.bitmask[b, :n].clone()))
        return super()._score(batch)


SPECS = {"off": None, "forced": SpeculativeConfig(method=None),
         "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=5)}


def generate_ids(model, tok, compiled, prompts, spec="off", *, marker="one", budget=None,
                 phase="thinking", params=None):
    """Run ``prompts`` (token lists) through an engine; returns (requests, engine)."""
    config = SPECS[spec]
    drafter = NgramDrafter(4, 1) if config is not None and config.method == "ngram" else None
    runner = LeanRunner(model, dtype=torch.float32, device=torch.device("cpu"))
    eng = RecordingEngine(runner, speculative=config, drafter=drafter)
    t = tables(tok, multi=marker == "multi")
    reqs = [Request(list(p), ReasoningMatcher(t, compiled.new_matcher, max_reasoning_tokens=budget,
                                              phase=phase),
                    params or SamplingParams(max_tokens=40), (EOS,)) for p in prompts]
    eng.run(reqs)
    return reqs, eng


def answer_is_grammatical(compiled, req) -> bool:
    """Every answer token is one the grammar allows, and the answer completes it."""
    m = compiled.new_matcher()
    return all(m.accept(t) for t in req.output_ids[req.matcher.answer_start:]) and m.is_completed()


@pytest.mark.parametrize("marker", ["one", "multi"])
def test_thinking_is_free_and_the_answer_is_constrained(scripted, tok, compiled, marker):
    (req,), _ = generate_ids(scripted[marker], tok, compiled, [ids(["x", "<think>"])],
                             marker=marker)
    end = ["</think>"] if marker == "one" else ["</", "th", "ink", ">"]
    assert req.finish_reason == "stop"
    assert req.output_ids == ids(["m", "e", "}", "n", *end, "{", '"a', '": ', "7", "}"])
    assert req.matcher.answer_start == 4 + len(end)
    assert answer_is_grammatical(compiled, req)


def crossing(eng, marker_ids: list[int]) -> list[tuple[int, list[int], torch.Tensor]]:
    """The windows in which a draft completes the end marker and more drafts follow it:
    (index of the marker's last draft, drafts, mask rows)."""
    out = []
    for drafts, rows in eng.windows:
        n = len(marker_ids)
        for i in range(n - 1, len(drafts) - 1):
            if drafts[i - n + 1:i + 1] == marker_ids:
                out.append((i, drafts, rows))
    return out


def row_allows(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@pytest.mark.parametrize("marker", ["one", "multi"])
def test_marker_inside_an_ngram_window_masks_only_the_drafts_after_it(scripted, tok, compiled,
                                                                     marker):
    """The prompt holds the thinking's continuation and a newline after the marker: the n-gram
    drafter copies across the marker; in that one window the rows up to the marker are free
    (they allow the newline and "}"), the rows after it are the grammar's, the copied newline
    is refused and the forced drafter goes on with the answer."""
    end = ["</think>"] if marker == "one" else ["</", "th", "ink", ">"]
    prompt = ids(["e", "}", "n", *end, "\n", "x", "<think>"])
    (off,), _ = generate_ids(scripted[marker], tok, compiled, [prompt], marker=marker)
    (on,), eng = generate_ids(scripted[marker], tok, compiled, [prompt], "ngram", marker=marker)
    assert on.output_ids == off.output_ids
    assert answer_is_grammatical(compiled, on)
    windows = crossing(eng, ids(end))
    assert windows, eng.windows
    i, drafts, rows = windows[0]
    assert drafts[i + 1] == ID["{"] and ID["\n"] not in drafts[i + 1:]
    assert all(row_allows(rows[j], ID["\n"]) and row_allows(rows[j], ID["}"])
               for j in range(i + 1))
    start = torch.empty((1, rows.shape[1]), dtype=torch.int32)
    compiled.new_matcher().fill_bitmask(start, 0)
    assert torch.equal(rows[i + 1], start[0])
    assert on.stats.accepted_tokens >= len(drafts) - 1


@pytest.mark.parametrize("marker", ["one", "multi"])
def test_budget_forced_marker_and_the_grammar_after_it_are_drafted_in_one_window(
        scripted, tok, compiled, marker):
    end = ["</think>"] if marker == "one" else ["</", "th", "ink", ">"]
    prompt = ids(["x", "<think>"])
    (off,), _ = generate_ids(scripted[marker], tok, compiled, [prompt], marker=marker, budget=2)
    (on,), eng = generate_ids(scripted[marker], tok, compiled, [prompt], "forced",
                              marker=marker, budget=2)
    assert off.output_ids == on.output_ids == ids(["m", "e", *end, "{", '"a', '": ', "7", "}"])
    assert on.matcher.reasoning_tokens == 2 and answer_is_grammatical(compiled, on)
    windows = crossing(eng, ids(end))
    assert windows and windows[0][1][:len(end) + 1] == ids([*end, "{"])
    assert on.stats.forced_tokens >= len(end) + 1


def test_opening_marker_is_forced_when_the_prompt_does_not_open_the_block(scripted, tok,
                                                                          compiled):
    (req,), _ = generate_ids(scripted["one"], tok, compiled, [ids(["x"])], "forced",
                             phase="opening")
    assert req.output_ids[:2] == ids(["<think>", "m"]) and answer_is_grammatical(compiled, req)


@pytest.mark.parametrize("budget", [0, 1, 4, 12])
def test_greedy_output_is_identical_with_speculation_on_and_off(tok, compiled, budget):
    """A random model thinks its own way (a budget ends it: it may never close on its own);
    with and without speculation the output is the same token for token, and every answer is
    grammatical."""
    model = tiny_llama(vocab_size=V, seed=3)
    prompts = [ids(p) for p in (["a", "b", "<think>"], ["x", "d", "xyz", "a", "<think>"],
                                ["m", "e", "n", "</", "th", "ink", ">", "<think>"])]
    runs = {spec: generate_ids(model, tok, compiled, prompts, spec, marker="multi",
                               budget=budget)[0] for spec in SPECS}
    for spec in ("forced", "ngram"):
        assert [r.output_ids for r in runs[spec]] == [r.output_ids for r in runs["off"]], spec
    for r in runs["ngram"]:
        assert r.finish_reason == "stop" and answer_is_grammatical(compiled, r)
        assert r.matcher.reasoning_tokens <= budget


class _Compiled:
    """What `exact_distribution` needs of a compiled spec: a reasoning matcher per walk."""

    def __init__(self, make):
        self.new_matcher = make


def test_speculative_sampling_preserves_the_distribution_across_the_marker(tok):
    """Thinking (two tokens at most, top-3 sampling, the model may close early), the forced
    marker and a one-digit answer: sequences sampled with speculation off and on both fit the
    exact distribution (chi-square, significance 0.001, fixed seeds)."""
    digit = compile_spec(normalize_schema(Regex("[0-9]")), tok)
    model = tiny_llama(vocab_size=V, seed=5)
    t = tables(tok)
    make = lambda: ReasoningMatcher(t, digit.new_matcher, max_reasoning_tokens=2,  # noqa: E731
                                    phase="thinking")
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=8)
    prompt = ids(["n", "e", "n", "m", "<think>"])  # the n-gram drafter copies "m" after "n"
    exact = exact_distribution(model, _Compiled(make), params, V, prompt)
    assert abs(sum(exact.values()) - 1.0) < 1e-4 and len(exact) > 10
    n = 500
    counts = {}
    for spec in ("off", "ngram"):
        reqs, _ = generate_ids(model, tok, digit, [prompt] * n, spec, budget=2, params=params)
        assert all(r.finish_reason == "stop" for r in reqs)
        counts[spec] = Counter(tuple(t for t in r.output_ids if t != EOS) for r in reqs)
        if spec == "ngram":  # it really drafted, and verification both accepted and rejected
            drafted = sum(r.stats.drafted_tokens for r in reqs)
            accepted = sum(r.stats.accepted_tokens for r in reqs)
            assert drafted > n // 2 and 0 < accepted < drafted
    assert gof(counts["off"], exact, n) > 1e-3
    assert gof(counts["ngram"], exact, n) > 1e-3


# -- the public API --------------------------------------------------------------------------
OPEN = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<think>\n{% endif %}")
CLOSED = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<think>\n\n</think>\n\n{% endif %}")


def think_loaded(template: str, edges: dict[tuple[str, str], float] | None = None):
    """A LoadedModel over a byte-level BPE with ``<think>`` / ``</think>`` tokens and a chat
    template: a tiny random Llama, or (``edges``) a bigram model {(token, next): logit}."""
    from constrained_spec.model.loading import load_model

    tok = byte_level_bpe()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    if edges is not None:
        return bigram_loaded(edges, tok)
    model = tiny_llama(vocab_size=len(tok) + 2, seed=1, max_positions=2048)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = cfg.eos_token_id = tok.eos_token_id
    return load_model((model, tok))


@pytest.fixture(scope="module")
def open_loaded():
    """A tiny random model whose template opens the block (``<think>\n``)."""
    return think_loaded(OPEN)


# thinks "abab..." (a loop) after the template's "<think>\n"; after "</think>": "c", then stop
LOOPING = {("Ċ", "a"): 5.0, ("a", "b"): 5.0, ("b", "a"): 5.0, ("</think>", "c"): 5.0,
           ("c", "<|endoftext|>"): 5.0}


def test_generator_detects_the_markers_and_returns_the_reasoning_apart(open_loaded):
    from constrained_spec import Generator

    loaded = open_loaded
    gen = Generator(loaded, schema=["yes", "no"], max_reasoning_tokens=5, max_tokens=40)
    assert gen.reasoning == ReasoningMarkers()
    result = gen("Is it?", return_result=True)
    assert result.value in ("yes", "no") and result.text == result.value
    assert isinstance(result.reasoning, str) and "think>" not in result.reasoning
    end = loaded.tokenizer.convert_tokens_to_ids("</think>")
    # the template opened the block: 5 thinking tokens, the forced marker, then the answer
    assert result.token_ids.index(end) == 5
    off = Generator(loaded, schema=["yes", "no"], reasoning=False, max_tokens=40)
    assert off.reasoning is None
    plain = off("Is it?", return_result=True)
    assert plain.reasoning is None and end not in plain.token_ids


def test_a_prompt_that_closed_the_block_is_answered_at_once():
    from constrained_spec import Generator

    loaded = think_loaded(CLOSED)
    result = Generator(loaded, schema=["yes", "no"], max_tokens=20)("Is it?", return_result=True)
    assert result.reasoning == "" and result.value in ("yes", "no")
    assert result.token_ids == loaded.tokenizer.encode(result.text, add_special_tokens=False)


def test_budget_ends_a_looping_reasoning_and_the_free_answer_follows():
    from constrained_spec import generate

    loaded = think_loaded(OPEN, LOOPING)
    result = generate(loaded, "go", max_reasoning_tokens=6, max_tokens=20, return_result=True)
    assert result.reasoning == "ababab" and result.value == result.text == "c"
    # per call: a budget of 0 is no thinking at all
    result = generate(loaded, "go", max_reasoning_tokens=0, max_tokens=20, return_result=True)
    assert result.reasoning == "" and result.value == "c"


def test_max_tokens_spent_on_reasoning_says_so():
    from constrained_spec import Generator
    from constrained_spec.errors import IncompleteOutputError

    gen = Generator(think_loaded(OPEN, LOOPING), max_tokens=20, max_retries=0)
    with pytest.raises(IncompleteOutputError, match="still reasoning: set max_reasoning_tokens"):
        gen("go")
    assert gen("go", max_reasoning_tokens=4) == "c"


def test_a_reasoning_loop_without_budget_is_a_repetition_loop_with_the_whole_output():
    from constrained_spec import Generator
    from constrained_spec.errors import RepetitionLoopError

    gen = Generator(think_loaded(OPEN, LOOPING), max_tokens=300, max_retries=1)
    with pytest.raises(RepetitionLoopError) as info:
        gen("go")
    err = info.value
    assert err.attempts == 2 and err.partial_text.startswith("abababab")
    assert len(err.token_ids) < 300  # stopped early, not at max_tokens


def test_reasoning_options_are_checked(open_loaded):
    from constrained_spec import Generator

    with pytest.raises(ConfigError, match="max_reasoning_tokens"):
        Generator(open_loaded, max_reasoning_tokens=-1)
    gen = Generator(open_loaded, schema=["yes"])
    with pytest.raises(ConfigError, match="reasoning"):
        gen.make_request("x", reasoning="maybe")
    req, _ = gen.make_request("x", reasoning=False)
    assert not isinstance(req.matcher, ReasoningMatcher)


def test_split_reasoning_without_a_reasoning_matcher_is_the_whole_text():
    assert split_reasoning(None, [1, 2], None, "text") == (None, "text")


# -- on vLLM's engine: the whole output as one structural tag ------------------------------
def _tag_matcher(tok, matcher):
    """xgrammar's matcher over `vllm_engine.reasoning_tag` of ``matcher`` (what vLLM runs)."""
    import json

    import xgrammar

    from constrained_spec.generation.vllm_engine import reasoning_tag
    from constrained_spec.grammar.compile import _xgrammar_compiler

    tag = json.dumps(reasoning_tag(matcher))
    return xgrammar.GrammarMatcher(_xgrammar_compiler(tok).compile_structural_tag(tag))


def _tag_allowed(xm, vocab: int = V) -> set[int]:
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab)
    xm.fill_next_token_bitmask(mask)
    return {t for t in range(vocab) if (int(mask[0, t >> 5]) >> (t & 31)) & 1}


@pytest.mark.parametrize("phase", ["opening", "thinking", "answer"])
@pytest.mark.parametrize("budget", [None, 0, 3])
@pytest.mark.parametrize("answer", ["grammar", "free"])
def test_vllm_structural_tag_allows_exactly_what_our_matcher_allows(tok, compiled, phase, budget,
                                                                   answer):
    # vLLM masks with the tag, our side commits every token it emits into our matcher: the two
    # must allow the same tokens at every step (stop tokens: xgrammar offers them where the
    # output may end, ours where it has ended), along seeded random walks through each phase
    import random

    t = ReasoningTables(tok, ids(["<think>"]), ids(["</think>"]), b"</think>", match_text=False)
    inner = compiled if answer == "grammar" else None
    for seed in range(6):
        ours = ReasoningMatcher(t, inner.new_matcher if inner else None, max_reasoning_tokens=budget,
                                phase=phase, source=inner)
        theirs = _tag_matcher(tok, ours)
        rng = random.Random(seed)
        for _ in range(40):
            a, b = allowed(ours), _tag_allowed(theirs)
            assert a - {EOS} == b - {EOS}, (seed, ours.phase)
            if EOS in b:
                assert ours.phase == "answer"
            choices = sorted(a - {EOS}) or sorted(a)
            if not choices:
                break
            # lean towards the end marker so that walks reach the answer
            token = ID["</think>"] if ID["</think>"] in choices and rng.random() < 0.2 else rng.choice(choices)
            assert ours.accept(token) and theirs.accept_token(token)
            if ours.is_terminated():
                break


def test_vllm_mode_closes_only_on_the_marker_token_not_on_its_spelling(tok, compiled):
    t = ReasoningTables(tok, ids(["<think>"]), ids(["</think>"]), b"</think>", match_text=False)
    m = ReasoningMatcher(t, compiled.new_matcher, phase="thinking", source=compiled)
    feed(m, ["</", "th", "ink", ">"])  # the text, spelled: still thinking
    assert m.phase == "thinking" and ID["k>{"] in allowed(m)  # nothing runs past a text marker
    feed(m, ["</think>"])
    assert m.phase == "answer" and m.markers == ("<think>", "</think>")


def test_a_started_or_text_matching_reasoning_matcher_is_refused_by_the_vllm_engine(tok, compiled):
    from constrained_spec.generation.vllm_engine import reasoning_tag

    by_text = ReasoningMatcher(tables(tok), compiled.new_matcher, phase="thinking", source=compiled)
    with pytest.raises(ConfigError, match="reasoning"):
        reasoning_tag(by_text)
    t = ReasoningTables(tok, ids(["<think>"]), ids(["</think>"]), b"</think>", match_text=False)
    started = ReasoningMatcher(t, compiled.new_matcher, phase="thinking", source=compiled)
    feed(started, ["a"])
    with pytest.raises(ConfigError, match="fresh"):
        reasoning_tag(started)


# Qwen3's pattern: enable_thinking=False renders a closed think block
SWITCHED = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_switch_the_reasoning_phase():
    from constrained_spec import Generator

    loaded = think_loaded(SWITCHED)
    gen = Generator(loaded, schema=["yes", "no"], max_tokens=20, max_reasoning_tokens=3)
    thinking, _ = gen.make_request("Is it?")
    closed, _ = gen.make_request("Is it?", chat_template_kwargs={"enable_thinking": False})
    assert not loaded.tokenizer.decode(thinking.prompt_ids).rstrip().endswith("</think>")
    assert loaded.tokenizer.decode(closed.prompt_ids).rstrip().endswith("</think>")
    assert thinking.matcher.phase == "thinking" and closed.matcher.phase == "answer"
    result = gen("Is it?", return_result=True, chat_template_kwargs={"enable_thinking": False})
    assert result.reasoning == "" and result.value in ("yes", "no")
    with pytest.raises(ConfigError) as err:
        gen.make_request("Is it?", chat_template_kwargs={"tools": []})
    assert err.value.option == "chat_template_kwargs"
