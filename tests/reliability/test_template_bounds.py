"""Chat templates render within a time and a size bound (`constrained_spec.frontend.render`):
a template that loops over a template variable or the messages' text ends with a typed error
at the time bound, one that builds a huge text is stopped while it builds it, a normal template
renders as transformers renders it, and renders on several threads at once are each bounded
by their own deadline. The loops here would run for hours (10^15 steps; 10^10 take minutes)
and the bounds are made small for the tests, so a test that ends at all shows the bound held."""

from __future__ import annotations

import threading
import time

import pytest
from cs_testlib import byte_level_bpe

from constrained_spec.errors import ConfigError, PromptTooLongError
from constrained_spec.frontend import render
from constrained_spec.frontend.prompts import encode_prompt
from constrained_spec.frontend.render import render_chat_template
from constrained_spec.frontend.tools import ToolSet

HEAD = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if tools %}<tools>{{ tools | tojson }}</tools> (calls in <tool_call>){% endif %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# n^3 steps that write nothing: only the time bound stops them
SPIN = ("{% for i in range(spin or 0) %}{% for j in range(spin) %}{% for k in range(spin) %}"
        "{% endfor %}{% endfor %}{% endfor %}")
# m^3 steps over the first message's text (no template variable needed)
CUBE = ("{% if cube %}{% set t = messages[0].content %}{% for a in t %}{% for b in t %}"
        "{% for c in t %}{% endfor %}{% endfor %}{% endfor %}{% endif %}")
# k^2 copies of pad, in the output, in a {% set %} block, in a macro's text
GROW = ("{% for i in range(grow or 0) %}{% for j in range(grow) %}{{ pad }}{% endfor %}{% endfor %}"
        "{% if held %}{% set s %}{% for i in range(held) %}{% for j in range(held) %}{{ pad }}"
        "{% endfor %}{% endfor %}{% endset %}{{ s | length }}{% endif %}"
        "{% macro copies(k) %}{% for i in range(k) %}{% for j in range(k) %}{{ pad }}{% endfor %}"
        "{% endfor %}{% endmacro %}{% if macro %}{{ copies(macro) | length }}{% endif %}")
HOURS = 100_000  # range()'s largest (Jinja's sandbox): 10^15 steps in SPIN
PAD = "x" * 1000
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE whose template loops as its variables say."""
    t = byte_level_bpe()
    t.chat_template = HEAD + SPIN + CUBE + GROW
    return t


@pytest.fixture
def bound(monkeypatch):
    """Sets the time bound for the test (seconds)."""
    def set_bound(seconds: float) -> None:
        monkeypatch.setattr(render, "RENDER_TIMEOUT_S", seconds)
    return set_bound


def test_a_loop_driven_by_a_template_variable_ends_at_the_time_bound_naming_it(tok, bound):
    bound(0.2)
    began = time.monotonic()
    with pytest.raises(ConfigError) as err:
        encode_prompt(tok, USER, None, template_kwargs={"spin": HOURS})
    assert err.value.option == "chat_template_kwargs"
    assert "took longer than 0.2 s to render" in str(err.value)
    assert "chat_template_kwargs" in str(err.value) and "messages" in str(err.value)
    # it began the loop (the bound, not a check, ended it), and ended hours before the loop would
    assert 0.2 <= time.monotonic() - began < 60
    assert not render._WATCHDOG._watches


def test_a_loop_over_the_messages_text_ends_at_the_time_bound_naming_the_prompt(bound):
    bound(0.2)
    text = "y" * 100_000  # 10^15 steps
    # a template that always loops over the text: the request sends no template variable
    cube_tok = byte_level_bpe()
    cube_tok.chat_template = "{% set cube = true %}" + CUBE + HEAD
    with pytest.raises(ConfigError, match="took longer than 0.2 s") as err:
        encode_prompt(cube_tok, [{"role": "user", "content": text}], None)
    assert err.value.option == "prompt"


@pytest.mark.parametrize("variable, pad", [("grow", PAD), ("held", PAD), ("macro", PAD),
                                           ("held", "")])  # 10^10 empty pieces: 80 GB of list
def test_a_template_building_a_huge_text_is_stopped_while_it_builds_it(tok, bound, variable, pad):
    bound(600)  # only the size bound can end it within the test
    with pytest.raises(PromptTooLongError) as err:  # 10^13 characters, refused at 64,000
        encode_prompt(tok, USER, None, context=1000, template_kwargs={variable: HOURS, "pad": pad})
    assert "rendered more than 64,000 characters" in str(err.value)
    assert "context of 1,000 tokens" in str(err.value) and err.value.option == "prompt"


def test_without_a_context_the_fixed_size_limit_applies(tok, bound, monkeypatch):
    bound(600)
    monkeypatch.setattr(render, "RENDER_MAX_CHARS", 50_000)
    with pytest.raises(ConfigError, match="more than 50,000 characters") as err:
        encode_prompt(tok, USER, None, template_kwargs={"grow": HOURS, "pad": PAD})
    assert not isinstance(err.value, PromptTooLongError)  # no context to be too long for
    assert err.value.option == "chat_template_kwargs"


class _OwnRenderer:
    """A tokenizer that renders its template itself (not through transformers' Jinja)."""

    chat_template = "its own"

    def __init__(self, size: int) -> None:
        self.size = size

    def apply_chat_template(self, messages, **kwargs) -> str:
        return "z" * self.size


def test_a_tokenizer_rendering_otherwise_is_measured_after_rendering():
    limit = render.render_char_limit(100)
    assert render_chat_template(_OwnRenderer(limit), USER, context=100) == "z" * limit
    with pytest.raises(PromptTooLongError, match=f"more than {limit:,} characters"):
        render_chat_template(_OwnRenderer(limit + 1), USER, context=100)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_normal_template_renders_as_transformers_renders_it(tok, tools):
    messages = [{"role": "system", "content": "be brief"}, *USER,
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    toolset = ToolSet(tools, "auto") if tools else None
    offered = [t.openai() for t in toolset.offered] if toolset else None
    direct = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                     **({"tools": offered} if offered else {}))
    assert render_chat_template(tok, messages, offered, context=2048) == direct
    assert encode_prompt(tok, messages, None, False, context=2048, tools=toolset) == \
        tok.encode(direct, add_special_tokens=False)


def test_outside_a_bounded_render_the_same_template_renders_unlimited(tok):
    encode_prompt(tok, USER, None, context=1000)  # the template's environment counts from now on
    # the caller's own render of the same template: no limit of ours applies
    text = tok.apply_chat_template(USER, tokenize=False, grow=40, pad=PAD)
    assert len(text) > render.render_char_limit(1000)


def _outcome(tok, kwargs: dict, out: dict, name: str) -> None:
    began = time.monotonic()
    try:
        out[name] = encode_prompt(tok, USER, None, template_kwargs=kwargs)
    except ConfigError as e:
        out[name] = e
    out[name + " took"] = time.monotonic() - began


def test_renders_on_several_threads_are_each_bounded_by_their_own_deadline(tok, bound):
    bound(0.6)
    out: dict = {}
    spinners = [threading.Thread(target=_outcome, args=(tok, {"spin": HOURS}, out, f"spin{i}"))
                for i in range(3)]
    for thread in spinners:  # started 0.2 s apart: a deadline is its own render's, no other's
        thread.start()
        time.sleep(0.2)
    # meanwhile a normal render on another thread, and on this one, go through
    _outcome(tok, {}, out, "plain")
    normal = threading.Thread(target=_outcome, args=(tok, {}, out, "plain2"))
    normal.start()
    for thread in [*spinners, normal]:
        thread.join(60)
        assert not thread.is_alive()
    expected = encode_prompt(tok, USER, None)
    assert out["plain"] == out["plain2"] == expected
    for i in range(3):
        assert isinstance(out[f"spin{i}"], ConfigError), out[f"spin{i}"]
        assert "took longer than 0.6 s" in str(out[f"spin{i}"])
        assert out[f"spin{i} took"] >= 0.6  # never ended by an earlier thread's deadline
    assert not render._WATCHDOG._watches


def test_a_deadline_falling_as_the_render_ends_never_surfaces_after_it(tok, bound):
    # renders from far shorter to far longer than the bound, those about as long in small
    # steps: some end just before the interrupt, some just after, some as it is sent; after
    # each, nothing may be raised in the code that follows
    bound(0.003)
    outcomes = set()
    for n in [round(15 * 1.07 ** i) for i in range(35)] * 3:  # 3,375 to 2.7 million steps
        try:
            encode_prompt(tok, USER, None, template_kwargs={"spin": n})
            outcomes.add("rendered")
        except ConfigError:
            outcomes.add("timed out")
        for _ in range(2000):  # bytecode boundaries where a stray interrupt would land
            pass
        time.sleep(0.001)
    assert outcomes == {"rendered", "timed out"}
    assert not render._WATCHDOG._watches


def test_the_limits_are_documented():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    for name in ("RENDER_TIMEOUT_S", "RENDER_CHARS_PER_TOKEN", "RENDER_MAX_CHARS"):
        assert name in text
