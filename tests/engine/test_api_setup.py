"""What a Generator loads once and what is per call, and the one retry policy, on the tiny Llama.

- the drafter is built once per model and speculative config: ``generate()`` in a loop and
  every Generator over the model share it; another config gets its own;
- ``report`` stays the Generator's own schema's when a call brings its own schema, and the
  pre-flight mode can be set per call;
- :class:`RetryPolicy`: any finish other than stop, error or cancelled is an incomplete output
  and a failed attempt (a future finish reason included), run again with seed + k; a call
  that does not set ``max_retries`` gets two retries, none while streaming;
- the keywords build one option object per group (sampling, schema, retries, reasoning),
  each checked on construction with the keyword's name in its error.
"""

from __future__ import annotations

import gc
import warnings

import pytest

import constrained_spec.api as api
from constrained_spec import ConfigError, Generator, IncompleteOutputError, SchemaError, generate
from constrained_spec.api import RetryPolicy, SchemaOptions
from constrained_spec.config import SamplingParams, SpeculativeConfig, check_count
from constrained_spec.frontend.reasoning import ReasoningMarkers, ReasoningOptions
from constrained_spec.model.loading import load_model
from constrained_spec.schemas import JsonLayout

CHOICES = ["red", "green", "blue"]
# "uniqueItems" is a keyword the grammar ignores: strict refuses it, default warns
IGNORED = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.fixture
def constructions(monkeypatch):
    """Counts the drafters built (``make_drafter`` calls that build one)."""
    built: list[object] = []
    real = api.make_drafter

    def counting(config, model):
        drafter = real(config, model)
        built.append(drafter)
        return drafter

    monkeypatch.setattr(api, "make_drafter", counting)
    return built


def fresh_config(lookup: int, **fields) -> SpeculativeConfig:
    # a config no other test uses (one ``lookup`` per test): the tiny model is shared by the
    # session, and so is its drafter cache
    return SpeculativeConfig(method="ngram", prompt_lookup_max=lookup, prompt_lookup_min=2, **fields)


def test_generate_twice_on_the_same_model_builds_the_drafter_once(tiny_loaded, constructions):
    for _ in range(2):
        out = generate(tiny_loaded, "Pick a colour.", schema=CHOICES, max_tokens=8,
                       speculative=fresh_config(3))
        assert out in CHOICES
    assert len(constructions) == 1


def test_generators_share_the_drafter_of_an_equal_config_only(tiny_loaded, constructions):
    a = Generator(tiny_loaded, schema=CHOICES, speculative=fresh_config(5))
    b = Generator(tiny_loaded, schema={"type": "integer"}, schema_mode="lenient",
                  speculative=fresh_config(5), max_tokens=4)
    other = Generator(tiny_loaded, speculative=fresh_config(5, num_speculative_tokens=2))
    assert a.drafter is b.drafter is not None
    assert other.drafter is not a.drafter
    assert len(constructions) == 2
    assert Generator(tiny_loaded, speculative=False).drafter is None


def test_a_model_s_drafters_go_with_the_model(tiny_loaded):
    # a new LoadedModel over the same weights: its own drafters, dropped when it is
    fresh = load_model((tiny_loaded.model, tiny_loaded.tokenizer))
    assert fresh is not tiny_loaded
    config = fresh_config(9)
    drafter = api.shared_drafter(fresh, config)
    assert drafter is not None and api.shared_drafter(fresh, config) is drafter
    assert api.shared_drafter(tiny_loaded, config) is not drafter
    key = id(fresh)
    assert key in api._drafters._by_model
    del fresh
    gc.collect()
    assert key not in api._drafters._by_model


def test_report_stays_the_generators_own_when_a_call_brings_another_schema(tiny_loaded):
    gen = Generator(tiny_loaded, schema={"type": "object", "properties": {"a": {"type": "string"}},
                                         "required": ["a"]},
                    max_string_length=5, speculative=False)
    before = [b.format() for b in gen.report.added_bounds]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen.make_request("x", schema=IGNORED)
    assert [b.format() for b in gen.report.added_bounds] == before and before
    assert gen.report.ok
    assert Generator(tiny_loaded, speculative=False).report is None  # free text: no report


