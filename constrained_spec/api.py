"""The public API: ``generate`` for one call, ``Generator`` to compile once and serve many.

    person = generate(None, "Ada Lovelace, 36, mathematician", schema=Person)   # -> Person

Every completed output is validated (jsonschema + Pydantic) before it is returned; running
out of ``max_tokens`` first raises :class:`IncompleteOutputError` with the partial text (free
text, with no schema, is returned as it is, ``finish_reason`` "length", as every peer does).

A Generator's keywords come in groups, each checked as one option object before any model is
loaded (docs/options.md): sampling (:class:`SamplingParams`), the schema
(:class:`SchemaOptions`), retries (:class:`RetryPolicy`), reasoning
(:class:`~constrained_spec.frontend.reasoning.ReasoningOptions`) and tools
(:class:`~constrained_spec.frontend.tools.ToolSet`).

Output-quality levers for small models (docs/quality.md; measured in benchmarks/RESULTS.md,
"Output quality levers"): the JSON layout, the prompt and sampling retries (``max_retries``,
:data:`DEFAULT_MAX_RETRIES`) are on by default: the first two keep the model's own
distribution, and retries change only outputs whose first attempt failed. The repetition guard
(``no_repeat_ngram_size``, ``repetition_penalty``) and bounded strings / arrays
(``max_string_length``, ``max_items``) change outputs that would have completed too, and are
off unless asked for.
"""

from __future__ import annotations

import enum
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Generic, Literal, TypeVar, cast, overload

from constrained_spec.config import (
    SamplingParams,
    SpeculativeConfig,
    check_count,
    is_real,
    resolve_speculative,
)
from constrained_spec.drafters import Drafter, make_drafter
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    GrammarStoppedError,
    IncompleteOutputError,
    OutputValidationError,
    OutputWarning,
    PromptTooLongError,
    RepetitionLoopError,
    SchemaError,
)
from constrained_spec.frontend.prompts import Messages, check_text, encode_prompt
from constrained_spec.frontend.reasoning import (
    ReasoningMarkers,
    ReasoningMatcher,
    ReasoningOption,
    ReasoningOptions,
    reasoning_matcher,
    split_reasoning,
)
from constrained_spec.frontend.tools import ToolParser, ToolSet, detect_format
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.logprobs import TokenLogprob
from constrained_spec.generation.loops import LoopDetector
from constrained_spec.generation.protocols import BatchEngine
from constrained_spec.generation.retry import can_resume, quote_tokens, resume, resume_point
from constrained_spec.generation.stats import SpecStats
from constrained_spec.grammar import CompiledSpec, CompileWorkers, Matcher, TokenizerData, compile_spec
from constrained_spec.model.loading import LoadedModel, load_model
from constrained_spec.schemas import (
    AddedBound,
    JsonLayout,
    PreflightReport,
    SchemaSpec,
    bound_schema,
    check_schema,
    normalize_schema,
    parse_output,
)
from constrained_spec.schemas.limits import shortest_output

T = TypeVar("T")

Backend = Literal["xgrammar", "outlines"]
RetryFrom = Literal["start", "resume"]
RETRY_FROM: tuple[RetryFrom, ...] = ("start", "resume")
SchemaMode = Literal["default", "strict", "lenient"]
BACKENDS: tuple[Backend, ...] = ("xgrammar", "outlines")
SCHEMA_MODES: tuple[SchemaMode, ...] = ("default", "strict", "lenient")


class _Same(enum.Enum):
    """The default of a call's ``schema`` / ``tools``: the Generator's own."""

    SAME = "the Generator's own"


_SAME = _Same.SAME

#: How JSON is laid out by default: the compact one-line form with ", " and ": " separators.
#: Chosen by measurement on the embedded model (benchmarks/RESULTS.md, "JSON layout on the
#: embedded model"; docs/quality.md): under the grammar the layout does not change how often
#: outputs complete, and compact JSON takes fewer tokens.
DEFAULT_LAYOUT = JsonLayout()


@dataclass
class GenerationResult(Generic[T]):
    """Everything about one generation: the validated value and how it was produced."""

    value: T
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)
    attempts: int = 1  # generations run for this value (see ``max_retries``)
    #: the errors of the attempts that failed before the one returned (``max_retries``), in
    #: order: what each ended in (a loop, max_tokens, failed validation) and its partial text
    failed_attempts: list[ConstrainedSpecError] = field(default_factory=list)
    #: a reasoning model's thinking, markers stripped (``reasoning``); None when off. ``text``
    #: and ``value`` are the answer after it; ``token_ids`` hold every output token
    reasoning: str | None = None
    #: with ``logprobs=k``: one `TokenLogprob` per token of ``token_ids`` (its logprob and k
    #: alternatives; which distribution: ``logprobs_mode``, docs/options.md); None when off
    logprobs: list[TokenLogprob] | None = None
    #: what the reading of the output dropped, one ``{"type", "message"}`` item each (the
    #: server's ``warnings``): a tool call cut by ``max_tokens`` after complete ones, which are
    #: returned (``finish_reason`` "length"); an :class:`OutputWarning` where only the value
    #: is returned
    warnings: list[dict[str, Any]] = field(default_factory=list)


def _logprobs_of(req: Request) -> list[TokenLogprob] | None:
    return list(req.logprobs) if req.params.logprobs is not None else None


