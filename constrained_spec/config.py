"""User-facing option objects: sampling parameters and the speculative-decoding config, and
the checks other option objects share (:func:`check_count`, :func:`is_real`).

Both are validated on construction, so a bad value fails before any model is loaded, with
the option's name in the message. The other groups of ``Generator`` options (schema, retries,
reasoning, tools) live next to the code that uses them; docs/options.md lists every group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, overload

from constrained_spec.errors import ConfigError

SpeculativeMethod = Literal["ngram", "eagle3", "mtp", "draft_model"]
METHODS: tuple[str, ...] = ("ngram", "eagle3", "mtp", "draft_model")
MAX_SPECULATIVE_TOKENS = 8
# Chosen by measurement on the embedded model (benchmarks/RESULTS.md, "n-gram k sweep").
DEFAULT_NUM_SPECULATIVE_TOKENS = 5
#: Forced drafts per step at most: each is one more verified row (a bitmask row per request).
MAX_FORCED_TOKENS = 64
#: Longest n-gram the prompt-lookup drafter matches.
MAX_PROMPT_LOOKUP = 32
#: A seed is a 64-bit generator seed (torch.Generator.manual_seed overflows past it).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_REPETITION_PENALTY = 10.0
MAX_NO_REPEAT_NGRAM_SIZE = 64
#: Most alternatives listed per emitted token with ``logprobs`` (OpenAI's and vLLM's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter proposes tokens, and how many per step.

    Parameters
    ----------
    method:
        ``"ngram"`` (prompt lookup), ``"eagle3"``, ``"mtp"`` or ``"draft_model"``; ``None``
        leaves only the grammar-forced drafter.
    num_speculative_tokens:
        Drafts proposed by ``method`` per step (1..8), after any forced tokens.
    model:
        The drafter's weights where the method needs them. For ``"draft_model"`` (required): a
        smaller causal LM sharing the target's tokenizer, as a checkpoint folder, a ``.gguf``
        file, a ``(transformers_model, tokenizer)`` pair or a ``LoadedModel``. For ``"eagle3"``
        and ``"mtp"``: a head folder (trained by ``python -m constrained_spec.training``, or a
        public EAGLE-3 checkpoint; for mtp also a checkpoint with a DeepSeek-V3-style MTP layer),
        a ``DraftHead``, or None: the head shipped for the embedded default model (for mtp, the
        target's own MTP layer when its checkpoint has one).
    forced:
        Propose the grammar's forced continuation as drafts (q = 1). On by default.
    max_forced_tokens:
        Cap on forced drafts per step, 0..64 (they are nearly free to verify, but not entirely).
    prompt_lookup_max, prompt_lookup_min:
        The longest and shortest n-gram the ``ngram`` drafter matches (1..32).
    adaptive:
        Size each request's drafts to the load (`generation.budget`): verify a draft only
        while its expected accepted tokens pay for its row at this batch's measured cost;
        forced tokens are always verified. On by default, where the runner is row-invariant
        (the exact CPU runner): there outputs are the same either way.
    """

    method: SpeculativeMethod | None = "ngram"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    model: Any = None  # a path, or for draft_model also (model, tokenizer) / LoadedModel
    forced: bool = True
    max_forced_tokens: int = 16
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}",
                              option="speculative.method")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(
                self.num_speculative_tokens, int) or not (
                0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ConfigError(f"must be an integer in 0..{MAX_SPECULATIVE_TOKENS}, got "
                              f"{self.num_speculative_tokens!r}", option="speculative.num_speculative_tokens")
        if self.method == "draft_model" and self.model is None:
            raise ConfigError("method 'draft_model' needs a draft model: a checkpoint folder, a "
                              ".gguf file or a (model, tokenizer) pair sharing the target's "
                              "tokenizer", option="speculative.model")
        if isinstance(self.max_forced_tokens, bool) or not isinstance(self.max_forced_tokens, int) or not (
                0 <= self.max_forced_tokens <= MAX_FORCED_TOKENS):
            # every step reserves a mask row per forced token, and the prompt check reserves
            # context for them: a huge cap is a huge allocation and a bogus "prompt too long"
            raise ConfigError(f"must be an integer in 0..{MAX_FORCED_TOKENS}, got "
                              f"{self.max_forced_tokens!r:.40}", option="speculative.max_forced_tokens")
        if any(isinstance(v, bool) or not isinstance(v, int)
               for v in (self.prompt_lookup_min, self.prompt_lookup_max)) or not (
                1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP):
            raise ConfigError(f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max <= "
                              f"{MAX_PROMPT_LOOKUP}, got {self.prompt_lookup_min!r:.20} and "
                              f"{self.prompt_lookup_max!r:.20}", option="speculative.prompt_lookup_min")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"must be true or false, got {self.adaptive!r:.40}",
                              option="speculative.adaptive")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpeculativeConfig":
        """From the JSON users pass to serving engines (``--speculative-config``)."""
        if not isinstance(data, dict):
            raise ConfigError("must be a JSON object", option="speculative-config")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown keys {sorted(unknown)}; known: {sorted(known)}",
                              option="speculative-config")
        return cls(**data)


