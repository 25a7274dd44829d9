"""The public API: ``generate`` for one call, ``Generator`` to compile once and serve many.

    person = generate(None, "Ada Lovelace, 36, mathematician", schema=Person)   # -> Person

Every completed output is validated (jsonschema + Pydantic) before it is returned; running
out of ``max_tokens`` first raises :class:`IncompleteOutputError` with the partial text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

from constrained_spec.grammar import compile_spec
from constrained_spec.schemas import JsonLayout, SchemaSpec, check_schema, normalize_schema, parse_output

from .config import SamplingParams, SpeculativeConfig, resolve_speculative
from .drafters import make_drafter
from .engine import Engine, Request
from .errors import ConfigError, ConstrainedSpecError, IncompleteOutputError, PromptTooLongError
from .models import LoadedModel, load_model
from .prompts import Messages, encode_prompt
from .stats import SpecStats

T = TypeVar("T")

Backend = Literal["xgrammar", "outlines"]
SchemaMode = Literal["default", "strict", "lenient"]

_SAME: Any = object()  # "the Generator's own schema"

#: How JSON is laid out by default: the compact one-line form with ", " and ": " separators.
DEFAULT_LAYOUT = JsonLayout()


@dataclass
class GenerationResult(Generic[T]):
    """Everything about one generation: the validated value and how it was produced."""

    value: T
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)


def _encode_with_check(loaded: LoadedModel, prompt: Any, spec: SchemaSpec | None,
                       system_prompt: Any, max_tokens: int, lookahead: int) -> list[int]:
    ids = encode_prompt(loaded.tokenizer, prompt, spec, system_prompt)
    limit = loaded.runner.max_context
    if len(ids) + max_tokens + lookahead + 1 > limit:
        raise PromptTooLongError(
            f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
            f"of {limit} tokens; shorten the prompt or lower max_tokens", option="prompt")
    return ids


class Generator(Generic[T]):
    """A model + schema compiled once, serving many prompts (a list runs as one batch).

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
        ones, ``"strict"`` raises on both, ``"lenient"`` only warns.
    system_prompt:
        ``None``: describe the schema in a system message; a string: your system message;
        ``False``: none.
    layout:
        How JSON is written (:class:`JsonLayout`).
    """

    def __init__(self, model: Any = None, *, schema: Any = None, max_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, speculative: SpeculativeConfig | bool | None = None,
                 backend: Backend = "xgrammar", schema_mode: SchemaMode = "default",
                 system_prompt: str | bool | None = None, layout: JsonLayout | None = None,
                 tokenizer: Any = None, max_batch_size: int = 64) -> None:
        if backend not in ("xgrammar", "outlines"):
            raise ConfigError(f"unknown grammar backend {backend!r}; use 'xgrammar' or 'outlines'",
                              option="backend")
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                       seed=seed, max_tokens=max_tokens)
        self.speculative = resolve_speculative(speculative)
        self.backend = backend
        self.schema_mode = schema_mode
        self.system_prompt = system_prompt
        self.layout = layout or DEFAULT_LAYOUT
        self.max_batch_size = max_batch_size
        # schema problems surface before any model is loaded
        self.spec = self._prepare_spec(schema)
        self.model = load_model(model, tokenizer)
        self.drafter = make_drafter(self.speculative, self.model)
        self.compiled = self._compile(self.spec)

    def _prepare_spec(self, schema: Any) -> SchemaSpec | None:
        if schema is None:
            return None
        spec = normalize_schema(schema, layout=self.layout)
        self.report = check_schema(spec, self.backend, self.schema_mode)
        return spec

    def _compile(self, spec: SchemaSpec | None) -> Any:
        if spec is None:
            return None
        return compile_spec(spec, self.model.tokenizer_data, backend=self.backend)

    @property
    def _lookahead(self) -> int:
        spec = self.speculative
        if spec is None:
            return 0
        return spec.num_speculative_tokens + (spec.max_forced_tokens if spec.forced else 0)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, prompt: str | Messages | Sequence[str | Messages], *,
                 return_result: bool = False, **overrides: Any) -> Any:
        """Generate for one prompt (-> value) or a list of prompts (-> list, one batch).

        ``overrides`` change sampling for this call: max_tokens, temperature, top_p, top_k, seed.
        Errors are raised; for a list the first failing item's error is raised after the whole
        batch ran (use :meth:`batch` with ``return_exceptions=True`` to keep going).
        """
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
            out = self.batch(list(prompt), return_result=return_result, **overrides)
            for item in out:
                if isinstance(item, BaseException):
                    raise item
            return out
        out = self.batch([prompt], return_result=return_result, **overrides)[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def batch(self, prompts: Sequence[str | Messages], *, return_result: bool = False,
              return_exceptions: bool = True, schemas: Sequence[Any] | None = None,
              on_tokens: Callable[[int, list[int]], None] | None = None,
              **overrides: Any) -> list[Any]:
        """Run ``prompts`` as one batch; per item a value / result, or the error it raised.

        ``schemas`` gives each prompt its own schema (compiled and cached per schema);
        ``on_tokens(index, token_ids)`` streams tokens as they are accepted.
        """
        results: list[Any] = [None] * len(prompts)
        requests: list[tuple[int, Request, SchemaSpec | None]] = []
        for i, prompt in enumerate(prompts):
            try:
                cb = (lambda toks, i=i: on_tokens(i, toks)) if on_tokens else None
                schema = schemas[i] if schemas is not None else _SAME
                req, spec = self.make_request(prompt, schema=schema, on_tokens=cb, **overrides)
                requests.append((i, req, spec))
            except ConstrainedSpecError as e:
                results[i] = e
        self.new_engine().run([r for _, r, _ in requests])
        for i, req, spec in requests:
            results[i] = self.finalize(req, spec, return_result)
        if not return_exceptions:
            for item in results:
                if isinstance(item, BaseException):
                    raise item
        return results

    # -- building blocks (also used by servers that run their own engine loop) --------------
    def make_request(self, prompt: str | Messages, *, schema: Any = _SAME,
                     on_tokens: Callable[[list[int]], None] | None = None,
                     **overrides: Any) -> tuple[Request, SchemaSpec | None]:
        """A ready-to-run engine request for ``prompt`` and the spec to finalize it with.

        ``schema`` defaults to the Generator's own (compiled once); another schema is
        normalised, checked and compiled here (compiles are cached). Raises
        :class:`ConstrainedSpecError` subclasses for bad input, before any compute.
        """
        params = SamplingParams(**{**self.sampling.__dict__, **overrides})
        if schema is _SAME:
            spec, compiled = self.spec, self.compiled
        else:
            spec = self._prepare_spec(schema)
            compiled = self._compile(spec)
        ids = _encode_with_check(self.model, prompt, spec, self.system_prompt, params.max_tokens,
                                 self._lookahead)
        matcher = compiled.new_matcher() if compiled is not None else None
        return Request(ids, matcher, params, self.model.eos_token_ids, on_tokens=on_tokens), spec

    def new_engine(self) -> Engine:
        """An engine over this Generator's model runner and drafter."""
        return Engine(self.model.runner, speculative=self.speculative, drafter=self.drafter,
                      max_batch_size=self.max_batch_size)

    def finalize(self, req: Request, spec: SchemaSpec | None, return_result: bool = True) -> Any:
        """The value / :class:`GenerationResult` of a finished request, or the error it ended in."""
        text = self.model.tokenizer.decode(req.output_ids)
        if req.finish_reason == "length":
            return IncompleteOutputError(
                f"max_tokens={req.params.max_tokens} reached before the output was complete; "
                "raise max_tokens (partial output on .partial_text)",
                partial_text=text, token_ids=req.output_ids, stats=req.stats)
        if req.finish_reason == "cancelled":
            return ConstrainedSpecError("the request was cancelled")
        if req.finish_reason != "stop":
            return ConstrainedSpecError(f"generation failed: {req.error}")
        try:
            value = parse_output(spec, text) if spec is not None else text
        except ConstrainedSpecError as e:
            if hasattr(e, "stats"):
                e.stats = req.stats
            return e
        if return_result:
            return GenerationResult(value=value, text=text, token_ids=list(req.output_ids),
                                    finish_reason=req.finish_reason, stats=req.stats)
        return value


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
    :class:`GenerationResult` with ``return_result=True``.
    """
    gen: Generator[Any] = Generator(model, schema=schema, max_tokens=max_tokens,
                                    temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                    speculative=speculative, **options)
    return gen(prompt, return_result=return_result)