#: Retries after a failed first attempt when a call does not set ``max_retries`` and its output
#: is not streamed. Chosen by measurement on the embedded model (benchmarks/RESULTS.md, "Output
#: quality levers on the embedded model"; docs/quality.md): each retry cures some of the outputs
#: greedy decoding left incomplete, and none that greedy got right changes (a retry runs only
#: after a failed attempt). Two, not more: each retry is one more whole generation for a
#: request that failed, and the repetition-loop detector (loops.py) already ends a looping
#: attempt early, so two retries bound the cost of a hopeless request at three attempts.
DEFAULT_MAX_RETRIES = 2
#: Seconds a schema's grammar compile may take (`grammar.compile_spec`): past it, SchemaError
#: (a 400 from the server, whose compile is then stopped: `grammar.compile_worker`)
COMPILE_TIMEOUT_S = 30.0
#: Temperature of the retries after a failed first attempt (``max_retries``), unless the
#: request already samples at its own temperature. Moderate: far enough from greedy to leave
#: its loop, close enough to keep the model's likely tokens.
DEFAULT_RETRY_TEMPERATURE = 0.7
#: Seed of retry k (k >= 1) when the request has none: ``DEFAULT_RETRY_SEED + k`` (with a seed
#: s: ``s + k``), so retried generations are reproducible.
DEFAULT_RETRY_SEED = 0
#: Where a retry after a loop or ``max_tokens`` starts (``retry_from``): ``"resume"`` continues
#: the failed attempt from its last good point with the prompt's cache kept
#: (generation/retry.py), ``"start"`` generates the whole output again after a new prefill.
#: Chosen by measurement on the benchmark tasks (``benchmarks/retries.py``; docs/quality.md):
#: a resumed retry spends only the tokens after the kept prefix and no second prefill.
DEFAULT_RETRY_FROM: RetryFrom = "resume"
# the options a call may set besides SamplingParams fields, by group (the rest of each group
# is the Generator's only)
_SCHEMA_CALL_OPTIONS = ("max_string_length", "max_items")  # and schema_mode, a keyword of its own
_RETRY_CALL_OPTIONS = ("max_retries", "retry_temperature", "retry_from")
_REASONING_CALL_OPTIONS = ("reasoning", "max_reasoning_tokens")
_CALL_OPTIONS = sorted([*SamplingParams.__dataclass_fields__, *_SCHEMA_CALL_OPTIONS, "schema_mode",
                        *_RETRY_CALL_OPTIONS, *_REASONING_CALL_OPTIONS, "chat_template_kwargs"])


def _resolve_layout(layout: object) -> JsonLayout:
    """A JsonLayout, None (the default), or its fields as a dict (from JSON options)."""
    if layout is None:
        return DEFAULT_LAYOUT
    if isinstance(layout, JsonLayout):
        return layout
    if isinstance(layout, Mapping) and set(layout) <= {"indent", "separators"}:
        seps = layout.get("separators")
        try:
            separators = cast("tuple[str, str]", tuple(seps) if isinstance(seps, list) else seps)
            return JsonLayout(indent=cast("int | None", layout.get("indent")), separators=separators)
        except SchemaError as e:
            raise ConfigError(str(e), option="layout") from None
    raise ConfigError(f"must be a JsonLayout or a dict of its fields (indent, separators), got "
                      f"{layout!r:.60}", option="layout")


@dataclass(frozen=True)
class SchemaOptions:
    """How a Generator (or one call) checks, compiles, lays out and describes its schema
    (docs/options.md, "Schema"). Checked on construction: a :class:`ConfigError` names the
    keyword.

    Parameters
    ----------
    schema_mode:
        Pre-flight policy: ``"default"`` raises on unsupported keywords and warns on ignored
        ones, ``"strict"`` raises on both, ``"lenient"`` only warns.
    backend:
        Grammar backend: ``"xgrammar"`` or ``"outlines"`` (JSON Schema, regex, choices).
    layout:
        How JSON is written (a :class:`JsonLayout`, or a dict of its fields; None:
        :data:`DEFAULT_LAYOUT`).
    system_prompt:
        ``None``: describe the schema in a system message; a string: your system message;
        ``False``: none.
    max_string_length, max_items:
        Opt-in bounds compiled into the grammar: ``maxLength`` / ``maxItems`` on every string
        / array of the schema that has none (None: off). Outputs are still validated against
        the schema as given.
    """

    schema_mode: SchemaMode = "default"
    backend: Backend = "xgrammar"
    layout: JsonLayout = DEFAULT_LAYOUT
    system_prompt: str | bool | None = None
    max_string_length: int | None = None
    max_items: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown grammar backend {self.backend!r}; use 'xgrammar' or "
                              "'outlines'", option="backend")
        if self.schema_mode not in SCHEMA_MODES:
            raise ConfigError(f"must be one of {', '.join(SCHEMA_MODES)}, got "
                              f"{self.schema_mode!r:.40}", option="schema_mode")
        object.__setattr__(self, "layout", _resolve_layout(self.layout))
        if isinstance(self.system_prompt, str):
            check_text(self.system_prompt, "system_prompt", "the system prompt")
        elif self.system_prompt is not None and not isinstance(self.system_prompt, bool):
            raise ConfigError(f"must be a string, None (describe the schema) or False (no "
                              f"system message), got {self.system_prompt!r:.40}",
                              option="system_prompt")
        check_count(self.max_string_length, "max_string_length", minimum=1, allow_none=True)
        check_count(self.max_items, "max_items", minimum=1, allow_none=True)

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """``(max_string_length, max_items)``: equal for options that compile the same grammar."""
        return self.max_string_length, self.max_items

    def bound(self, spec: SchemaSpec) -> tuple[SchemaSpec, list[AddedBound]]:
        """The spec the grammar is compiled from (``spec`` with these bounds) and what was added."""
        return bound_schema(spec, max_string_length=self.max_string_length,
                            max_items=self.max_items)