def resolve_speculative(speculative: Any) -> SpeculativeConfig | None:
    """``None`` → the default config; ``False`` → no speculation at all; a config or dict as given."""
    if speculative is None or speculative is True:
        return SpeculativeConfig()
    if speculative is False:
        return None
    if isinstance(speculative, SpeculativeConfig):
        return speculative
    if isinstance(speculative, dict):
        return SpeculativeConfig.from_dict(speculative)
    if isinstance(speculative, str):
        return SpeculativeConfig(method=speculative)  # type: ignore[arg-type]
    raise ConfigError(f"expected a SpeculativeConfig, dict, None or False, got {type(speculative).__name__}",
                      option="speculative")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; ``temperature == 0`` is greedy (docs/options.md, "Sampling").

    ``repetition_penalty`` and ``no_repeat_ngram_size`` form the opt-in repetition guard
    (``sampling.apply_repetition_guard``): they change the model's distribution, identically
    at every verified position, so speculation stays exact for the modified distribution.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 512
    # > 1: the logits of tokens already in the output are divided (positive) or multiplied
    # (negative) by it, as in transformers / CTRL; 1.0 = off
    repetition_penalty: float = 1.0
    # n > 0: a token that would repeat an n-gram already in the output is banned; 0 = off
    no_repeat_ngram_size: int = 0
    # no stop (eos) token before this many output tokens; ignore_eos: none before max_tokens.
    # Only where the grammar allows another token: a grammar that must end, ends
    # (`engine.mask_stop_tokens`)
    min_tokens: int = 0
    ignore_eos: bool = False
    # None: no logprobs; k in 0..20: each emitted token's logprob and its k most likely
    # alternatives (`generation.logprobs`, where the two modes' distributions are said)
    logprobs: int | None = None
    logprobs_mode: str = "masked"

    def __post_init__(self) -> None:
        if not is_real(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise ConfigError(f"must be a finite number in [0, 100], got {self.temperature!r}",
                              option="temperature")
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"must be in (0, 1], got {self.top_p!r}", option="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"must be an integer >= 0 (0 = off), got {self.top_k!r}", option="top_k")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"must be a positive integer, got {self.max_tokens!r}", option="max_tokens")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ConfigError(f"must be None or an integer in [-2**63, 2**63 - 1] (a 64-bit "
                              f"generator seed), got {self.seed!r:.40}", option="seed")
        if not is_real(self.repetition_penalty) or not (
                1.0 <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ConfigError(f"must be a number in [1, {MAX_REPETITION_PENALTY:g}] (1 = off; 1.1 to "
                              f"1.3 is typical), got {self.repetition_penalty!r}",
                              option="repetition_penalty")
        n = self.no_repeat_ngram_size
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NO_REPEAT_NGRAM_SIZE:
            raise ConfigError(f"must be an integer in 0..{MAX_NO_REPEAT_NGRAM_SIZE} (0 = off), got "
                              f"{n!r}", option="no_repeat_ngram_size")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"must be an integer >= 0 (0 = off), got {self.min_tokens!r:.40}",
                              option="min_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"must be True or False, got {self.ignore_eos!r:.40}",
                              option="ignore_eos")
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"must be None (off) or an integer in 0..{MAX_TOP_LOGPROBS} (the "
                              f"alternatives listed per token), got {k!r:.40}", option="logprobs")
        if self.logprobs_mode not in ("masked", "raw"):
            raise ConfigError(f"must be 'masked' (the grammar's renormalized distribution) or "
                              f"'raw' (the model's, before the mask), got {self.logprobs_mode!r:.40}",
                              option="logprobs_mode")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def holds_stop(self, position: int) -> bool:
        """Whether the stop tokens are masked at output ``position`` (``min_tokens``,
        ``ignore_eos``)."""
        return self.ignore_eos or position < self.min_tokens

    @property
    def guarded(self) -> bool:
        """Whether the repetition guard changes the distribution."""
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0


def is_real(x: object) -> bool:
    """Whether ``x`` is a finite int or float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@overload
def check_count(value: object, option: str, *, minimum: int,
                allow_none: Literal[False] = False) -> int: ...
@overload
def check_count(value: object, option: str, *, minimum: int, allow_none: bool) -> int | None: ...
def check_count(value: object, option: str, *, minimum: int, allow_none: bool = False) -> int | None:
    """``value`` when it is an integer >= ``minimum`` (or None where ``allow_none``); else a
    :class:`ConfigError` naming ``option``. A bool is not a count."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"must be an integer >= {minimum}{' or None' if allow_none else ''}, "
                          f"got {value!r}", option=option)
    return value
