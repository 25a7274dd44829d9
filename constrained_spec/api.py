"""The public API: ``generate`` for one call, ``Generator`` to compile once and serve many.

    person = generate(None, "Ada Lovelace, 36, mathematician", schema=Person)   # -> Person

Every completed output is validated (jsonschema + Pydantic) before it is returned; running
out of ``max_tokens`` first raises :class:`IncompleteOutputError` with the partial text.

Output-quality levers for small models (benchmarks/RESULTS.md, "Output quality levers"): the
JSON layout, the prompt and sampling retries (``max_retries``, :data:`DEFAULT_MAX_RETRIES`)
are on by default: the first two keep the model's own distribution, and retries change only
outputs whose first attempt failed. The repetition guard (``no_repeat_ngram_size``,
``repetition_penalty``) and bounded strings / arrays (``max_string_length``, ``max_items``)
change outputs that would have completed too, and are off unless asked for.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Literal, TypeVar, cast, overload

from constrained_spec.config import SamplingParams, SpeculativeConfig, _is_real, resolve_speculative
from constrained_spec.drafters import Drafter, make_drafter
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    IncompleteOutputError,
    OutputValidationError,
    PromptTooLongError,
    RepetitionLoopError,
    SchemaError,
)
from constrained_spec.frontend.prompts import Messages, check_text, encode_prompt
from constrained_spec.frontend.reasoning import (
    ReasoningMatcher,
    ReasoningOption,
    check_reasoning_budget,
    reasoning_matcher,
    resolve_reasoning,
    split_reasoning,
)
from constrained_spec.frontend.tools import ToolParser, ToolSet, detect_format
from constrained_spec.generation.engine import Engine, Request
from constrained_spec.generation.stats import SpecStats
from constrained_spec.grammar import compile_spec
from constrained_spec.model.loading import LoadedModel, load_model
from constrained_spec.schemas import (
    JsonLayout,
    SchemaSpec,
    bound_schema,
    check_schema,
    normalize_schema,
    parse_output,
)

T = TypeVar("T")

Backend = Literal["xgrammar", "outlines"]
SchemaMode = Literal["default", "strict", "lenient"]

_SAME: Any = object()  # "the Generator's own schema"

#: How JSON is laid out by default: the compact one-line form with ", " and ": " separators.
#: Measured on the embedded model (benchmarks/RESULTS.md, "JSON layout ..."): it indents the
#: JSON it writes freely, but under the grammar the layout does not change how often outputs
#: complete, and compact JSON takes 6-21% fewer tokens.
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


#: Retries after a failed first attempt when a call does not set ``max_retries`` and its output
#: is not streamed. Measured on the embedded model (benchmarks/RESULTS.md, "Output quality
#: levers"): greedy alone completes 16 of 20 JSON tasks, one retry 19, two retries all 20, and
#: no output greedy got right changes (a retry runs only after a failed attempt). Two, not more:
#: each retry is one more whole generation for a request that failed, and the repetition-loop
#: detector (loops.py) already ends a looping attempt early, so two retries bound the cost of a
#: hopeless request at three attempts.
DEFAULT_MAX_RETRIES = 2
#: Temperature of the retries after a failed first attempt (``max_retries``), unless the
#: request already samples at its own temperature. Moderate: far enough from greedy to leave
#: its loop, close enough to keep the model's likely tokens.
DEFAULT_RETRY_TEMPERATURE = 0.7
#: Seed of retry k (k >= 1) when the request has none: ``DEFAULT_RETRY_SEED + k`` (with a seed
#: s: ``s + k``), so retried generations are reproducible.
DEFAULT_RETRY_SEED = 0
# Generator options a call may override besides SamplingParams fields
_SPEC_OPTIONS = ("max_string_length", "max_items")
_CALL_OPTIONS = ("schema_mode", "max_retries", "retry_temperature")
_REASONING_OPTIONS = ("reasoning", "max_reasoning_tokens")
_SCHEMA_MODES = ("default", "strict", "lenient")


def _check_count(value: Any, option: str, *, minimum: int, allow_none: bool) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"must be an integer >= {minimum}{' or None' if allow_none else ''}, "
                          f"got {value!r}", option=option)
    return value


def _resolve_layout(layout: Any) -> JsonLayout | None:
    """A JsonLayout, None (the default), or its fields as a dict (from JSON options)."""
    if layout is None or isinstance(layout, JsonLayout):
        return layout
    if isinstance(layout, dict) and set(layout) <= {"indent", "separators"}:
        seps = layout.get("separators")
        try:
            separators = cast("tuple[str, str]", tuple(seps) if isinstance(seps, list) else seps)
            return JsonLayout(indent=layout.get("indent"), separators=separators)
        except SchemaError as e:
            raise ConfigError(str(e), option="layout") from None
    raise ConfigError(f"must be a JsonLayout or a dict of its fields (indent, separators), got "
                      f"{layout!r:.60}", option="layout")


def _check_retry_temperature(value: Any) -> float:
    if not _is_real(value) or not 0.0 < value <= 100.0:
        raise ConfigError(f"must be a number in (0, 100] (a greedy retry would repeat the failed "
                          f"attempt), got {value!r}", option="retry_temperature")
    return float(value)


def _check_schema_mode(value: Any) -> SchemaMode:
    if value not in _SCHEMA_MODES:
        raise ConfigError(f"must be one of {', '.join(_SCHEMA_MODES)}, got {value!r:.40}",
                          option="schema_mode")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """The one rule of ``max_retries``, for :meth:`Generator.batch`, the command line and
    servers that run their own engine loop: how many retries a call gets, which finished
    attempts run again, and with which options.

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
        Retries after the first attempt (0: off); default :data:`DEFAULT_MAX_RETRIES`.
    temperature:
        Temperature of the retries of a greedy call, in (0, 100].
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    temperature: float = DEFAULT_RETRY_TEMPERATURE

    def __post_init__(self) -> None:
        _check_count(self.max_retries, "max_retries", minimum=0, allow_none=False)
        object.__setattr__(self, "temperature", _check_retry_temperature(self.temperature))

    @classmethod
    def resolve(cls, max_retries: int | None, temperature: float = DEFAULT_RETRY_TEMPERATURE,
                *, streaming: bool = False) -> RetryPolicy:
        """The policy of a call that asked for ``max_retries`` (None: not set).

        Not set: :data:`DEFAULT_MAX_RETRIES`, or no retries when the output is streamed (the
        tokens of a failed attempt would already be out, so the default cannot apply there).
        Set: that many; a number > 0 together with streaming is a :class:`ConfigError`.
        """
        if max_retries is None:
            return cls(0 if streaming else DEFAULT_MAX_RETRIES, temperature)
        policy = cls(max_retries, temperature)
        if streaming and policy.max_retries:
            raise ConfigError("cannot be combined with streaming: the tokens of a failed attempt "
                              "would already be streamed; leave max_retries unset (no retries "
                              "while streaming) or set it to 0", option="max_retries")
        return policy

    @staticmethod
    def failed(result: Any) -> bool:
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

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        for attempt in range(self.policy.max_retries + 1):
            if not self._todo:
                return
            self._failed = []
            yield attempt, list(self._todo)
            self._todo = self._failed

    def record(self, item: int, result: Any) -> None:
        """Note the result of ``item``'s current attempt (a value, a result or an error)."""
        if self.policy.failed(result):
            self._failed.append(item)