@dataclass(frozen=True)
class RetryPolicy:
    """The retry options of a Generator or a call (docs/options.md, "Retries") and the one rule
    of ``max_retries``, for :meth:`Generator.batch`, the command line and servers that run their
    own engine loop: how many retries a call gets, which finished attempts run again, and with
    which options.

    An attempt failed when it ended in anything but a valid output that a new attempt may
    cure: an :class:`IncompleteOutputError` (``max_tokens`` ran out, a
    :class:`RepetitionLoopError`, or the engine ended the output early for any other reason)
    or an :class:`OutputValidationError`. Bad input, a cancelled request and an engine failure
    are not retried. Attempt 0 runs with the call's options; retry k (>= 1) samples (at
    ``temperature`` when the call was greedy) with seed ``seed + k`` (seed None:
    :data:`DEFAULT_RETRY_SEED` + k).

    Parameters
    ----------
    max_retries:
        Retries after the first attempt (0: off); default :data:`DEFAULT_MAX_RETRIES`. None:
        not set (the default, or no retries when the output is streamed: :meth:`for_call`).
    temperature:
        Temperature of the retries of a greedy call, in (0, 100] (the ``retry_temperature``
        keyword).
    retry_from:
        Where a retry after a loop or ``max_tokens`` starts: ``"resume"`` (the default,
        :data:`DEFAULT_RETRY_FROM`) continues the failed attempt from its last good point
        (generation/retry.py), ``"start"`` generates the whole output again. A retry after an
        output that failed validation always starts again.
    """

    max_retries: int | None = DEFAULT_MAX_RETRIES
    temperature: float = DEFAULT_RETRY_TEMPERATURE
    retry_from: RetryFrom = DEFAULT_RETRY_FROM

    def __post_init__(self) -> None:
        check_count(self.max_retries, "max_retries", minimum=0, allow_none=True)
        if not is_real(self.temperature) or not 0.0 < self.temperature <= 100.0:
            raise ConfigError(f"must be a number in (0, 100] (a greedy retry would repeat the "
                              f"failed attempt), got {self.temperature!r}",
                              option="retry_temperature")
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.retry_from not in RETRY_FROM:
            raise ConfigError(f"must be 'resume' (continue a failed attempt from its last good "
                              f"point) or 'start' (generate it again), got "
                              f"{self.retry_from!r:.40}", option="retry_from")

    @property
    def retries(self) -> int:
        """Retries after the first attempt of a call that is not streamed."""
        return DEFAULT_MAX_RETRIES if self.max_retries is None else self.max_retries

    def for_call(self, *, streaming: bool = False) -> RetryPolicy:
        """This policy for one call: ``max_retries`` not set (None) becomes
        :data:`DEFAULT_MAX_RETRIES`, or no retries when the output is streamed (the tokens of a
        failed attempt would already be out, so the default cannot apply there). A number > 0
        together with streaming is a :class:`ConfigError`."""
        if self.max_retries is None:
            return replace(self, max_retries=0 if streaming else DEFAULT_MAX_RETRIES)
        if streaming and self.max_retries:
            raise ConfigError("cannot be combined with streaming: the tokens of a failed attempt "
                              "would already be streamed; leave max_retries unset (no retries "
                              "while streaming) or set it to 0", option="max_retries")
        return self

    @classmethod
    def resolve(cls, max_retries: int | None, temperature: float = DEFAULT_RETRY_TEMPERATURE,
                *, streaming: bool = False, retry_from: RetryFrom = DEFAULT_RETRY_FROM
                ) -> RetryPolicy:
        """The policy of a call that asked for ``max_retries`` (None: not set): see
        :meth:`for_call`."""
        return cls(max_retries, temperature, retry_from).for_call(streaming=streaming)

    @staticmethod
    def failed(result: object) -> bool:
        """Whether ``result`` (what :meth:`Generator.finalize` returned) is a failed attempt
        that a retry may cure."""
        return isinstance(result, (IncompleteOutputError, OutputValidationError))

    def options(self, overrides: dict[str, Any], attempt: int,
                defaults: SamplingParams) -> dict[str, Any]:
        """The call options of ``attempt`` (0: the first) of a call with ``overrides`` over the
        sampling ``defaults``."""
        if attempt == 0:
            return dict(overrides)
        merged = {**defaults.__dict__, **overrides}
        seed = merged.get("seed")
        return {**overrides,
                "temperature": merged["temperature"] if merged["temperature"] > 0 else self.temperature,
                "seed": (DEFAULT_RETRY_SEED if seed is None else seed) + attempt}

    def attempts(self, items: Iterable[int]) -> Attempts:
        """The attempts of one call over ``items`` (indices): see :class:`Attempts`."""
        return Attempts(self, items)


class Attempts:
    """The attempts of one call under a :class:`RetryPolicy`.

    Iterating yields ``(attempt, items)``: first every item, then, while retries are left, the
    items whose result was :meth:`recorded <record>` as a failed attempt. An item whose
    attempt could not even start (bad input) is simply not recorded, and so not retried.
    """

    def __init__(self, policy: RetryPolicy, items: Iterable[int]) -> None:
        self.policy = policy
        self._todo = list(items)
        self._failed: list[int] = []
        self.attempt = 0  # the attempt being run

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        for attempt in range(self.policy.retries + 1):
            if not self._todo:
                return
            self._failed = []
            self.attempt = attempt
            yield attempt, list(self._todo)
            self._todo = self._failed

    def record(self, item: int, result: object, *, retry: bool = True) -> bool:
        """Note the result of ``item``'s current attempt (a value, a result or an error);
        ``retry`` False: never run it again (free text, unless ``max_retries`` was set).
        Returns whether it will run again."""
        if retry and self.policy.failed(result):
            self._failed.append(item)
            return self.attempt < self.policy.retries
        return False


def _config_key(config: SpeculativeConfig) -> tuple[Hashable, ...]:
    """A hashable key equal for equal configs; an in-memory ``model`` counts by identity."""
    def part(name: str) -> Hashable:
        value = getattr(config, name)
        if name != "model" or value is None:
            return cast(Hashable, value)
        if isinstance(value, (str, os.PathLike)):
            return ("path", os.fspath(value))
        return ("object", id(value))
    return tuple((f.name, part(f.name)) for f in fields(config))