def test_schema_mode_is_a_per_call_option(tiny_loaded):
    gen = Generator(tiny_loaded, speculative=False)
    with pytest.warns(Warning):
        gen.make_request("x", schema=IGNORED)  # the Generator's mode: default warns
    with pytest.raises(SchemaError, match="uniqueItems"):
        gen.make_request("x", schema=IGNORED, schema_mode="strict")
    with pytest.warns(Warning):
        lenient = Generator(tiny_loaded, schema=IGNORED, schema_mode="lenient", speculative=False)
    with pytest.raises(SchemaError, match="uniqueItems"):
        lenient.make_request("x", schema_mode="strict")  # its own schema, checked again
    with pytest.raises(ConfigError, match="schema_mode"):
        gen.make_request("x", schema_mode="loose")


def test_an_unknown_finish_reason_is_an_incomplete_output_and_a_failed_attempt(tiny_loaded):
    gen = Generator(tiny_loaded, schema=CHOICES, speculative=False)
    req, spec = gen.make_request("Pick a colour.")
    req.output_ids, req.finish_reason = [5, 6], "loop"
    result = gen.finalize(req, spec)
    assert isinstance(result, IncompleteOutputError)
    assert "loop" in str(result) and result.token_ids == [5, 6]
    assert RetryPolicy.failed(result)
    req.finish_reason = "cancelled"
    assert not RetryPolicy.failed(gen.finalize(req, spec))


def test_batch_retries_an_attempt_that_ended_for_an_unknown_reason(tiny_loaded, monkeypatch):
    gen = Generator(tiny_loaded, schema=CHOICES, speculative=False, max_tokens=8)
    real = gen.new_engine
    runs: list[list[int]] = []

    class FirstRunLoops:
        """The first run's requests end with a finish reason the library does not know."""

        def run(self, requests):
            done = real().run(requests)
            runs.append([r.params.seed for r in requests])
            if len(runs) == 1:
                for r in requests:
                    r.finish_reason = "loop"
            return done

    monkeypatch.setattr(gen, "new_engine", FirstRunLoops)
    res = gen("Pick a colour.", max_retries=2, seed=10, return_result=True)
    assert res.value in CHOICES and res.attempts == 2
    assert runs == [[10], [11]]  # retry 1: seed + 1
    runs.clear()
    with pytest.raises(IncompleteOutputError, match="loop"):
        gen("Pick a colour.", max_retries=0)  # retries off: the incomplete output is raised


def test_retry_policy_options_sample_greedy_calls_and_step_the_seed():
    policy = RetryPolicy(2, temperature=0.5)
    greedy = SamplingParams()
    assert policy.options({"max_tokens": 9}, 0, greedy) == {"max_tokens": 9}
    assert policy.options({"max_tokens": 9}, 1, greedy) == {"max_tokens": 9, "temperature": 0.5,
                                                           "seed": api.DEFAULT_RETRY_SEED + 1}
    assert policy.options({"seed": 7, "temperature": 0.9}, 2, greedy) == {"seed": 9,
                                                                           "temperature": 0.9}
    with pytest.raises(ConfigError, match="max_retries"):
        RetryPolicy(-1)
    with pytest.raises(ConfigError, match="retry_temperature"):
        RetryPolicy(1, temperature=0.0)


def test_retry_policy_resolve_defaults_to_two_retries_and_none_while_streaming():
    assert api.DEFAULT_MAX_RETRIES == 2 and RetryPolicy().max_retries == 2
    assert RetryPolicy.resolve(None).max_retries == api.DEFAULT_MAX_RETRIES
    assert RetryPolicy.resolve(None, streaming=True).max_retries == 0
    assert RetryPolicy.resolve(0, streaming=True).max_retries == 0
    assert RetryPolicy.resolve(3, 0.5) == RetryPolicy(3, 0.5)
    with pytest.raises(ConfigError, match="streaming") as info:
        RetryPolicy.resolve(1, streaming=True)
    assert info.value.option == "max_retries"
    with pytest.raises(ConfigError, match="max_retries"):
        RetryPolicy.resolve(-1)