# the drafters built for a model, one per speculative config (see `shared_drafter`)
_drafters_lock = threading.Lock()


def _config_key(config: SpeculativeConfig) -> tuple[Any, ...]:
    """A hashable key equal for equal configs; an in-memory ``model`` counts by identity."""
    def part(name: str) -> Any:
        value = getattr(config, name)
        if name != "model" or value is None:
            return value
        if isinstance(value, (str, os.PathLike)):
            return ("path", os.fspath(value))
        return ("object", id(value))
    return tuple((f.name, part(f.name)) for f in fields(config))


def shared_drafter(model: LoadedModel, speculative: SpeculativeConfig | None) -> Drafter | None:
    """The drafter ``speculative`` names for ``model``, built once per model and config.

    Kept on the model it drafts for (a drafter may hold a head's weights or a draft model, and
    holds a cache slot per running request, like the model's runner): every Generator over the
    model with an equal config shares it, so a Generator (and ``generate()`` in a loop) costs
    no set-up. A caller that changes the drafter's attributes changes them for all of them.
    """
    if speculative is None:
        return None
    key = _config_key(speculative)
    with _drafters_lock:
        # a plain attribute of the model: the cache lives and dies with it
        cache: dict[tuple[Any, ...], tuple[SpeculativeConfig, Drafter | None]] = (
            vars(model).setdefault("_drafters", {}))
        if key not in cache:
            # the config is kept with its drafter, so an object counted by identity stays alive
            cache[key] = (speculative, make_drafter(speculative, model))
        return cache[key][1]