class _DrafterCache:
    """The drafters built for each model, one per speculative config (see `shared_drafter`).

    By the model's identity (a ``LoadedModel`` is a dataclass that compares by value and so
    cannot key a ``WeakKeyDictionary``); a model's entries go when the model does
    (``weakref.finalize``), so the cache lives and dies with it. Drafters hold the target's
    runner, never the ``LoadedModel`` itself: one that did would keep its model alive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # the config is kept with its drafter, so an object counted by identity stays alive
        self._by_model: dict[int, dict[tuple[Hashable, ...], tuple[SpeculativeConfig, Drafter | None]]] = {}

    def get(self, model: LoadedModel, config: SpeculativeConfig) -> Drafter | None:
        key = _config_key(config)
        with self._lock:
            drafters = self._by_model.get(id(model))
            if drafters is None:
                drafters = self._by_model[id(model)] = {}
                weakref.finalize(model, self._by_model.pop, id(model), None)
            if key not in drafters:
                drafters[key] = (config, make_drafter(config, model))
            return drafters[key][1]


_drafters = _DrafterCache()


def shared_drafter(model: LoadedModel, speculative: SpeculativeConfig | None) -> Drafter | None:
    """The drafter ``speculative`` names for ``model``, built once per model and config.

    Kept for as long as the model it drafts for (a drafter may hold a head's weights or a draft
    model, and holds a cache slot per running request, like the model's runner): every
    Generator over the model with an equal config shares it, so a Generator (and
    ``generate()`` in a loop) costs no set-up. A caller that changes the drafter's attributes
    changes them for all of them.
    """
    if speculative is None:
        return None
    return _drafters.get(model, speculative)


def _encode_with_check(loaded: LoadedModel, prompt: str | Messages, spec: SchemaSpec | None,
                       system_prompt: str | bool | None, max_tokens: int,
                       tools: ToolSet | None = None,
                       template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt's ids, refused when they and ``max_tokens`` do not fit the context. The
    speculative lookahead takes no room here (the engine drafts no further than max_tokens),
    so speculation changes neither the prompt nor whether it is accepted."""
    # our runner's KV capacity, or the context vLLM reserves KV cache for
    limit = loaded.max_context if loaded.vllm is not None else loaded.runner.max_context
    # the default schema description shortens itself to fit beside max_tokens (prompts.py)
    ids = encode_prompt(loaded.tokenizer, prompt, spec, system_prompt, context=limit,
                        reserved=max_tokens + 1, tools=tools, template_kwargs=template_kwargs)
    if not ids:  # a model continues a prompt: with none, its first forward has no row
        raise ConfigError("the prompt is empty after the chat template was applied (no "
                          "token to continue from): give the model some text, or a template "
                          "that writes the messages", option="prompt")
    if len(ids) + max_tokens + 1 > limit:
        raise PromptTooLongError(
            f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
            f"of {limit} tokens; shorten the prompt or lower max_tokens", option="prompt")
    return ids


def _toolset(tools: object, tool_choice: str | Mapping[str, object], parallel: bool) -> ToolSet | None:
    """The ToolSet of ``tools`` (None: none), checked before any model is loaded."""
    if tools is None or isinstance(tools, ToolSet):
        return tools
    return ToolSet(tools, tool_choice, parallel)


def _check_no_schema_with_calls(toolset: ToolSet | None, schema: object) -> None:
    if toolset is not None and toolset.active and schema is not None and schema is not _SAME:
        raise ConfigError("a schema applies to text answers, and with tools the answer may "
                          "be a call: give schema=None, or tool_choice='none'", option="schema")


class Generator(Generic[T]):
    """A model + schema compiled once, serving many prompts (a list runs as one batch).

    What is loaded once lives with the model and is shared by every Generator over it: the
    weights and the model runner (``load_model``), the drafter (one per speculative config,
    :func:`shared_drafter`) and compiled grammars (a process-wide cache). A Generator itself
    holds only options, so making one is cheap.

    Parameters
    ----------
    model:
        ``None`` / ``"default"`` (the embedded model), a checkpoint folder, a ``.gguf`` file,
        a ``(transformers_model, tokenizer)`` pair, or a :class:`LoadedModel`.
    schema:
        A Pydantic model, a JSON Schema (dict or JSON string), ``Regex``, ``Grammar``, a list /
        ``Literal`` / ``Enum`` of choices, or ``None`` for free text.
    speculative:
        ``None``: the default drafter (on by default); ``False``: no speculation; a
        :class:`SpeculativeConfig` to choose (docs/speculative.md).

    The other keywords build one option object per group, held by the Generator and checked
    before any model is loaded (a :class:`ConfigError` naming the keyword); docs/options.md
    describes each:

    - ``sampling`` (:class:`SamplingParams`): ``max_tokens``, ``temperature``, ``top_p``,
      ``top_k``, ``seed``, the opt-in repetition guard ``repetition_penalty``,
      ``no_repeat_ngram_size``, ``min_tokens``, ``ignore_eos`` and ``logprobs`` /
      ``logprobs_mode`` (`generation.logprobs`);
    - ``schema_options`` (:class:`SchemaOptions`): ``schema_mode``, ``backend``, ``layout``,
      ``system_prompt`` and the opt-in bounds ``max_string_length``, ``max_items``; the
      pre-flight report of the Generator's own schema is ``report`` (None for free text);
    - ``retries`` (:class:`RetryPolicy`): ``max_retries`` (None: two retries after a failed
      attempt, none while streaming), ``retry_temperature``, ``retry_from``;
    - ``reasoning_options`` (:class:`~constrained_spec.frontend.reasoning.ReasoningOptions`):
      ``reasoning``, ``max_reasoning_tokens``; the markers in use are ``reasoning``;
    - ``tools`` (:class:`~constrained_spec.frontend.tools.ToolSet`): ``tools``,
      ``tool_choice``, ``parallel_tool_calls`` (with calls possible, ``schema`` must be None);
    - the engine: ``tokenizer`` (of a transformers model given without one),
      ``max_batch_size``.

    A call can change sampling, the bounds, ``schema_mode``, retries and reasoning
    (:meth:`__call__`); the model, ``speculative``, ``backend`` and ``layout`` are the
    Generator's.
    """

    def __init__(self, model: object = None, *, schema: object = None, max_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, speculative: SpeculativeConfig | bool | None = None,
                 backend: Backend = "xgrammar", schema_mode: SchemaMode = "default",
                 system_prompt: str | bool | None = None,
                 layout: JsonLayout | Mapping[str, object] | None = None,
                 tokenizer: object = None, max_batch_size: int = 64,
                 repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0,
                 min_tokens: int = 0, ignore_eos: bool = False,
                 logprobs: int | None = None, logprobs_mode: str = "masked",
                 max_string_length: int | None = None, max_items: int | None = None,
                 max_retries: int | None = None,
                 retry_temperature: float = DEFAULT_RETRY_TEMPERATURE,
                 retry_from: RetryFrom = DEFAULT_RETRY_FROM,
                 reasoning: ReasoningOption = "auto",
                 max_reasoning_tokens: int | None = None,
                 tools: object = None, tool_choice: str | Mapping[str, object] = "auto",
                 parallel_tool_calls: bool = False) -> None:
        self.schema_options = SchemaOptions(schema_mode=schema_mode, backend=backend,
                                            layout=_resolve_layout(layout),
                                            system_prompt=system_prompt,
                                            max_string_length=max_string_length,
                                            max_items=max_items)
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                       seed=seed, max_tokens=max_tokens,
                                       repetition_penalty=repetition_penalty,
                                       no_repeat_ngram_size=no_repeat_ngram_size,
                                       min_tokens=min_tokens, ignore_eos=ignore_eos,
                                       logprobs=logprobs, logprobs_mode=logprobs_mode)
        self.retries = RetryPolicy(max_retries, retry_temperature, retry_from)
        self.speculative = resolve_speculative(speculative)
        self.max_batch_size = check_count(max_batch_size, "max_batch_size", minimum=1)
        self.tools = _toolset(tools, tool_choice, parallel_tool_calls)
        _check_no_schema_with_calls(self.tools, schema)
        self.reasoning_options = ReasoningOptions(reasoning, max_reasoning_tokens)
        # schema problems surface before any model is loaded
        self.spec, self.report = self._prepare_spec(schema, self.schema_options)
        #: the spec the grammar is compiled from: ``spec`` plus any bounds (max_string_length,
        #: max_items); outputs are validated against ``spec``
        self.grammar_spec, added = _bound(self.spec, self.schema_options)
        if self.report is not None:
            self.report.added_bounds = added
        self.model = load_model(model, tokenizer)
        #: the reasoning markers in use (None: off)
        self.reasoning = self.reasoning_options.markers(self.model.tokenizer)
        # vLLM's engine drafts itself (its speculative config, `vllm_engine.engine_for`)
        self.drafter = shared_drafter(self.model, self.speculative) if self.model.vllm is None else None
        #: how this model writes tool calls (its chat template's family, or the default)
        self.tool_format = detect_format(self.model.tokenizer)
        if self.tools is not None and self.tools.active:
            self.spec = self.grammar_spec = self._tool_spec(self.tools, self.schema_options)
        #: where later compiles run: None in a thread of this process; a server sets child
        #: processes that stop a compile at its timeout (`grammar.compile_worker`)
        self.compile_workers: CompileWorkers | None = None
        self.compiled = self._compile(self.spec, self.schema_options)

    def _tool_spec(self, toolset: ToolSet, options: SchemaOptions) -> SchemaSpec:
        """The grammar of ``toolset``'s calls for this model, with the bounds of ``options`` on
        the arguments."""
        return toolset.spec(self.tool_format, options.backend, options.layout,
                            max_string_length=options.max_string_length,
                            max_items=options.max_items)

    @staticmethod
    def _prepare_spec(schema: object, options: SchemaOptions
                      ) -> tuple[SchemaSpec | None, PreflightReport | None]:
        """The spec of ``schema`` and its pre-flight report under ``options`` (None, None for
        free text). A call's own schema gets its own report: ``self.report`` stays the
        Generator's."""
        if schema is None:
            return None, None
        spec = normalize_schema(schema, layout=options.layout)
        return spec, check_schema(spec, options.backend, options.schema_mode)

    def _compile(self, spec: SchemaSpec | None, options: SchemaOptions) -> CompiledSpec | None:
        """Compile ``spec`` with the bounds of ``options``."""
        if spec is None:
            return None
        if isinstance(spec.target, ToolParser):  # tool calls: bounds are in its arguments already
            return compile_spec(spec, self.model.tokenizer_data, backend=options.backend,
                                timeout_s=COMPILE_TIMEOUT_S, workers=self.compile_workers)
        grammar_spec, _ = options.bound(spec)
        return compile_spec(grammar_spec, self.model.tokenizer_data, backend=options.backend,
                            timeout_s=COMPILE_TIMEOUT_S, workers=self.compile_workers)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, prompt: str | Messages | Sequence[str | Messages], *,
                 return_result: bool = False, **overrides: Any) -> Any:
        """Generate for one prompt (-> value) or a list of prompts (-> list, one batch).

        ``overrides`` change this call's options: any :class:`SamplingParams` field,
        ``max_string_length``, ``max_items``, ``schema_mode``, ``max_retries``,
        ``retry_temperature``, ``retry_from``, ``reasoning``, ``max_reasoning_tokens``. Errors
        are raised; for a list the first failing item's error is raised after the whole batch
        ran (use :meth:`batch` with ``return_exceptions=True`` to keep going).
        """
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
            # a list of prompts (a chat, Messages, is a list of dicts): a narrowing mypy
            # cannot follow
            prompts = cast("list[str | Messages]", list(prompt))
            out = self.batch(prompts, return_result=return_result, **overrides)
            for item in out:
                if isinstance(item, BaseException):
                    raise item
            return out
        one = cast("str | Messages", prompt)  # not a list of prompts (above): one prompt
        out = self.batch([one], return_result=return_result, **overrides)[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def batch(self, prompts: Sequence[str | Messages], *, return_result: bool = False,
              return_exceptions: bool = True, schemas: Sequence[object] | None = None,
              on_tokens: Callable[[int, list[int]], None] | None = None,
              on_progress: Callable[[int], None] | None = None,
              **overrides: Any) -> list[Any]:
        """Run ``prompts`` as one batch; per item a value / result, or the error it raised.

        ``schemas`` gives each prompt its own schema (compiled and cached per schema);
        ``on_tokens(index, token_ids)`` streams tokens as they are accepted (and so turns the
        default retries off). ``on_progress(n)`` is told of every ``n`` tokens accepted, those
        of failed attempts included: a progress count that leaves retries on. With
        ``max_retries``, the items that failed run again as one batch per retry.
        """
        retries = self.retries
        if any(k in overrides for k in _RETRY_CALL_OPTIONS):
            retries = RetryPolicy(overrides.pop("max_retries", retries.max_retries),
                                  overrides.pop("retry_temperature", retries.temperature),
                                  overrides.pop("retry_from", retries.retry_from))
        # free text is retried only when max_retries was set: a text cut at max_tokens is an
        # answer (finish_reason "length"), as every peer returns it
        explicit = retries.max_retries is not None
        policy = retries.for_call(streaming=on_tokens is not None)
        results: list[Any] = [None] * len(prompts)
        stats: list[SpecStats | None] = [None] * len(prompts)
        failed: list[list[ConstrainedSpecError]] = [[] for _ in prompts]  # each item's so far
        held: dict[int, Request] = {}  # item -> its failed attempt, cache kept to resume from
        attempts = policy.attempts(range(len(prompts)))
        try:
            for attempt, todo in attempts:
                options = policy.options(overrides, attempt, self.sampling)
                requests: list[tuple[int, Request, SchemaSpec | None]] = []
                for i in todo:
                    if attempt:
                        failed[i].append(results[i])
                    try:
                        cb = _token_callback(i, on_tokens, on_progress)
                        schema = schemas[i] if schemas is not None else _SAME
                        req, spec = self.make_request(prompts[i], schema=schema, on_tokens=cb,
                                                      **options)
                        self._resume(req, spec, held.pop(i, None), policy, attempt)
                        requests.append((i, req, spec))
                    except ConstrainedSpecError as e:
                        results[i] = e
                self.new_engine().run([r for _, r, _ in requests])
                for i, req, spec in requests:
                    results[i] = self.finalize(req, spec, return_result)
                    earlier_stats = stats[i]
                    stats[i] = req.stats if earlier_stats is None else earlier_stats.merge(req.stats)
                    again = attempts.record(i, results[i], retry=spec is not None or explicit)
                    if again and can_resume(req):
                        held[i] = req
                    else:
                        self._release(req)
                        if not again and _cut_free_text(req, spec, return_result,
                                                        explicit and policy.retries > 0):
                            results[i] = self._cut_text(req, return_result)
        finally:  # an exception (KeyboardInterrupt) leaves no cache slot behind
            for req in held.values():
                self._release(req)
        for item, st, earlier in zip(results, stats, failed):
            _record_attempts(item, st, earlier)
        if not return_exceptions:
            for item in results:
                if isinstance(item, BaseException):
                    raise item
        return results

    def _resume(self, req: Request, spec: SchemaSpec | None, failed: Request | None,
                policy: RetryPolicy, attempt: int) -> None:
        """Prepare the engine request of ``attempt``: with ``retry_from="resume"`` it keeps
        its slot's cache when it fails (while retries are left), and continues ``failed`` (the
        item's previous attempt, when that kept its cache) from its resume point
        (generation/retry.py). vLLM's engine holds its own cache: its retries start again."""
        if policy.retry_from != "resume" or self.model.vllm is not None:
            return
        req.keep_slot = attempt < policy.retries
        if failed is None:
            return
        if failed.prompt_ids != req.prompt_ids:  # not the cached prompt: start again
            self._release(failed)
            return
        json_out = (spec is not None and spec.kind == "json_schema"
                    and not isinstance(req.matcher, ReasoningMatcher))
        keep = resume_point(failed, self.model.tokenizer_data.decoded if json_out else None,
                            resumed=failed.resumed)
        resume(req, failed, keep)

    def _release(self, req: Request) -> None:
        """Free the cache slot ``req`` kept for a resumed retry (nothing if it kept none)."""
        if can_resume(req):
            self.model.runner.free_slot(req.slot)
            req.slot = -1

    def _cut_text(self, req: Request, return_result: bool) -> Any:
        """The free text of ``req``, cut at ``max_tokens``: returned, not raised
        (``finish_reason`` "length" on the :class:`GenerationResult`)."""
        text = self.model.tokenizer.decode(req.output_ids)
        reasoning, answer = split_reasoning(self.model.tokenizer, req.output_ids, req.matcher, text)
        if not return_result:
            return answer
        return GenerationResult(value=answer, text=answer, token_ids=list(req.output_ids),
                                finish_reason=req.finish_reason or "length", stats=req.stats,
                                reasoning=reasoning, logprobs=_logprobs_of(req))

    # -- building blocks (also used by servers that run their own engine loop) --------------
    def make_request(self, prompt: str | Messages, *, schema: object = _SAME,
                     schema_mode: SchemaMode | None = None,
                     on_tokens: Callable[[list[int]], None] | None = None,
                     tools: object = _SAME,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     **overrides: Any) -> tuple[Request, SchemaSpec | None]:
        """A ready-to-run engine request for ``prompt`` and the spec to finalize it with.

        ``schema`` defaults to the Generator's own (compiled once); another schema is
        normalised, checked (under ``schema_mode``, default the Generator's) and compiled here
        (compiles are cached). Raises :class:`ConstrainedSpecError` subclasses for bad input,
        before any compute. ``overrides``: any :class:`SamplingParams` field,
        ``max_string_length``, ``max_items``, ``reasoning``, ``max_reasoning_tokens``. ``tools``:
        this request's :class:`~constrained_spec.frontend.tools.ToolSet` (or a list of tools, under
        ``"auto"``; default the Generator's; None: no tools); while calls are possible, its
        grammar replaces ``schema``. ``chat_template_kwargs``: passed to the chat template
        (e.g. ``{"enable_thinking": False}``, which Qwen3's template turns into a closed think
        block: reasoning "auto" then answers at once).
        """
        toolset = self.tools if tools is _SAME else _toolset(tools, "auto", False)
        options, (markers, budget), params = self._call_options(overrides, schema_mode)
        if self.model.vllm is not None:  # what vLLM's engine cannot do: a ConfigError now
            from constrained_spec.generation.vllm_engine import check_sampling

            check_sampling(params)
        spec, compiled, calls = self._request_spec(schema, toolset, options)
        if spec is not None:
            check_reachable(spec, params.max_tokens, self.model.tokenizer_data)
        ids = _encode_with_check(self.model, prompt, None if calls else spec,
                                 options.system_prompt, params.max_tokens, toolset,
                                 chat_template_kwargs)
        matcher: Matcher | None
        if markers is not None:  # the grammar starts after the reasoning
            matcher = reasoning_matcher(self.model, compiled, markers, ids, budget)
        else:
            matcher = compiled.new_matcher() if compiled is not None else None
        return Request(ids, matcher, params, self.model.eos_token_ids, on_tokens=on_tokens,
                       loops=self._loop_detector(spec)), spec

    def _loop_detector(self, spec: SchemaSpec | None) -> LoopDetector:
        """The loop detector of a request for ``spec``: with the structural rule (loops.py)
        where quotes delimit values (JSON and tool calls)."""
        if spec is None or not (spec.kind == "json_schema" or isinstance(spec.target, ToolParser)):
            return LoopDetector()
        data = self.model.tokenizer_data
        return LoopDetector(structural_tokens=data.derived(
            "quote_tokens", lambda: quote_tokens(data.decoded)))

    def _call_options(self, overrides: dict[str, Any], schema_mode: SchemaMode | None
                      ) -> tuple[SchemaOptions, tuple[ReasoningMarkers | None, int | None],
                                 SamplingParams]:
        """A call's schema options, reasoning (its markers and budget) and sampling: the
        Generator's, with ``overrides`` (taken out of it) and ``schema_mode`` over them."""
        changes: dict[str, Any] = {k: overrides.pop(k) for k in _SCHEMA_CALL_OPTIONS
                                   if k in overrides}
        if schema_mode is not None:
            changes["schema_mode"] = schema_mode
        options = replace(self.schema_options, **changes) if changes else self.schema_options
        own = self.reasoning_options
        markers, budget = self.reasoning, own.max_reasoning_tokens
        if any(k in overrides for k in _REASONING_CALL_OPTIONS):
            call = ReasoningOptions(overrides.pop("reasoning", own.reasoning),
                                    overrides.pop("max_reasoning_tokens", budget))
            if call.reasoning != own.reasoning:
                markers = call.markers(self.model.tokenizer)
            budget = call.max_reasoning_tokens
        unknown = sorted(set(overrides) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"unknown option {unknown[0]!r}; a call can set "
                              f"{', '.join(_CALL_OPTIONS)}", option=unknown[0])
        return options, (markers, budget), replace(self.sampling, **overrides)

    def _request_spec(self, schema: object, toolset: ToolSet | None, options: SchemaOptions
                      ) -> tuple[SchemaSpec | None, CompiledSpec | None, bool]:
        """The spec and compiled grammar of a request with ``schema``, ``toolset`` and the
        schema ``options``, and whether it may call tools (their grammar is then the spec)."""
        _check_no_schema_with_calls(toolset, schema)
        same_bounds = options.bounds == self.schema_options.bounds
        if toolset is not None and toolset.active:
            if toolset is self.tools and same_bounds:
                return self.spec, self.compiled, True
            calls = self._tool_spec(toolset, options)
            return calls, self._compile(calls, options), True
        if schema is not _SAME:
            spec, _ = self._prepare_spec(schema, options)
            return spec, self._compile(spec, options), False
        if self.tools is not None and self.tools.active:
            return None, None, False  # the Generator's spec is its calls; this call has none: free text
        if self.spec is not None and options.schema_mode != self.schema_options.schema_mode:
            check_schema(self.spec, options.backend, options.schema_mode)
        return self.spec, self.compiled if same_bounds else self._compile(self.spec, options), False

    def new_engine(self) -> BatchEngine:
        """An engine over this Generator's model: ours (its runner and drafter), or vLLM's for
        a model loaded with ``engine="vllm"`` (`generation.vllm_engine`)."""
        if self.model.vllm is not None:
            from constrained_spec.generation.vllm_engine import VLLMEngine, engine_for

            return VLLMEngine(engine_for(self.model, self.speculative),
                              max_batch_size=self.max_batch_size, speculative=self.speculative)
        return Engine(self.model.runner, speculative=self.speculative, drafter=self.drafter,
                      max_batch_size=self.max_batch_size)

    def finalize(self, req: Request, spec: SchemaSpec | None, return_result: bool = True) -> Any:
        """The value / :class:`GenerationResult` of a finished request, or the error it ended in."""
        # with reasoning: errors carry the whole output, the value and ``text`` the answer only
        text = self.model.tokenizer.decode(req.output_ids)
        reasoning, answer = split_reasoning(self.model.tokenizer, req.output_ids, req.matcher, text)
        if req.finish_reason == "loop" and req.loops is not None and req.loops.loop is not None:
            loop = req.loops.loop  # the output repeated one unit of tokens (loops.py)
            unit = self.model.tokenizer.decode(req.output_ids[loop.start:loop.start + loop.period])
            return RepetitionLoopError(
                f"repetition loop detected after {len(req.output_ids)} of max_tokens="
                f"{req.params.max_tokens} tokens: {unit!r:.80} ({loop.period} tokens) repeated "
                f"{loop.repeats:.0f} times from output token {loop.start}; stopped early. Retry "
                "with sampling (max_retries) or a repetition guard (no_repeat_ngram_size) "
                "(partial output on .partial_text)", partial_text=text, token_ids=req.output_ids,
                stats=req.stats, period=loop.period, start=loop.start, repeated_text=unit)
        if req.finish_reason == "cancelled":
            return ConstrainedSpecError("the request was cancelled")
        if req.finish_reason == "error":
            return self._generation_error(req, text)
        if req.finish_reason == "length" and spec is not None and isinstance(spec.target, ToolParser):
            cut = _complete_calls(req, spec.target, answer, reasoning, return_result)
            if cut is not None:
                return cut
        if req.finish_reason != "stop":
            # "length", or any other way the engine ends an output early: incomplete (and so
            # a failed attempt that RetryPolicy runs again)
            why = (f"max_tokens={req.params.max_tokens} reached before the output was complete; "
                   "raise max_tokens" if req.finish_reason == "length" else
                   f"generation ended ({req.finish_reason}) before the output was complete; "
                   "max_retries generates again")
            # (a reasoning matcher is what gives the output a reasoning part)
            if isinstance(req.matcher, ReasoningMatcher) and req.matcher.answer_start is None:
                why += " (still reasoning: set max_reasoning_tokens to leave room for the answer)"
            return IncompleteOutputError(f"{why} (partial output on .partial_text)",
                                         partial_text=text, token_ids=req.output_ids,
                                         stats=req.stats)
        try:
            if spec is None:
                value = answer
            elif isinstance(spec.target, ToolParser):  # tool calls: split, validated per tool
                value = spec.target.value(answer)
            else:
                value = parse_output(spec, answer)
        except ConstrainedSpecError as e:
            if hasattr(e, "stats"):
                e.stats = req.stats
            return e
        if return_result:
            return GenerationResult(value=value, text=answer, token_ids=list(req.output_ids),
                                    finish_reason=req.finish_reason, stats=req.stats,
                                    reasoning=reasoning, logprobs=_logprobs_of(req))
        return value

    @staticmethod
    def _generation_error(req: Request, text: str) -> GenerationError | GrammarStoppedError:
        """The typed error of a request that ended in "error", with its partial output."""
        err = req.error
        if isinstance(err, GrammarStoppedError):  # the schema's fault, not the engine's
            err.partial_text = text
            return err
        if not isinstance(err, GenerationError):  # set outside the engine's own guards
            err = GenerationError.from_exception("engine", err, token_ids=req.output_ids,
                                                 stats=req.stats)
        err.partial_text = text
        return err


def check_reachable(spec: SchemaSpec, max_tokens: int, tok: TokenizerData) -> None:
    """Raise a `ConfigError` (option max_tokens) when no output ``spec`` allows fits in
    ``max_tokens`` tokens even of the model's longest one (`schemas.limits.shortest_output`):
    every attempt would generate ``max_tokens`` tokens and fail."""
    chars, where = shortest_output(spec)
    longest = tok.derived("longest_token_bytes", lambda: max(map(len, tok.decoded), default=1))
    if chars > max_tokens * longest:
        raise ConfigError(
            f"the shortest output {where} allows has {chars:,} characters: at least "
            f"{-(-chars // longest):,} tokens of this model (its longest token has {longest} "
            f"bytes), more than max_tokens={max_tokens:,}; raise max_tokens or lower the "
            "schema's minimum (minLength, minItems, a long repetition)", option="max_tokens")


def _complete_calls(req: Request, parser: ToolParser, answer: str, reasoning: str | None,
                    return_result: bool) -> Any:
    """The complete tool calls of an output cut by ``max_tokens`` (as the server returns them:
    the call that had begun is dropped and named in the result's ``warnings``, or in an
    `OutputWarning` when the value is returned alone), or
    None when it has none: then it is an incomplete output like any other (retried). A
    complete call that fails its tool's schema is that error."""
    try:
        reading = parser.read(answer, complete=False)
    except ConstrainedSpecError as e:
        if hasattr(e, "stats"):
            e.stats = req.stats
        return e
    if not reading.calls:
        return None
    notes = reading.notes()
    value = reading.calls if parser.tools.parallel else reading.calls[0]
    if not return_result:  # the value alone: the warning is the only word of what was dropped
        for note in notes:
            warnings.warn(note["message"], OutputWarning, stacklevel=4)
        return value
    return GenerationResult(value=value, text=answer, token_ids=list(req.output_ids),
                            finish_reason="length", stats=req.stats, reasoning=reasoning,
                            logprobs=_logprobs_of(req), warnings=notes)


def _cut_free_text(req: Request, spec: SchemaSpec | None, return_result: bool,
                   retried: bool) -> bool:
    """Whether free text (``spec`` None) cut at ``max_tokens`` is returned as it is: with
    ``return_result``, else unless the caller asked for retries (``retried``: then it is an
    incomplete output, raised) or a reasoning model was still thinking (there is no answer
    text to return; the error says to set ``max_reasoning_tokens``)."""
    if spec is not None or req.finish_reason != "length":
        return False
    if return_result:
        return True
    thinking = isinstance(req.matcher, ReasoningMatcher) and req.matcher.answer_start is None
    return not retried and not thinking


def _token_callback(index: int, on_tokens: Callable[[int, list[int]], None] | None,
                    on_progress: Callable[[int], None] | None
                    ) -> Callable[[list[int]], None] | None:
    """The engine request's ``on_tokens`` for item ``index`` of a batch (None: neither)."""
    if on_tokens is None and on_progress is None:
        return None

    def callback(toks: list[int]) -> None:
        if on_tokens is not None:
            on_tokens(index, toks)
        if on_progress is not None:
            on_progress(len(toks))
    return callback


def _bound(spec: SchemaSpec | None, options: SchemaOptions
           ) -> tuple[SchemaSpec | None, list[AddedBound]]:
    """``spec`` with the bounds of ``options`` (the spec the grammar is compiled from) and the
    bounds added."""
    return (None, []) if spec is None else options.bound(spec)


def _record_attempts(item: object, stats: SpecStats | None,
                     earlier: list[ConstrainedSpecError]) -> None:
    """Put the summed stats of every attempt, their number and the errors of the ``earlier``
    (failed) attempts on a result or error."""
    if stats is None:
        return
    if isinstance(item, GenerationResult):
        item.stats, item.attempts, item.failed_attempts = stats, stats.attempts, list(earlier)
    elif isinstance(item, ConstrainedSpecError):
        if hasattr(item, "stats"):
            item.stats = stats
        item.attempts = stats.attempts
        item.failed_attempts = list(earlier)  # type: ignore[attr-defined]


@overload
def generate(model: object, prompt: str | Messages, *, schema: type[T], max_tokens: int = ...,
             temperature: float = ..., top_p: float = ..., top_k: int = ..., seed: int | None = ...,
             speculative: SpeculativeConfig | bool | None = ..., return_result: Literal[False] = ...,
             **options: Any) -> T: ...
@overload
def generate(model: object, prompt: str | Messages, *, schema: type[T], max_tokens: int = ...,
             temperature: float = ..., top_p: float = ..., top_k: int = ..., seed: int | None = ...,
             speculative: SpeculativeConfig | bool | None = ..., return_result: Literal[True],
             **options: Any) -> GenerationResult[T]: ...
@overload
def generate(model: object, prompt: str | Messages, *, schema: object = ..., max_tokens: int = ...,
             temperature: float = ..., top_p: float = ..., top_k: int = ..., seed: int | None = ...,
             speculative: SpeculativeConfig | bool | None = ..., return_result: bool = ...,
             **options: Any) -> Any: ...
def generate(model: object, prompt: str | Messages, *, schema: object = None, max_tokens: int = 512,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, speculative: SpeculativeConfig | bool | None = None,
             return_result: bool = False, **options: Any) -> Any:
    """Generate one output that matches ``schema``.

    Returns the validated value: a Pydantic instance for a Pydantic model, a dict for a JSON
    Schema, the string for a regex or grammar, the chosen value for choices; or a
    :class:`GenerationResult` with ``return_result=True``. With ``tools=[...]`` (and
    ``tool_choice``, ``parallel_tool_calls``): a :class:`~constrained_spec.frontend.tools.ToolCall`, a
    list of them, or the text (``tool_choice="auto"``). ``options``: every other keyword of
    :class:`Generator`, by group in docs/options.md.
    """
    gen: Generator[Any] = Generator(model, schema=schema, max_tokens=max_tokens,
                                    temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                    speculative=speculative, **options)
    return gen(prompt, return_result=return_result)
