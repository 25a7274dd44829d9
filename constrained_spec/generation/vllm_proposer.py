"""Our drafting inside vLLM's engine: the forced and grammar-checked n-gram drafts as a vLLM
proposer (``speculative_config={"method": "custom_class", "model": PROPOSER, ...}``).

vLLM's model runner builds the proposer with its ``VllmConfig`` and, after each step's
sampling, calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``: rows
of the running batch, token ids only. The grammar of a row comes from `REGISTRY`, which our
`VLLMEngine` fills when it submits a request (vLLM's request id -> our `Request`, whose
matcher holds the committed tokens); the row's request id is read from the runner's input
batch. Per row the proposer forks the request's matcher, advances the fork by the tokens vLLM
sampled that our side has not committed yet, and drafts as our engine does
(`engine.draft_rounds`: forced tokens, then n-gram lookups checked token by token against the
fork, alternating). vLLM's structured-output manager masks every verified row itself, so the
fork records no mask rows (`AcceptCursor`).

What it requires of vLLM's process layout: the runner in the process that submits the
requests -- vLLM's engine core in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what
`vllm_engine.import_vllm` sets) and one worker (no tensor / pipeline parallel, no Ray). Under
tensor parallel every worker would propose, in processes our registry does not reach: there
`vllm_engine.speculative_config` falls back to vLLM's own n-gram drafter with a warning
(docs/scale-out.md).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from constrained_spec.drafters.base import AcceptCursor, DraftState
from constrained_spec.drafters.forced import ForcedDrafter
from constrained_spec.drafters.ngram import NgramDrafter
from constrained_spec.generation.engine import Request, draft_rounds

logger = logging.getLogger(__name__)

#: the class path vLLM loads (``speculative_config["model"]``)
PROPOSER = f"{__name__}.GrammarProposer"


@dataclass(frozen=True)
class Drafting:
    """What our proposer drafts for the requests of one engine: up to ``max_forced`` forced
    tokens and ``k`` n-gram drafts (``ngram`` None: forced tokens only)."""

    k: int
    max_forced: int
    ngram: NgramDrafter | None


def _follow(limit: int, cap: int, proposed: int, took: int) -> int:
    """The next step's limit on drafts of one kind after ``took`` of ``proposed`` were accepted:
    halved (to 1 at least) when none were, one more (up to ``cap``) when all were."""
    if not proposed:
        return limit
    limit = cap if limit < 0 else limit
    return max(1, limit // 2) if took == 0 else min(cap, limit + 1) if took == proposed else limit


@dataclass(eq=False)
class Entry:
    """A request vLLM runs for us: our request, what to draft for it, and what its last
    proposal taught. vLLM verifies every draft it is given, so the drafts a step follow the
    request's acceptance, copied (n-gram) and forced ones apart: a limit halved (to 1 at least)
    after a step that accepted none of that kind and grown by one after a step that accepted
    all. Forced tokens are the grammar's jump-forward tokens: certain where the grammar allows
    one token, but a forced string the model tokenizes another way is refused like any draft."""

    request: Request
    drafting: Drafting
    limit: int = -1  # copied drafts a step; -1: drafting.k
    forced_limit: int = -1  # forced drafts a step; -1: drafting.max_forced
    last: list[bool] = field(default_factory=list)  # the last proposal: per draft, forced?

    def learn(self, accepted: int) -> None:
        """The last proposal's first ``accepted`` drafts were accepted."""
        took = self.last[:accepted]
        self.limit = _follow(self.limit, self.drafting.k, self.last.count(False), took.count(False))
        self.forced_limit = _follow(self.forced_limit, self.drafting.max_forced,
                                    self.last.count(True), took.count(True))
        self.last = []


#: vLLM's request id -> our request and its drafting, while vLLM runs it (`VLLMEngine`)
REGISTRY: dict[str, Entry] = {}


def _registered(req_id: str) -> Entry | None:
    """The registry's entry for vLLM's internal request id: the id we submitted, to which
    vLLM appends ``-`` and 8 random characters (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)."""
    return REGISTRY.get(req_id) or REGISTRY.get(req_id.rsplit("-", 1)[0])


def _owning_runner() -> Any:
    """The vLLM model runner building the proposer: the nearest caller whose ``self`` is one
    (vLLM passes the proposer nothing else, and its rows' request ids live there)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for info in inspect.stack()[2:]:
        owner = info.frame.f_locals.get("self")
        if isinstance(owner, GPUModelRunner):
            return owner
    raise RuntimeError("constrained_spec's proposer must be built by vLLM's model runner")


class GrammarProposer:
    """vLLM's custom proposer over `REGISTRY`: forced and grammar-checked n-gram drafts for
    our requests, none for any other (a request vLLM runs that we did not submit)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.runner = _owning_runner()

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # no weights
        return None

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        req_ids = self.runner.input_batch.req_ids
        out: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            entry = _registered(req_ids[i]) if i < len(req_ids) else None
            n = int(num_tokens_no_spec[i])
            if entry is None or not sampled or n >= self.max_model_len:
                out.append([])
                continue
            entry.learn(len(sampled) - 1)  # the tokens sampled: accepted drafts and one more
            try:
                out.append(self._draft(entry, token_ids_cpu[i, :n].tolist(), n))
            except Exception:  # a draft is only a guess: never fail vLLM's step over one
                logger.exception("drafting for %s failed; no drafts this step", req_ids[i])
                out.append([])
        return out

    def _draft(self, entry: Entry, context: list[int], n: int) -> list[int]:
        """Drafts for one row: ``context`` is its prompt and every token vLLM sampled."""
        r, drafting = entry.request, entry.drafting
        if r.finished or r.matcher is None:
            return []
        sampled = context[len(r.prompt_ids):]
        fork = r.matcher.fork()
        for tok in sampled[len(r.output_ids):]:  # sampled by vLLM, not committed here yet
            if not fork.accept(tok) or fork.is_terminated():
                return []  # a stop token, or a disagreement the commit will report
        room = min(self.k, r.params.max_tokens - len(sampled), self.max_model_len - n - 1)
        if room <= 0:
            return []
        st = DraftState(r.id, context, AcceptCursor(fork, room + 1), r.params, None,
                        prompt_len=len(r.prompt_ids))
        cap = drafting.max_forced if entry.forced_limit < 0 else entry.forced_limit
        forced = ForcedDrafter(min(cap, room)) if drafting.max_forced else None
        draft_rounds([st], forced, drafting.ngram, drafting.k)
        flags = st.forced_flags()
        if entry.limit >= 0 and flags.count(False) > entry.limit:  # cut at the copy past it
            st.cut([j for j, f in enumerate(flags) if not f][entry.limit])
        entry.last = st.forced_flags()
        return st.tokens[:room]