def _encode_with_check(loaded: LoadedModel, prompt: Any, spec: SchemaSpec | None,
                       system_prompt: Any, max_tokens: int, tools: ToolSet | None = None
                       ) -> list[int]:
    """The prompt's ids, refused when they and ``max_tokens`` do not fit the context. The
    speculative lookahead takes no room here (the engine drafts no further than max_tokens),
    so speculation changes neither the prompt nor whether it is accepted."""
    limit = loaded.runner.max_context
    # the default schema description shortens itself to fit beside max_tokens (prompts.py)
    ids = encode_prompt(loaded.tokenizer, prompt, spec, system_prompt, context=limit,
                        reserved=max_tokens + 1, tools=tools)
    if len(ids) + max_tokens + 1 > limit:
        raise PromptTooLongError(
            f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
            f"of {limit} tokens; shorten the prompt or lower max_tokens", option="prompt")
    return ids


class Generator(Generic[T]):
    """A model + schema compiled once, serving many prompts (a list runs as one batch).

    What is loaded once lives with the model and is shared by every Generator over it: the
    weights and the model runner (``load_model``), the drafter (one per speculative config,
    :func:`shared_drafter`) and compiled grammars (a process-wide cache). A Generator itself
    holds only options (schema, schema mode, sampling, levers), so making one is cheap, and
    every option but the model, ``speculative`` and ``backend`` can also be changed per call.

    Parameters
    ----------
    model:
        ``None`` / ``"default"`` (the embedded model), a checkpoint folder, a ``.gguf`` file,
        a ``(transformers_model, tokenizer)`` pair, or a loaded model of ours.
    schema:
        A Pydantic model, a JSON Schema (dict or JSON string), ``Regex``, ``Grammar``, a list /
        ``Literal`` / ``Enum`` of choices, or ``None`` for free text.
    speculative:
        ``None``: the best drafter available (on by default); ``False``: no speculation;
        a :class:`SpeculativeConfig` to choose.
    backend:
        Grammar backend: ``"xgrammar"`` (default) or ``"outlines"`` (JSON Schema, regex, choices).
    schema_mode:
        Pre-flight policy: ``"default"`` raises on unsupported keywords and warns on ignored
        ones, ``"strict"`` raises on both, ``"lenient"`` only warns. Its report for the
        Generator's own schema is ``report`` (``None`` for free text).
    system_prompt:
        ``None``: describe the schema in a system message; a string: your system message;
        ``False``: none.
    layout:
        How JSON is written (:class:`JsonLayout`, or a dict of its fields); default
        :data:`DEFAULT_LAYOUT` (compact; chosen by measurement).
    repetition_penalty, no_repeat_ngram_size:
        The opt-in repetition guard (off: 1.0 and 0). It changes the sampled distribution;
        speculation stays exact for the changed one. Positions where the grammar forces the
        continuation are left alone. See :class:`SamplingParams`.
    max_string_length, max_items:
        Opt-in bounds compiled into the grammar: ``maxLength`` / ``maxItems`` on every string /
        array of the schema that has none (``None``: off). Final validation is still against
        your schema; what was added is on ``report.added_bounds``.
    max_retries:
        After an :class:`IncompleteOutputError` (``max_tokens`` ran out, or a
        :class:`RepetitionLoopError`) or an :class:`OutputValidationError`, generate again up
        to this many times and return the first valid output. ``None`` (the default):
        :data:`DEFAULT_MAX_RETRIES` (2), or none when the output is streamed (``on_tokens``);
        ``0``: plain single-attempt decoding. The first attempt uses your sampling settings
        (greedy by default), so an output that completes on it is exactly the one without
        retries; retry k samples at ``retry_temperature`` (your temperature if you sample)
        with seed ``seed + k`` (seed None: ``k``). ``attempts``, the failed attempts' errors
        and the stats summed over every attempt are on the result (or on the last error when
        all fail). A number > 0 cannot be combined with ``on_tokens`` streaming.
    retry_temperature:
        Temperature of the retries when the request is greedy (default
        :data:`DEFAULT_RETRY_TEMPERATURE`).
    reasoning:
        For reasoning models (``reasoning.py``): ``"auto"`` (default: on when the chat
        template names known markers such as ``<think>``/``</think>``), ``True``, ``False``
        or a :class:`ReasoningMarkers`. On, the model thinks freely and the schema applies
        after the end marker; the thinking is ``GenerationResult.reasoning``.
    max_reasoning_tokens:
        Thinking tokens before the end marker is forced (``None``: no budget). ``max_tokens``
        counts the reasoning too.
    tools, tool_choice, parallel_tool_calls:
        Tool calling (``constrained_spec.frontend.tools``): ``tools`` are typed Python functions,
        Pydantic models or OpenAI tool dicts; ``tool_choice`` is ``"auto"`` (the model answers
        in text or calls), ``"required"``, ``"none"`` or a tool's name. The value is a
        :class:`~constrained_spec.frontend.tools.ToolCall` (a list of them with ``parallel_tool_calls``),
        or the text under ``"auto"``. Under ``"none"`` the ``schema`` applies as usual; with
        calls possible, ``schema`` must be None.
    """

    def __init__(self, model: Any = None, *, schema: Any = None, max_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, speculative: SpeculativeConfig | bool | None = None,
                 backend: Backend = "xgrammar", schema_mode: SchemaMode = "default",
                 system_prompt: str | bool | None = None, layout: JsonLayout | None = None,
                 tokenizer: Any = None, max_batch_size: int = 64,
                 repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0,
                 max_string_length: int | None = None, max_items: int | None = None,
                 max_retries: int | None = None,
                 retry_temperature: float = DEFAULT_RETRY_TEMPERATURE,
                 reasoning: ReasoningOption = "auto",
                 max_reasoning_tokens: int | None = None,
                 tools: Any = None, tool_choice: Any = "auto",
                 parallel_tool_calls: bool = False) -> None:
        if backend not in ("xgrammar", "outlines"):
            raise ConfigError(f"unknown grammar backend {backend!r}; use 'xgrammar' or 'outlines'",
                              option="backend")
        layout = _resolve_layout(layout)
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                       seed=seed, max_tokens=max_tokens,
                                       repetition_penalty=repetition_penalty,
                                       no_repeat_ngram_size=no_repeat_ngram_size)
        self.max_string_length = _check_count(max_string_length, "max_string_length", minimum=1,
                                              allow_none=True)
        self.max_items = _check_count(max_items, "max_items", minimum=1, allow_none=True)
        RetryPolicy.resolve(max_retries, retry_temperature)  # bad values fail here
        #: retries per call (None: :data:`DEFAULT_MAX_RETRIES`, none when streaming)
        self.max_retries: int | None = max_retries
        self.retry_temperature = float(retry_temperature)
        self.speculative = resolve_speculative(speculative)
        self.backend = backend
        self.schema_mode = schema_mode
        if isinstance(system_prompt, str):
            check_text(system_prompt, "system_prompt", "the system prompt")
        self.system_prompt = system_prompt
        self.layout = layout or DEFAULT_LAYOUT
        self.max_batch_size = _check_count(max_batch_size, "max_batch_size", minimum=1,
                                           allow_none=False)
        self.tools = self._toolset(tools, tool_choice, parallel_tool_calls, schema)
        # schema problems surface before any model is loaded
        self.spec, self.report = self._prepare_spec(schema, schema_mode)
        #: the spec the grammar is compiled from: ``spec`` plus any bounds (max_string_length,
        #: max_items); outputs are validated against ``spec``
        self.grammar_spec, added = self._bound(self.spec, {})
        if self.report is not None:
            self.report.added_bounds = added
        self.max_reasoning_tokens = check_reasoning_budget(max_reasoning_tokens)
        self.model = load_model(model, tokenizer)
        #: the reasoning markers in use (None: off)
        self.reasoning = resolve_reasoning(reasoning, self.model.tokenizer)
        self.drafter = shared_drafter(self.model, self.speculative)
        #: how this model writes tool calls (its chat template's family, or the default)
        self.tool_format = detect_format(self.model.tokenizer)
        if self.tools is not None and self.tools.active:
            self.spec = self.grammar_spec = self._tool_spec(self.tools)
        self.compiled = self._compile(self.spec)

    def _toolset(self, tools: Any, tool_choice: Any, parallel: bool, schema: Any) -> ToolSet | None:
        """The ToolSet of ``tools`` (None: none), checked before any model is loaded."""
        if tools is None or isinstance(tools, ToolSet):
            toolset = tools
        else:
            toolset = ToolSet(tools, tool_choice, parallel)
        if toolset is not None and toolset.active and schema is not None:
            raise ConfigError("a schema applies to text answers, and with tools the answer may "
                              "be a call: give schema=None, or tool_choice='none'", option="schema")
        return toolset

    def _tool_spec(self, toolset: ToolSet, bounds: dict[str, Any] | None = None) -> SchemaSpec:
        """The grammar of ``toolset``'s calls for this model, with this Generator's bounds (or
        those of ``bounds``) on the arguments."""
        bounds = bounds or {}
        return toolset.spec(self.tool_format, self.backend, self.layout,
                            max_string_length=bounds.get("max_string_length", self.max_string_length),
                            max_items=bounds.get("max_items", self.max_items))

    def _prepare_spec(self, schema: Any, mode: SchemaMode) -> tuple[SchemaSpec | None, Any]:
        """The spec of ``schema`` and its pre-flight report under ``mode`` (None, None for free
        text). A call's own schema gets its own report: ``self.report`` stays the Generator's."""
        if schema is None:
            return None, None
        spec = normalize_schema(schema, layout=self.layout)
        return spec, check_schema(spec, self.backend, mode)

    def _bound(self, spec: SchemaSpec | None, options: dict[str, Any]) -> tuple[Any, list[Any]]:
        if spec is None:
            return None, []
        return bound_schema(spec, max_string_length=options.get("max_string_length", self.max_string_length),
                            max_items=options.get("max_items", self.max_items))

    def _compile(self, spec: SchemaSpec | None, options: dict[str, Any] | None = None) -> Any:
        """Compile ``spec`` with the bounds of this Generator (or of ``options``)."""
        if spec is None:
            return None
        if isinstance(spec.target, ToolParser):  # tool calls: bounds are in its arguments already
            return compile_spec(spec, self.model.tokenizer_data, backend=self.backend)
        grammar_spec, _ = self._bound(spec, options or {})
        return compile_spec(grammar_spec, self.model.tokenizer_data, backend=self.backend)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, prompt: str | Messages | Sequence[str | Messages], *,
                 return_result: bool = False, **overrides: Any) -> Any:
        """Generate for one prompt (-> value) or a list of prompts (-> list, one batch).

        ``overrides`` change this call's options: max_tokens, temperature, top_p, top_k, seed,
        repetition_penalty, no_repeat_ngram_size, max_string_length, max_items, schema_mode,
        max_retries, retry_temperature. Errors are raised; for a list the first failing item's
        error is raised after the whole batch ran (use :meth:`batch` with ``return_exceptions=True`` to keep going).
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
              return_exceptions: bool = True, schemas: Sequence[Any] | None = None,
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
        policy = RetryPolicy.resolve(overrides.pop("max_retries", self.max_retries),
                                     overrides.pop("retry_temperature", self.retry_temperature),
                                     streaming=on_tokens is not None)
        results: list[Any] = [None] * len(prompts)
        stats: list[SpecStats | None] = [None] * len(prompts)
        failed: list[list[Any]] = [[] for _ in prompts]  # each item's failed attempts so far
        attempts = policy.attempts(range(len(prompts)))
        for attempt, todo in attempts:
            options = policy.options(overrides, attempt, self.sampling)
            requests: list[tuple[int, Request, SchemaSpec | None]] = []
            for i in todo:
                if attempt:
                    failed[i].append(results[i])
                try:
                    cb = _token_callback(i, on_tokens, on_progress)
                    schema = schemas[i] if schemas is not None else _SAME
                    req, spec = self.make_request(prompts[i], schema=schema, on_tokens=cb, **options)
                    requests.append((i, req, spec))
                except ConstrainedSpecError as e:
                    results[i] = e
            self.new_engine().run([r for _, r, _ in requests])
            for i, req, spec in requests:
                results[i] = self.finalize(req, spec, return_result)
                earlier_stats = stats[i]
                stats[i] = req.stats if earlier_stats is None else earlier_stats.merge(req.stats)
                attempts.record(i, results[i])
        for item, st, earlier in zip(results, stats, failed):
            _record_attempts(item, st, earlier)
        if not return_exceptions:
            for item in results:
                if isinstance(item, BaseException):
                    raise item
        return results

    # -- building blocks (also used by servers that run their own engine loop) --------------
    def make_request(self, prompt: str | Messages, *, schema: Any = _SAME,
                     schema_mode: SchemaMode | None = None,
                     on_tokens: Callable[[list[int]], None] | None = None,
                     tools: Any = _SAME,
                     **overrides: Any) -> tuple[Request, SchemaSpec | None]:
        """A ready-to-run engine request for ``prompt`` and the spec to finalize it with.

        ``schema`` defaults to the Generator's own (compiled once); another schema is
        normalised, checked (under ``schema_mode``, default the Generator's) and compiled here
        (compiles are cached). Raises :class:`ConstrainedSpecError` subclasses for bad input,
        before any compute. ``overrides``: any :class:`SamplingParams` field,
        ``max_string_length``, ``max_items``, ``reasoning``, ``max_reasoning_tokens``. ``tools``:
        this request's :class:`~constrained_spec.frontend.tools.ToolSet` (or a list of tools, under
        ``"auto"``; default the Generator's; None: no tools); while calls are possible, its
        grammar replaces ``schema``.
        """
        toolset = self.tools if tools is _SAME else self._toolset(tools, "auto", False, None)
        mode = self.schema_mode if schema_mode is None else _check_schema_mode(schema_mode)
        bounds = {k: overrides.pop(k) for k in _SPEC_OPTIONS if k in overrides}
        markers = (resolve_reasoning(overrides.pop("reasoning"), self.model.tokenizer)
                   if "reasoning" in overrides else self.reasoning)
        budget = check_reasoning_budget(overrides.pop("max_reasoning_tokens",
                                                      self.max_reasoning_tokens))
        unknown = sorted(set(overrides) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            known = sorted([*SamplingParams.__dataclass_fields__, *_SPEC_OPTIONS, *_CALL_OPTIONS,
                            *_REASONING_OPTIONS])
            raise ConfigError(f"unknown option {unknown[0]!r}; a call can set {', '.join(known)}",
                              option=unknown[0])
        params = SamplingParams(**{**self.sampling.__dict__, **overrides})
        _check_count(bounds.get("max_string_length"), "max_string_length", minimum=1, allow_none=True)
        _check_count(bounds.get("max_items"), "max_items", minimum=1, allow_none=True)
        calls = toolset is not None and toolset.active
        own_calls = self.tools is not None and self.tools.active  # self.spec is their grammar
        if calls and schema is not _SAME and schema is not None:
            self._toolset(toolset, "auto", False, schema)  # raises: a schema with calls
        if calls and toolset is not None:
            same = toolset is self.tools and not bounds
            spec = self.spec if same else self._tool_spec(toolset, bounds)
            compiled = self.compiled if same else self._compile(spec)
        elif schema is _SAME and own_calls:
            spec, compiled = None, None  # this call has no tools: free text
        elif schema is _SAME:
            spec, compiled = self.spec, self.compiled
            if spec is not None and mode != self.schema_mode:
                check_schema(spec, self.backend, mode)
            if bounds:
                compiled = self._compile(spec, bounds)
        else:
            spec, _ = self._prepare_spec(schema, mode)
            compiled = self._compile(spec, bounds)
        ids = _encode_with_check(self.model, prompt, None if calls else spec, self.system_prompt,
                                 params.max_tokens, toolset)
        matcher: Any
        if markers is not None:  # the grammar starts after the reasoning
            matcher = reasoning_matcher(self.model, compiled, markers, ids, budget)
        else:
            matcher = compiled.new_matcher() if compiled is not None else None
        return Request(ids, matcher, params, self.model.eos_token_ids, on_tokens=on_tokens), spec

    def new_engine(self) -> Engine:
        """An engine over this Generator's model runner and drafter."""
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
                                    reasoning=reasoning)
        return value

    @staticmethod
    def _generation_error(req: Request, text: str) -> GenerationError:
        """The typed error of a request that ended in "error", with its partial output."""
        err = req.error
        if not isinstance(err, GenerationError):  # set outside the engine's own guards
            err = GenerationError.from_exception("engine", err, token_ids=req.output_ids,
                                                 stats=req.stats)
        err.partial_text = text
        return err


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