def test_attempts_rerun_only_the_failed_items_and_stop_when_retries_run_out():
    attempts = RetryPolicy(2).attempts(range(3))
    seen = []
    for attempt, todo in attempts:
        seen.append((attempt, todo))
        for i in todo:
            ok = i == 0 or (i == 1 and attempt == 1)
            attempts.record(i, "value" if ok else IncompleteOutputError("x", partial_text=""))
    assert seen == [(0, [0, 1, 2]), (1, [1, 2]), (2, [2])]


def test_the_keywords_build_one_option_object_per_group(tiny_loaded):
    gen = Generator(tiny_loaded, schema=CHOICES, speculative=False, max_tokens=9, top_k=3,
                    max_items=4, layout={"indent": 2}, max_retries=1, retry_temperature=0.5,
                    reasoning=False, max_reasoning_tokens=7)
    assert gen.sampling == SamplingParams(max_tokens=9, top_k=3)
    assert gen.schema_options == SchemaOptions(max_items=4, layout=JsonLayout(indent=2))
    assert gen.retries == RetryPolicy(1, 0.5)
    assert gen.reasoning_options == ReasoningOptions(False, 7) and gen.reasoning is None
    plain = Generator(tiny_loaded, speculative=False)
    assert plain.schema_options == SchemaOptions() and plain.schema_options.layout == api.DEFAULT_LAYOUT
    assert plain.retries == RetryPolicy(None) and plain.retries.retries == api.DEFAULT_MAX_RETRIES
    assert plain.sampling == SamplingParams() and plain.reasoning_options == ReasoningOptions()


@pytest.mark.parametrize("make, option", [
    (lambda: SchemaOptions(backend="llguidance"), "backend"),  # type: ignore[arg-type]
    (lambda: SchemaOptions(schema_mode="loose"), "schema_mode"),  # type: ignore[arg-type]
    (lambda: SchemaOptions(layout="pretty"), "layout"),  # type: ignore[arg-type]
    (lambda: SchemaOptions(system_prompt=5), "system_prompt"),  # type: ignore[arg-type]
    (lambda: SchemaOptions(system_prompt="a \ud800"), "system_prompt"),
    (lambda: SchemaOptions(max_string_length=0), "max_string_length"),
    (lambda: SchemaOptions(max_items=True), "max_items"),
    (lambda: ReasoningOptions("sometimes"), "reasoning"),  # type: ignore[arg-type]
    (lambda: ReasoningOptions(max_reasoning_tokens=-1), "max_reasoning_tokens"),
    (lambda: RetryPolicy(1.5), "max_retries"),  # type: ignore[arg-type]
    (lambda: RetryPolicy(temperature=float("nan")), "retry_temperature"),
    (lambda: check_count(0, "max_batch_size", minimum=1), "max_batch_size"),
    (lambda: check_count(None, "max_batch_size", minimum=1), "max_batch_size"),
])
def test_option_objects_check_their_fields_on_construction(make, option):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.option == option


def test_option_objects_resolve_what_was_left_unset():
    assert SchemaOptions(layout={"indent": 2, "separators": [",", ": "]}).layout == JsonLayout(indent=2)
    assert SchemaOptions(layout=None).layout == api.DEFAULT_LAYOUT
    assert check_count(None, "max_items", minimum=1, allow_none=True) is None
    unset = RetryPolicy(None, 0.5)
    assert unset.for_call() == RetryPolicy(api.DEFAULT_MAX_RETRIES, 0.5)
    assert unset.for_call(streaming=True) == RetryPolicy(0, 0.5)
    assert RetryPolicy(0).for_call(streaming=True) == RetryPolicy(0)
    with pytest.raises(ConfigError, match="streaming"):
        RetryPolicy(1).for_call(streaming=True)
    assert ReasoningOptions(ReasoningMarkers("[T]", "[/T]")).markers(None) == ReasoningMarkers("[T]", "[/T]")
    assert ReasoningOptions(False).markers(None) is None
