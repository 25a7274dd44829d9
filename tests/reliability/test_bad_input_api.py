"""Bad input through the public API: every mistake is a typed error that names what and where,
raised before the model is loaded (schema, options) or before any model compute (prompt), and
the same Generator keeps serving good requests afterwards."""

from __future__ import annotations

import json
import math

import pytest

from constrained_spec import (
    ConfigError,
    Generator,
    IncompleteOutputError,
    OutputValidationError,
    PromptTooLongError,
    Regex,
    SchemaError,
    SpeculativeConfig,
    generate,
)
from constrained_spec.schemas import normalize_schema, parse_output
from constrained_spec.schemas.spec import MAX_SCHEMA_DEPTH, MAX_SCHEMA_VALUES


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


TREE = {"type": "object", "properties": {"v": {"type": "integer"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v", "kids"]}

# (schema, what the message says, the pointer the error carries or None)
BAD_SCHEMAS = {
    "malformed JSON text": ('{"type": "object", ', "malformed JSON Schema text", None),
    "JSON array, not a schema": ("[1, 2]", "not a JSON Schema object", ""),
    "JSON number, not a schema": ("42", "not a JSON Schema object", ""),
    "plain text, not JSON": ("name and age", "not a schema", None),
    "type is not a type": ({"type": 5}, "invalid JSON Schema", "/type"),
    "required is not a list": ({"type": "object", "required": "a"}, "invalid JSON Schema",
                               "/required"),
    "unknown $ref": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}},
                     "points nowhere", "/properties/a/$ref"),
    "remote $ref": ({"$ref": "https://example.com/s.json"}, "not a local JSON pointer", "/$ref"),
    "$ref cycle without content": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                    "$ref": "#/$defs/a"}, "Circular $ref", None),
    "nested past the depth limit": (nested(MAX_SCHEMA_DEPTH), f"deeper than {MAX_SCHEMA_DEPTH}",
                                    "/properties/a/properties/a"),
    "deeply nested JSON text": ('{"a":' * 5000 + "1" + "}" * 5000, "nests deeper", ""),
    "10k properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                         for i in range(10_000)}},
                       f"more than {MAX_SCHEMA_VALUES:,} JSON values", "/properties"),
    "huge enum": ({"enum": list(range(20_000))}, "JSON values", "/enum"),
    "invalid regex": (Regex("(ab"), "invalid regular expression", None),
    "invalid pattern": ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}},
                        "invalid regular expression", "/properties/a/pattern"),
    "pattern Python cannot run": ({"type": "string", "pattern": "\\p{L}+"},
                                  "invalid regular expression", "/pattern"),
    "look-behind pattern": ({"type": "string", "pattern": "(?<=a)b"}, "look-behind", "/pattern"),
    "integer minimum past 64 bits": ({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 2 ** 70}}}, "64-bit", "/properties/n/minimum"),
    "integer maximum below -2**63": ({"type": "integer", "maximum": -1e30}, "64-bit", "/maximum"),
    "NaN bound": ({"type": "number", "minimum": math.nan}, "not a JSON number", "/minimum"),
    "infinite bound": ({"type": "number", "maximum": math.inf}, "not a JSON number", "/maximum"),
    "a set in the schema": ({"enum": {"a", "b"}}, "not a JSON value", "/enum"),
    "non-string key": ({"properties": {1: {}}}, "keys must be strings", "/properties"),
    "lone surrogate in a property name": ({"type": "object", "properties": {"a\ud800": {}}},
                                          "lone surrogate", "/properties"),
    "lone surrogate in an enum value": ({"enum": ["ok", "x\udcff"]}, "lone surrogate", "/enum/1"),
    "escaped lone surrogate in JSON text": ('{"enum": ["\\ud800"]}', "lone surrogate", "/enum/0"),
    "lone surrogate in a regex": (Regex("a\udc80+"), "lone surrogate", None),
    "lone surrogate in a choice": (["yes", "n\ud83do"], "lone surrogate", None),
    "empty choices": ([], "at least one choice", None),
    "duplicate choices": (["a", "a"], "both are written", None),
    "unsupported input type": (3.5, "unsupported schema input", None),
}


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything tries to load a model."""
    def load(*a, **k):
        raise AssertionError("a model was loaded for bad input")

    monkeypatch.setattr("constrained_spec.api.load_model", load)
    monkeypatch.setattr("constrained_spec.model.loading.load_model", load)


@pytest.mark.parametrize("name", list(BAD_SCHEMAS))
def test_bad_schema_is_a_schema_error_naming_where_before_loading_a_model(name, no_model):
    schema, message, pointer = BAD_SCHEMAS[name]
    with pytest.raises(SchemaError) as info:
        Generator(None, schema=schema)
    assert message in str(info.value)
    if pointer is not None:
        assert info.value.pointer is not None and info.value.pointer.startswith(pointer)
    with pytest.raises(SchemaError):
        generate(None, "a prompt", schema=schema)


@pytest.mark.parametrize("options, option", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2 ** 63}, "seed"),  # a 64-bit generator seed: past it torch overflows
    ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"seed": 10 ** 30}, "seed"),
    ({"speculative": {"method": "ngram", "max_forced_tokens": 10 ** 9}},
     "speculative.max_forced_tokens"),  # was a bogus PromptTooLongError
    ({"speculative": {"method": "ngram", "max_forced_tokens": -1}}, "speculative.max_forced_tokens"),
    ({"speculative": {"method": "ngram", "prompt_lookup_max": 10 ** 6}},
     "speculative.prompt_lookup_min"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"speculative": "medusa"}, "speculative.method"),
    ({"speculative": {"method": "medusa"}}, "speculative.method"),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 99}},
     "speculative.num_speculative_tokens"),
    ({"speculative": {"methd": "ngram"}}, "speculative-config"),
    ({"speculative": 3}, "speculative"),
    ({"backend": "llguidance"}, "backend"),
])
def test_bad_option_is_a_config_error_naming_the_option_before_loading_a_model(options, option, no_model):
    with pytest.raises(ConfigError) as info:
        Generator(None, schema={"type": "string"}, **options)
    assert info.value.option == option


def test_unknown_speculative_method_fails_in_its_config_object():
    with pytest.raises(ConfigError, match="unknown method 'medusa'"):
        SpeculativeConfig(method="medusa")


def test_recursive_schemas_compile_and_unbounded_output_depth_is_a_typed_error(ascii_tok):
    """Recursion through $ref is supported (xgrammar's grammar is recursive); the depth limit
    is on the schema document (MAX_SCHEMA_DEPTH levels). An output nested past what Python
    can validate (its recursion limit) is an OutputValidationError, not a RecursionError."""
    from constrained_spec.grammar import compile_spec

    spec = normalize_schema(TREE)
    matcher = compile_spec(spec, ascii_tok).new_matcher()
    assert matcher.accepts_text('{"v": 1, "kids": [{"v": 2, "kids": []}]}')
    normalize_schema(nested(MAX_SCHEMA_DEPTH // 2 - 1))  # within the limit
    deep = {"type": "array", "items": {"$ref": "#"}}
    text = "[" * 5000 + "]" * 5000
    with pytest.raises(OutputValidationError, match="nests too deeply"):
        parse_output(normalize_schema(deep), text)


@pytest.mark.parametrize("prompt, match", [
    ("hi \ud800 there", "lone surrogate"),
    ([{"role": "user", "content": "a\udcff"}], "lone surrogate"),
    ([{"role": "user", "content": None}], "content must be a string"),
    ([{"role": "user", "content": 42}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([{"role": None, "content": "hi"}], "role must be a string"),
])
def test_prompts_that_are_not_text_are_config_errors_before_any_compute(tiny_loaded, prompt, match):
    gen = Generator(tiny_loaded, schema=["a", "b"], speculative=False, max_tokens=4)
    with pytest.raises(ConfigError, match=match) as info:
        gen.make_request(prompt)
    assert info.value.option == "prompt"
    assert "\ud800" not in str(info.value) and "\udcff" not in str(info.value)
    out = gen.batch([prompt, "Say a."])  # one bad prompt does not end the batch
    assert isinstance(out[0], ConfigError) and out[1] in ("a", "b")


def test_text_parts_are_joined_and_a_bad_system_prompt_is_refused(tiny_loaded):
    gen = Generator(tiny_loaded, schema=["a", "b"], speculative=False, max_tokens=4)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "},
                                          {"type": "text", "text": "a."}]}]
    joined = [{"role": "user", "content": "Say a."}]
    assert gen.make_request(parts)[0].prompt_ids == gen.make_request(joined)[0].prompt_ids
    with pytest.raises(ConfigError, match="lone surrogate") as info:
        Generator(tiny_loaded, schema=["a", "b"], system_prompt="Be \ud800 brief")
    assert info.value.option == "system_prompt"


def test_layout_and_mode_mistakes_are_typed(no_model):
    from constrained_spec.schemas import JsonLayout

    with pytest.raises(SchemaError, match="separators"):
        JsonLayout(separators=(";", "="))
    # a bad mode is a bad option (as in a call), named before the schema is looked at
    with pytest.raises(ConfigError, match="mode") as info:
        Generator(None, schema={"type": "string"}, schema_mode="loose")
    assert info.value.option == "schema_mode"


# -- with the embedded model: prompts, and serving on after errors ------------------------------

@pytest.fixture(scope="module")
def gen(embedded):
    return Generator(embedded, schema=["yes", "no"], max_tokens=8)


@pytest.fixture
def engine_spy(monkeypatch):
    """Records the requests each engine run gets (none may reach it for a bad prompt)."""
    from constrained_spec.generation.engine import Engine

    seen: list[int] = []
    original = Engine.run

    def run(self, requests):
        requests = list(requests)
        seen.append(len(requests))
        return original(self, requests)

    monkeypatch.setattr(Engine, "run", run)
    return seen


@pytest.mark.model
def test_over_long_prompt_fails_before_any_model_compute(gen, engine_spy):
    limit = gen.model.max_context
    with pytest.raises(PromptTooLongError) as info:
        gen("word " * (limit + 10))
    assert info.value.option == "prompt" and str(limit) in str(info.value)
    assert engine_spy == [0]  # the engine ran with no request at all


@pytest.mark.model
@pytest.mark.parametrize("prompt, match", [("", "empty"), ("   \n", "empty"), (42, "a prompt is"),
                                           ([{"role": "system", "content": "x"}], "no user message")])
def test_empty_or_malformed_prompt_is_a_config_error(gen, engine_spy, prompt, match):
    with pytest.raises(ConfigError, match=match) as info:
        gen(prompt)
    assert info.value.option == "prompt"
    assert engine_spy == [0]


@pytest.mark.model
def test_bad_per_call_options_are_config_errors(gen):
    with pytest.raises(ConfigError, match="max_tokens"):
        gen("Is water wet?", max_tokens=0)
    with pytest.raises(ConfigError, match="temperature"):
        gen("Is water wet?", temperature=math.nan)


@pytest.mark.model
def test_a_batch_with_bad_items_serves_the_good_ones(gen):
    limit = gen.model.max_context
    prompts = ["Is water wet?", "", "word " * (limit + 10), "Is fire cold?", "Is ice cold?", "Name?"]
    schemas = [["yes", "no"], ["yes", "no"], ["yes", "no"], {"type": 5},
               {"$ref": "#/$defs/missing"}, {"type": "string", "maxLength": 5}]
    out = gen.batch(prompts, schemas=schemas)
    assert out[0] in ("yes", "no")
    assert isinstance(out[1], ConfigError)
    assert isinstance(out[2], PromptTooLongError)
    assert isinstance(out[3], SchemaError) and out[3].pointer == "/type"
    assert isinstance(out[4], SchemaError) and out[4].pointer == "/$ref"
    assert isinstance(out[5], str) and len(out[5]) <= 5
    assert gen("Is water wet?") in ("yes", "no")  # and it keeps serving


@pytest.mark.model
def test_recursive_schema_generates_or_reports_incomplete(embedded):
    gen = Generator(embedded, schema=TREE, max_tokens=48)
    try:
        value = gen("A tree of numbers with two levels")
    except IncompleteOutputError as exc:
        assert exc.partial_text
    else:
        assert isinstance(value["v"], int) and isinstance(value["kids"], list)


@pytest.mark.model
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_missing_head_is_a_config_error_naming_it(embedded, method):
    with pytest.raises(ConfigError, match="/no/such/model") as info:
        Generator(embedded, schema={"type": "string"},
                  speculative=SpeculativeConfig(method=method, model="/no/such/model"))
    assert info.value.option == "speculative.model"


@pytest.mark.model
def test_missing_draft_model_is_a_config_error_naming_it(embedded):
    with pytest.raises(ConfigError, match="/no/such/model") as info:
        Generator(embedded, schema={"type": "string"},
                  speculative=SpeculativeConfig(method="draft_model", model="/no/such/model"))
    assert info.value.option == "speculative.model"
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig(method="draft_model")  # no draft model: fails before any load
    assert info.value.option == "speculative.model"


@pytest.mark.model
def test_draft_model_with_a_different_tokenizer_is_a_config_error(embedded, tiny_loaded):
    # a tiny model with a byte-level BPE of 259 tokens drafting for SmolLM2 (49152 tokens)
    with pytest.raises(ConfigError, match="does not share the target's tokenizer") as info:
        Generator(embedded, schema={"type": "string"},
                  speculative=SpeculativeConfig(method="draft_model", model=tiny_loaded))
    assert info.value.option == "speculative.model"
    assert "token id 1 is '<|im_start|>' for the target and '!' for the draft model" in str(info.value)


def test_bad_schema_text_round_trip_keeps_json_pointer_escaping(no_model):
    schema = {"type": "object", "properties": {"a/b~c": {"$ref": "#/$defs/none"}}}
    with pytest.raises(SchemaError) as info:
        Generator(None, schema=json.dumps(schema))
    assert info.value.pointer == "/properties/a~1b~0c/$ref"


def test_a_chat_template_that_renders_nothing_is_a_config_error_before_any_compute(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    before = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = "{% for m in messages %}{% endfor %}"  # writes no message
    try:
        with pytest.raises(ConfigError, match="empty after the chat template") as err:
            Generator(tiny_loaded).make_request([{"role": "user", "content": "hi"}], max_tokens=4)
        assert err.value.option == "prompt"
    finally:
        tokenizer.chat_template = before
    assert Generator(tiny_loaded)("hi", max_tokens=3, max_retries=0) is not None  # serves on