def _record_attempts(item: Any, stats: SpecStats | None, earlier: list[Any]) -> None:
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
def generate(model: Any, prompt: str | Messages, *, schema: type[T], max_tokens: int = ...,
             temperature: float = ..., top_p: float = ..., top_k: int = ..., seed: int | None = ...,
             speculative: SpeculativeConfig | bool | None = ..., return_result: Literal[False] = ...,
             **options: Any) -> T: ...
@overload
def generate(model: Any, prompt: str | Messages, *, schema: type[T], max_tokens: int = ...,
             temperature: float = ..., top_p: float = ..., top_k: int = ..., seed: int | None = ...,
             speculative: SpeculativeConfig | bool | None = ..., return_result: Literal[True],
             **options: Any) -> GenerationResult[T]: ...
@overload
def generate(model: Any, prompt: str | Messages, *, schema: Any = ..., max_tokens: int = ...,
             temperature: float = ..., top_p: float = ..., top_k: int = ..., seed: int | None = ...,
             speculative: SpeculativeConfig | bool | None = ..., return_result: bool = ...,
             **options: Any) -> Any: ...
def generate(model: Any, prompt: Any, *, schema: Any = None, max_tokens: int = 512,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, speculative: SpeculativeConfig | bool | None = None,
             return_result: bool = False, **options: Any) -> Any:
    """Generate one output that matches ``schema`` (see :class:`Generator` for every option).

    Returns the validated value: a Pydantic instance for a Pydantic model, a dict for a JSON
    Schema, the string for a regex or grammar, the chosen value for choices; or a
    :class:`GenerationResult` with ``return_result=True``. With ``tools=[...]`` (and
    ``tool_choice``, ``parallel_tool_calls``): a :class:`~constrained_spec.frontend.tools.ToolCall`, a
    list of them, or the text (``tool_choice="auto"``).
    """
    gen: Generator[Any] = Generator(model, schema=schema, max_tokens=max_tokens,
                                    temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                    speculative=speculative, **options)
    return gen(prompt, return_result=return_result)
