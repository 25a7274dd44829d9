"""The decoding engine: batched propose -> score -> verify -> commit steps over running requests.

The engine knows nothing about tokenization or schemas: it sees token ids, one grammar
matcher per request (or none, for free text) and a runner that owns the KV cache
(`protocols.Runner`). The design, its words and the correctness rules it keeps (each with the
test that checks it) are in docs/design.md; this module is its "one decoding step".

`Engine.step`, for all running requests at once, over one `StepBatch`:

1. propose: forced tokens first, then the model drafter continues; every draft position is
   masked by a fork of the request's matcher, which also records the K+1 target mask rows;
2. score: one target forward over ``[pending token, drafts...]`` for every request;
3. verify: the mask rows are applied to the target logits (kernel), then the sampling
   transforms (repetition guard, temperature / top-k / top-p), then masked rejection sampling
   (kernel) picks the accepted prefix + a recovered or bonus token;
4. commit: emitted tokens go to the real matcher, the KV cache keeps accepted positions.

Cache invariant: between steps the cache holds ``prompt + output[:-1]``; the last token
(the *pending* token, the prompt's last token before the first step) is fed with the drafts.

Faults stay with their request (`contain`, the one place an exception becomes a failure): an
exception from one request's own work (its matcher while drafting or committing, the drafter
on its proposal, its ``on_tokens`` callback) finishes that request alone with
``finish_reason == "error"`` and a :class:`GenerationError` naming the stage; one from the
shared forward or verification finishes the requests of that step. Batched work that fails
(a prefill, a proposal) is retried request by request, so only the request that fails alone
fails. The engine stays usable either way: finished requests' slots are freed by ``reap``.
Only ``Exception`` is caught: KeyboardInterrupt and SystemExit always propagate (a failed
prefill gives its slots back first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters.base import Drafter, DraftState, GrammarCursor
from constrained_spec.drafters.forced import ForcedDrafter
from constrained_spec.errors import ConfigError, GenerationError, GrammarCostError, GrammarDeadEndError
from constrained_spec.generation.budget import Acceptance, DraftBudget
from constrained_spec.generation.logprobs import TokenLogprob, request_rows, row_logprobs
from constrained_spec.generation.loops import LoopDetector
from constrained_spec.generation.prefill import PrefillQueue
from constrained_spec.generation.sampling import apply_repetition_guard, process_logits
from constrained_spec.generation.stats import SpecStats
from constrained_spec.generation.timing import StepTimer
from constrained_spec.grammar.matcher import Matcher
from constrained_spec.kernels import RejectionOutput, apply_bitmask, rejection_sample
from constrained_spec.model.protocols import Runner

logger = logging.getLogger(__name__)

# prompt tokens per prefill forward (batch x padded length), to bound activation memory
_PREFILL_TOKENS = 4096
# forced / n-gram alternations per step (each round must extend the proposal)
_MAX_DRAFT_ROUNDS = 4


def _check_batch_size(value: Any) -> None:
    # 0 (or less) would admit nothing, and run() would step an empty batch forever
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be an integer >= 1, got {value!r}", option="max_batch_size")


@dataclass
class Request:
    """One generation in flight."""

    prompt_ids: list[int]
    matcher: Matcher | None  # None = free text, stops at an eos token
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    on_tokens: Callable[[list[int]], None] | None = None  # streaming callback (emitted ids)
    id: int = -1
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "loop" | "cancelled" | "error"
    error: BaseException | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    slot: int = -1
    generator: torch.Generator | None = None
    drafter_state: Any = None
    cancelled: bool = False
    loops: LoopDetector | None = field(default_factory=LoopDetector)  # None: never stop a loop
    #: on an incomplete finish (RESUMABLE), reap leaves the slot and its cache to the caller,
    #: who resumes a retry from it (generation/retry.py) or frees it (runner.free_slot); reap
    #: sets it False when it freed the slot after all
    keep_slot: bool = False
    resumed: bool = False  # continues a failed attempt's output (generation/retry.py)
    #: per committed token, when ``params.logprobs`` is set (`generation.logprobs`)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: its model drafts' acceptance, for the draft budget (`generation.budget`)
    draft_acceptance: Acceptance = field(default_factory=Acceptance)
    #: seconds its grammar work took (its matcher, and its drafts' forks): `check_grammar_work`
    grammar_s: float = 0.0  # CPU seconds
    grammar_calls: int = 0  # the calls on its matcher and forks that took it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids


# -- fault isolation ------------------------------------------------------------------------
#: finish reasons a retry can resume from (the output so far is grammar-valid, only unfinished)
RESUMABLE = ("length", "loop")


def fail(r: Request, stage: str, exc: BaseException) -> None:
    """End ``r`` with a typed error naming ``stage`` (its slot is freed at the next reap); the
    tokens it already emitted stay on the error. Overrides a finish reason set in the same
    step: the consumer may not have received the last tokens."""
    r.finish_reason = "error"
    r.error = GenerationError.from_exception(stage, exc, token_ids=r.output_ids, stats=r.stats)


#: A request's grammar work may take GRAMMAR_GRACE_S seconds plus GRAMMAR_S_PER_CALL per call
#: on its matcher (a mask filled, a token accepted) in all, and GRAMMAR_STEP_S_PER_CALL per
#: call in one step after its first (docs/security.md), per 100,000 entries of the vocabulary
#: (a mask the matcher cannot take from its cache tests every token: 30 ms on a 49,152-token
#: vocabulary for a length-bounded string), counted in the engine thread's CPU time (a wait for
#: the GIL or a core is not work). A grammar ambiguous enough to take more (the matcher's work
#: growing with every token, 0.7 s and more a mask) would hold the engine thread, and with it
#: every other request, for minutes; `grammar.compile.check_matcher` refuses the worst at
#: compile. xgrammar's calls cannot be interrupted, so the bound is checked after each step:
#: the engine is held for at most one step past it.
GRAMMAR_GRACE_S = 0.5
GRAMMAR_S_PER_CALL = 0.2
GRAMMAR_STEP_S_PER_CALL = 1.0
GRAMMAR_MIN_SCALE = 0.05  # what the bounds are at least: 10 ms a call, 50 ms in a step


def check_grammar_work(r: Request, step_s: float, step_calls: int, first: bool) -> None:
    """End ``r`` with a `GrammarCostError` when its grammar work is past the bounds above
    (``step_s``, ``step_calls``: this step's share; ``first``: the step emitted its first
    tokens)."""
    if r.finished or r.matcher is None:
        return
    # per vocabulary entry, with a floor: a grammar's own work (tool calls' alternatives)
    # costs tenths of a millisecond a call whatever the vocabulary
    scale = max(r.matcher.vocab_size / 100_000, GRAMMAR_MIN_SCALE)
    per_call, step_limit = GRAMMAR_S_PER_CALL * scale, GRAMMAR_STEP_S_PER_CALL * scale
    allowed = GRAMMAR_GRACE_S + per_call * r.grammar_calls
    if r.grammar_s > allowed or (not first and step_s > step_limit * max(step_calls, 1)):
        r.finish_reason = "error"
        r.error = GrammarCostError(
            f"the grammar took {r.grammar_s:.2f} s of matcher work in {r.grammar_calls} calls "
            f"for {len(r.output_ids)} output tokens, {step_s:.2f} s in {step_calls} in the last "
            f"step (at most {GRAMMAR_GRACE_S} s + {per_call * 1000:.0f} ms a call, "
            f"{step_limit * 1000:.0f} ms a call in a step, for this vocabulary): the schema is "
            "too ambiguous for its matcher (nested counted repetitions such as "
            "'(a{1,100}){1,99}' cost more with every token); simplify the pattern or grammar "
            "(the request was stopped so the others are served)",
            token_ids=r.output_ids, stats=r.stats)


def commit_tokens(r: Request, emitted: Sequence[int], drafting: GrammarCursor | None = None,
                  refused: Callable[[Request, int], None] | None = None) -> list[int]:
    """Give ``emitted`` (verified tokens, in order) to ``r``: its real matcher, its output (up
    to a stop, a repetition loop or ``max_tokens``), ``emitted_tokens`` and its ``on_tokens``
    callback; sets the finish reason when one is reached. Returns the tokens kept. Any engine
    commits through here, so every engine stops, counts and streams alike. ``drafting``: the
    cursor of this step's drafts, whose grammar work counts with the commit's
    (`check_grammar_work`). ``refused(r, token)``: what ends ``r`` when its matcher refuses an
    emitted token (by default a ``"commit"`` failure: our own verifier masked it, so it is a
    bug); an engine whose masks are not ours (vLLM's) ends the request its own way."""
    st = r.stats
    kept: list[int] = []
    started, first = time.thread_time(), not r.output_ids
    for tok in emitted:
        if len(r.output_ids) >= r.params.max_tokens:
            break
        if tok < 0:
            # no token is allowed here (all-masked row): the grammar reached a dead end, the
            # schema's fault (a rule that never ends), not the engine's
            r.finish_reason = "error"
            r.error = GrammarDeadEndError(
                f"the grammar allows no token after {len(r.output_ids)} output tokens and "
                "cannot end there: it matches no complete string from here (a rule that only "
                "refers to rules that never end?)", token_ids=r.output_ids, stats=r.stats)
            break
        if r.matcher is not None and not r.matcher.accept(tok):
            if refused is not None:
                refused(r, tok)
            else:  # cannot happen for a masked verifier; refuse loudly rather than emit garbage
                fail(r, "commit", RuntimeError(f"token {tok} rejected by the grammar after verification"))
            break
        if tok in r.eos_token_ids and (r.matcher is None or r.matcher.is_terminated()):
            finish(r, "stop")
            break
        r.output_ids.append(tok)
        kept.append(tok)
        if r.matcher is not None and r.matcher.must_stop():
            finish(r, "stop")
            break
        # ignore_eos asks for max_tokens tokens (a benchmark's fixed length): no loop stop
        if r.loops is not None and not r.params.ignore_eos and r.loops.push(tok) is not None:
            # a repetition loop (loops.py) would spend the rest of max_tokens: stop it here
            finish(r, "loop")
            st.record_loop(r.params.max_tokens - len(r.output_ids))
            break
    # the matcher's CPU (loops.py's: µs a token), its accepts and stop check, and the drafts'
    step_s = time.thread_time() - started + (drafting.seconds if drafting is not None else 0.0)
    step_calls = len(kept) + 1 + (drafting.calls if drafting is not None else 0)
    r.grammar_s += step_s
    r.grammar_calls += step_calls
    check_grammar_work(r, step_s, step_calls, first)
    st.emitted_tokens += len(kept)
    if kept and r.on_tokens is not None:
        with contain("callback", [r]):
            r.on_tokens(kept)
    if not r.finished and len(r.output_ids) >= r.params.max_tokens:
        finish(r, "length")
    return kept


def mask_stop_tokens(logits: torch.Tensor, reqs: Sequence[Request], num_rows: Sequence[int]) -> None:
    """Forbid the stop tokens (in place) on the verified rows where a request holds them back
    (``min_tokens``, ``ignore_eos``: `SamplingParams.holds_stop`); ``logits`` [N + B, V],
    grammar-masked, request b's ``num_rows[b]`` rows in order. The grammar wins: a row where
    the grammar allows nothing but a stop token keeps it (the output must end there)."""
    row = 0
    for r, n in zip(reqs, num_rows):
        held = [row + j for j in range(n) if r.params.holds_stop(len(r.output_ids) + j)]
        row += n
        if not held or not r.eos_token_ids:
            continue
        index = torch.tensor(held, device=logits.device)
        rows = logits[index]  # [H, V]
        masked = rows.clone()
        masked[:, list(r.eos_token_ids)] = float("-inf")
        other = torch.isfinite(masked).any(dim=1, keepdim=True)  # another token is allowed
        logits[index] = torch.where(other, masked, rows)


def draft_rounds(states: Sequence[DraftState], forced: ForcedDrafter | None,
                 drafter: Drafter | None, k: int) -> None:
    """Forced tokens, then ``drafter``'s (up to ``k``); for drafters that can resume anywhere
    (n-gram), alternate the two while either extends a proposal: a copied value, the forced
    punctuation and key after it, the next copied value, ... in one step. Any engine drafts
    through here (ours, and our proposer inside vLLM's: `vllm_proposer`)."""
    active = list(states)
    for _ in range(_MAX_DRAFT_ROUNDS):
        before = [len(s.tokens) for s in active]
        if forced is not None:
            forced.propose([s for s in active if s.cursor.constrained])
        if drafter is not None and k > 0:
            drafter.propose(active, k)
        if drafter is None or not drafter.resumable:
            return
        active = [s for s, n in zip(active, before) if len(s.tokens) > n and not s.cursor.exhausted]
        if not active:
            return


def run_requests(engine: Any, requests: Iterable[Request],
                 busy: Callable[[], bool] = lambda: False) -> list[Request]:
    """Every engine's ``run``: admit ``requests`` (up to ``engine.max_batch_size`` running) and
    step until all have finished and ``busy()`` (work the engine still owes after its requests
    finished) is False; returns them, finished."""
    waiting = list(requests)
    done: list[Request] = []
    while waiting or engine.running or busy():
        free = engine.max_batch_size - len(engine.running)
        if waiting and free > 0:
            admitted, waiting = waiting[:free], waiting[free:]
            done.extend(engine.admit(admitted))
        engine.safe_step()
        done.extend(r for r in engine.running if r.finished)
        engine.reap()
    return done


def contained_step(engine: Any) -> bool:
    """Every engine's ``safe_step``: ``engine.step()``, an exception it lets through ending
    the requests still running (stage ``"step"``); whether this step failed (counted in
    ``engine.failed_steps``)."""
    before = engine.failed_steps
    with contain("step", lambda: [r for r in engine.running if not r.finished]) as fault:
        engine.step()
    engine.failed_steps += fault.failed
    return bool(engine.failed_steps != before)


def finish(req: Request, reason: str) -> None:
    """End ``req`` with ``reason`` unless it has ended already."""
    if req.finish_reason is None:
        req.finish_reason = reason


@dataclass
class Fault:
    """What `contain` caught: the exception, or None when the block went through."""

    error: Exception | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@contextmanager
def contain(stage: str,
            reqs: Iterable[Request] | Callable[[], Iterable[Request]] = ()) -> Iterator[Fault]:
    """Turn an ``Exception`` raised in the ``with`` block into the typed failure of ``reqs``.

    Each request of ``reqs`` finishes with ``finish_reason == "error"`` and a GenerationError
    naming ``stage`` (`fail`); a callable names them when the exception comes (e.g. the
    requests still unfinished then). With no requests the exception is only logged: the caller
    tries another way (`Fault.failed` says so). KeyboardInterrupt and SystemExit propagate.
    """
    fault = Fault()
    try:
        yield fault
    except Exception as e:
        fault.error = e
        failed = list(reqs() if callable(reqs) else reqs)
        if failed:
            logger.exception("%s failed; ending request(s) %s", stage, [r.id for r in failed])
        else:
            logger.warning("%s failed for the batch; trying each request alone", stage, exc_info=True)
        for r in failed:
            fail(r, stage, e)


# -- one step's batch -----------------------------------------------------------------------
@dataclass
class StepBatch:
    """One step's requests and proposals, laid out flat for the target forward and the verifier.

    B requests; request b proposes K_b drafts and is verified on K_b + 1 rows (N = sum K_b);
    R = the most mask rows a request may use (1 + k + the forced cap); W = ceil(V / 32).
    """

    reqs: list[Request]  # [B]
    states: list[DraftState]  # [B]: drafts, their q, forced positions, grammar forks
    num_rows: list[int]  # [B]: K_b + 1
    bitmask: torch.Tensor  # int32 [B, R, W]: row i of request b masks the target after draft i
    row_index: torch.Tensor  # int64 [N + B]: the row of bitmask.view(-1, W) each logits row uses
    cu_num_drafts: torch.Tensor  # int64 [B + 1]: request b's drafts are cu[b]:cu[b + 1]
    draft_tokens: torch.Tensor  # int64 [N]
    draft_probs: torch.Tensor | None  # float32 [N, V]: q per draft (a point mass is one-hot);
    #                                   None when every draft is a point mass
    #: the verified rows of the requests that want logprobs (`logprobs.request_rows`) and
    #: their logits before the grammar mask ("raw") and after it ("masked"), set by `_verify`
    logprob_rows: list[int] = field(default_factory=list)
    logprob_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    #: prompt rows the step's forward carries for requests still reading their prompt
    #: (generation/prefill.py): (request, rows); no logits
    prompts: list[tuple[Request, list[int]]] = field(default_factory=list)

    @classmethod
    def build(cls, reqs: list[Request], states: list[DraftState], num_rows: list[int],
              bitmask: torch.Tensor, vocab_size: int) -> StepBatch:
        R = bitmask.shape[1]
        row_index = torch.tensor([b * R + j for b, n in enumerate(num_rows) for j in range(n)],
                                 dtype=torch.long)
        cu = torch.zeros(len(reqs) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor([len(s.tokens) for s in states]), 0)
        draft_tokens = torch.tensor([t for s in states for t in s.tokens], dtype=torch.long)
        return cls(reqs, states, num_rows, bitmask, row_index, cu, draft_tokens,
                   cls._draft_probs(states, int(cu[-1]), vocab_size))

    @staticmethod
    def _draft_probs(states: Sequence[DraftState], n: int, vocab_size: int) -> torch.Tensor | None:
        if not any(q is not None for s in states for q in s.q):
            return None
        probs = torch.zeros((n, vocab_size), dtype=torch.float32)  # [N, V]
        i = 0
        for s in states:
            for tok, q in zip(s.tokens, s.q):
                if q is None:
                    probs[i, tok] = 1.0  # a point mass is a one-hot q
                else:
                    probs[i] = q
                i += 1
        return probs

    @property
    def constrained(self) -> bool:
        """Whether any request has a grammar (else no row needs masking)."""
        return any(s.cursor.constrained for s in self.states)

    def per_row(self, values: Sequence[Any]) -> torch.Tensor:
        """One value per request, repeated over its verified rows: [N + B]."""
        return torch.repeat_interleave(torch.tensor(values), torch.tensor(self.num_rows))


class Engine:
    """Runs requests to completion in batched speculative steps."""

    def __init__(self, runner: Runner, *, speculative: SpeculativeConfig | None,
                 drafter: Drafter | None = None, max_batch_size: int = 64) -> None:
        _check_batch_size(max_batch_size)
        if drafter is not None and not isinstance(drafter, Drafter):
            raise ConfigError(f"{type(drafter).__name__} is not a drafter: it needs name, resumable, "
                              "propose and release (subclass constrained_spec.drafters.Drafter for "
                              "the defaults)", option="drafter")
        self.runner = runner
        self.spec = speculative
        self.forced = ForcedDrafter(speculative.max_forced_tokens) if (
            speculative is not None and speculative.forced and speculative.max_forced_tokens > 0) else None
        self.drafter = drafter
        self.k = speculative.num_speculative_tokens if (speculative and drafter) else 0
        #: sizes each request's drafts to the load; None: every draft is verified. Only on a
        #: row-invariant runner: the cuts follow measured times, and where a row's bits depend
        #: on the rows beside it they would make an output depend on the machine's timing
        self.budget = DraftBudget() if (speculative is not None and speculative.adaptive
                                        and getattr(runner, "row_invariant", False)) else None
        #: prompts read a chunk per step beside the decode rows (generation/prefill.py), on a
        #: row-invariant runner with a prefix cache; None: a prompt is prefilled at admission
        self.prefills = PrefillQueue(runner) if (getattr(runner, "row_invariant", False)
                                                 and hasattr(runner, "prefiller")) else None
        self.max_batch_size = max_batch_size
        self.vocab_size = runner.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.running: list[Request] = []
        self._next_id = 0
        self.failed_steps = 0  # steps whose shared forward / verification (or the step) raised

    @property
    def max_rows(self) -> int:
        """Mask rows a request may use in one step: the bonus row, k drafts, the forced cap."""
        return 1 + self.k + (self.forced.max_tokens if self.forced else 0)

    # -- admission ------------------------------------------------------------------------
    def admit(self, reqs: Sequence[Request]) -> list[Request]:
        """Admit ``reqs`` with one batched prefill; if that fails, each alone. A request that
        cannot be admitted alone finishes with a typed ``"admit"`` error and holds no slot;
        every other one is running. Returns the requests that could not be admitted."""
        admitted = {id(r) for r in self._together_or_alone("admit", reqs, self.add)}
        refused = [r for r in reqs if id(r) not in admitted]
        for r in refused:  # a resumed retry that could not be admitted gives its slot back
            if r.slot >= 0:
                self.runner.free_slot(r.slot)
                r.slot = -1
        return refused

    def add(self, reqs: Sequence[Request]) -> None:
        """Admit all of ``reqs`` or none (then raise): give each a slot and prefill their
        prompts (batched). A request that comes with a slot (a resumed retry,
        generation/retry.py) already holds ``prompt + output[:-1]`` in its cache: it is cut to
        that length and not prefilled again, and keeps its slot if admission fails."""
        fresh = [r for r in reqs if r.slot < 0]
        for req in reqs:
            req.id = self._next_id
            self._next_id += 1
            if req.params.seed is not None:
                req.generator = torch.Generator().manual_seed(req.params.seed)
            elif not req.params.greedy:
                req.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))
            if req.slot >= 0:
                self.runner.truncate(req.slot, len(req.context()) - 1)
                req.stats.prompt_tokens = len(req.prompt_ids)
            else:
                req.slot = self.runner.new_slot()
        try:
            if self.prefills is not None:  # read a chunk per step from the next step on
                self.prefills.admit(fresh)
                fresh = []
            # prefill in chunks of similar size: padding a short prompt to a long one wastes compute
            order = sorted(fresh, key=lambda r: len(r.prompt_ids))
            chunk: list[Request] = []
            for req in order:
                chunk.append(req)
                if len(chunk) * len(req.prompt_ids) >= _PREFILL_TOKENS:
                    self._prefill(chunk)
                    chunk = []
            if chunk:
                self._prefill(chunk)
        except BaseException:
            # all or nothing: a failed prefill admits none of them and leaks no cache slot
            for req in fresh:
                if req.slot >= 0:
                    self.runner.free_slot(req.slot)
                    req.slot = -1
            raise
        for req in reqs:
            self.running.append(req)
            if req.matcher is not None and req.matcher.must_stop():
                finish(req, "stop")  # e.g. a grammar that accepts only the empty string

    @torch.inference_mode()
    def _prefill(self, reqs: Sequence[Request]) -> None:
        t0 = time.perf_counter()
        batch = [r for r in reqs if len(r.prompt_ids) > 1]
        computed = [len(r.prompt_ids) - 1 for r in batch]
        prefill = getattr(self.runner, "prefill", None)  # a runner of ours (RunnerBase) has it
        if batch and prefill is not None:  # prompt prefixes may come from the runner's cache
            computed = prefill([r.slot for r in batch], [r.prompt_ids[:-1] for r in batch])
        elif batch:
            self.runner.forward([r.slot for r in batch], [r.prompt_ids[:-1] for r in batch],
                                [0] * len(batch))
        dt = time.perf_counter() - t0
        for r, n in zip(batch, computed):
            r.stats.cached_prompt_tokens = len(r.prompt_ids) - 1 - n
        for r in reqs:
            r.stats.prefill_s += dt / len(reqs)
            r.stats.prompt_tokens = len(r.prompt_ids)

    def _together_or_alone(self, stage: str, reqs: Sequence[Request],
                           work: Callable[[Sequence[Request]], None]) -> list[Request]:
        """``work(reqs)`` once for all; if it raises, ``work([r])`` for each request alone, and
        a request that fails alone fails (``stage``). Returns those ``work`` went through for."""
        with contain(stage) as together:
            work(reqs)
        if not together.failed:
            return list(reqs)
        kept = []
        for r in reqs:
            with contain(stage, [r]) as alone:
                work([r])
            if not alone.failed:
                kept.append(r)
        return kept

    # -- the loop -------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> list[Request]:
        """Add requests (up to ``max_batch_size`` at once) and step until all finish."""
        _check_batch_size(self.max_batch_size)  # an attribute a caller may have changed
        return run_requests(self, requests)

    def safe_step(self) -> bool:
        """`step`; an exception it lets through (a bug outside its own guards) ends the
        requests still running (stage ``"step"``) instead of propagating. Returns whether a
        shared stage of this step failed (each such step counts in ``failed_steps``)."""
        return contained_step(self)

    def reap(self) -> None:
        """Free the slots of finished requests (and their drafter's memory: a draft model's
        cache slot) and drop them from the running set."""
        for r in self.running:
            if r.finished:
                if self.prefills is not None:
                    self.prefills.drop(r)
                if not (r.keep_slot and r.finish_reason in RESUMABLE):
                    self.runner.free_slot(r.slot)
                    r.keep_slot = False  # nothing kept: a retry cannot resume from it
                if self.drafter is not None and r.drafter_state is not None:
                    self.drafter.release(r.drafter_state)
                    r.drafter_state = None
        self.running = [r for r in self.running if not r.finished]

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """One propose -> score -> verify -> commit step for every running, unfinished request."""
        reqs = self._live()
        if not reqs:
            return
        timer = StepTimer()
        prompts: list[tuple[Request, list[int]]] = []  # (request, its prompt rows this step)
        if self.prefills is not None and len(self.prefills):
            prompts = self.prefills.take()
            reqs = [r for r in reqs if not self.prefills.holds(r)]  # those decode from next step
        if not reqs:
            self._read_prompts(prompts, timer)
            return
        with timer.measure("drafting"):
            batch = self._propose(reqs, timer)  # forced + drafter, masked per position
        if batch is None:
            self._read_prompts(prompts, timer)
            return  # every request's drafting failed
        batch.prompts = prompts
        with self._shared("forward", batch) as fault, timer.measure("forward"):
            logits = self._score(batch)  # [N + B, V]
        if fault.failed:
            return
        self._prompts_read(prompts, timer, sum(batch.num_rows))
        with self._shared("verify", batch) as fault, timer.measure("verify"):
            result = self._verify(batch, logits)  # accepted prefix + recovered / bonus token
        if fault.failed:
            return
        with timer.measure("commit"):
            self._commit_all(batch, result)
        timer.charge([r.stats for r in batch.reqs])
        if self.budget is not None:
            self.budget.observe_step(sum(batch.num_rows) + sum(len(t) for _, t in prompts), timer.elapsed())

    def _read_prompts(self, prompts: list[tuple[Request, list[int]]], timer: StepTimer) -> None:
        """A step with no request to decode: a forward of the prompt rows alone."""
        if not prompts:
            return
        with contain("forward", [r for r, _ in prompts]) as fault, timer.measure("forward"):
            self.runner.forward([r.slot for r, _ in prompts], [t for _, t in prompts], [0] * len(prompts),
                                phase="decode")  # type: ignore[call-arg]  # a LeanRunner (prefills)
        self.failed_steps += fault.failed
        if not fault.failed:
            self._prompts_read(prompts, timer)

    def _prompts_read(self, prompts: list[tuple[Request, list[int]]], timer: StepTimer,
                      other_rows: int = 0) -> None:
        """``prompts``' rows are in the cache: the queue advances; each request is charged its
        rows' share of the step's forward (beside ``other_rows`` decode rows) as prefill time."""
        if not prompts or self.prefills is None:
            return
        self.prefills.advance(prompts)
        rows = sum(len(t) for _, t in prompts) + other_rows
        for r, t in prompts:
            r.stats.prefill_s += timer.forward * len(t) / rows

    def _live(self) -> list[Request]:
        """The requests this step works on; cancelled ones finish here."""
        for r in self.running:
            if r.cancelled:
                finish(r, "cancelled")
        return [r for r in self.running if not r.finished]

    @contextmanager
    def _shared(self, stage: str, batch: StepBatch) -> Iterator[Fault]:
        """A stage every request of the step shares (and those whose prompt rows it carries):
        if it raises, none can go on (their slots are freed at the next reap; the runner's
        lengths only matter for requests that go on) and the step counts in ``failed_steps``."""
        with contain(stage, [*batch.reqs, *(r for r, _ in batch.prompts)]) as fault:
            yield fault
        self.failed_steps += fault.failed

    # -- 1. propose -----------------------------------------------------------------------
    def _propose(self, reqs: list[Request], timer: StepTimer) -> StepBatch | None:
        """Each request's proposal and mask rows; None when no request is left.

        Drafting runs batched. If it raises (a request's matcher, or the drafter), every
        request drafts again on its own, from fresh forks of its matcher (the real matcher is
        never touched while drafting), and only those that fail alone fail (``"draft"``).
        Drafts do not change what is emitted (verification decides), so the retry changes no
        output; only a sampled drafter's random draws differ from an undisturbed run.
        """
        bitmask = torch.empty((len(reqs), self.max_rows, self.words), dtype=torch.int32)
        index = {id(r): i for i, r in enumerate(reqs)}
        drafted: dict[int, tuple[DraftState, int]] = {}  # id(request) -> (proposal, mask rows)

        def draft(rs: Sequence[Request]) -> None:
            states = [self._new_state(r, bitmask[index[id(r)]], timer) for r in rs]
            self._draft(rs, states)
            rows = [s.cursor.finish() for s in states]  # the bonus row too
            drafted.update((id(r), (s, n)) for r, s, n in zip(rs, states, rows))

        kept = self._together_or_alone("draft", reqs, draft)
        if not kept:
            return None
        if len(kept) < len(reqs):
            bitmask = bitmask[[index[id(r)] for r in kept]]
        states = [drafted[id(r)][0] for r in kept]
        rows = [drafted[id(r)][1] for r in kept]
        if self.budget is not None and any(s.tokens for s in states):
            cuts = self.budget.cuts([(r.draft_acceptance, s.forced_flags()) for r, s in zip(kept, states)])
            if cuts is not None:
                rows = [min(n, s.cut(keep) + 1) for s, n, keep in zip(states, rows, cuts)]
        return StepBatch.build(kept, states, rows, bitmask, self.vocab_size)

    def _new_state(self, r: Request, rows: torch.Tensor, timer: StepTimer) -> DraftState:
        """A fresh proposal for ``r`` over its mask rows (int32 [R, W]), with a fresh fork."""
        budget = r.params.max_tokens - len(r.output_ids)  # drafts beyond it cannot be emitted
        rows = rows[: min(rows.shape[0], budget + 1) if budget >= 1 else 1]
        cursor = GrammarCursor(r.matcher, rows, timer, note_forced=r.params.guarded)
        return DraftState(r.id, r.context(), cursor, r.params, r.generator,
                          drafter_state=r.drafter_state, prompt_len=len(r.prompt_ids), slot=r.slot)

    def _draft(self, reqs: Sequence[Request], states: list[DraftState]) -> None:
        """`draft_rounds` with this engine's drafters."""
        try:
            draft_rounds(states, self.forced, self.drafter, self.k)
        finally:  # what a model drafter keeps per request (its cache slot) stays with it
            for r, s in zip(reqs, states):
                r.drafter_state = s.drafter_state

    # -- 2. score -------------------------------------------------------------------------
    def _score(self, batch: StepBatch) -> torch.Tensor:
        """One target forward over ``[pending, drafts...]`` of every request, and the prompt
        rows of those still reading theirs (``batch.prompts``, no logits): the logits of each
        request's K_b + 1 verified positions, [N + B, V]."""
        prompts = batch.prompts
        return self.runner.forward([r.slot for r in batch.reqs] + [r.slot for r, _ in prompts],
                                   [[r.pending] + s.tokens for r, s in zip(batch.reqs, batch.states)]
                                   + [t for _, t in prompts],
                                   list(batch.num_rows) + [0] * len(prompts))

    # -- 3. verify ------------------------------------------------------------------------
    def _verify(self, batch: StepBatch, logits: torch.Tensor) -> RejectionOutput:
        """Mask rows, sampling transforms, then rejection sampling (`kernels.rejection_sample`)."""
        dev = logits.device
        modes = {r.params.logprobs_mode for r in batch.reqs if r.params.logprobs is not None}
        if modes:  # the verifier's own logits: no extra forward (generation/logprobs.py)
            batch.logprob_rows = request_rows([r.params.logprobs is not None for r in batch.reqs],
                                              batch.num_rows)
            rows = torch.tensor(batch.logprob_rows, device=dev)
            if "raw" in modes:
                batch.logprob_logits["raw"] = logits.index_select(0, rows)
        if batch.constrained:
            apply_bitmask(logits, batch.bitmask.view(-1, self.words).to(dev), batch.row_index.to(dev))
        if any(r.params.min_tokens or r.params.ignore_eos for r in batch.reqs):
            mask_stop_tokens(logits, batch.reqs, batch.num_rows)
        if "masked" in modes:
            batch.logprob_logits["masked"] = logits.index_select(0, rows)
        logits = self._sampling_transforms(batch, logits)
        greedy = torch.tensor([r.params.greedy for r in batch.reqs])
        uniform, exp_noise = self._random_draws(batch, greedy)
        draft_probs = None if batch.draft_probs is None else batch.draft_probs.to(dev)
        return rejection_sample(logits, batch.draft_tokens.to(dev), batch.cu_num_drafts.to(dev),
                                draft_probs, greedy=greedy.to(dev),
                                uniform=None if uniform is None else uniform.to(dev),
                                exp_noise=None if exp_noise is None else exp_noise.to(dev))

    def _sampling_transforms(self, batch: StepBatch, logits: torch.Tensor) -> torch.Tensor:
        """What sampling does to each row, as without speculation: the repetition guard (each
        row with its own prefix: the output + the drafts before it), then temperature, top-k
        and top-p."""
        reqs, states = batch.reqs, batch.states
        if any(r.params.guarded for r in reqs):
            logits = apply_repetition_guard(
                logits, [r.output_ids + s.tokens for r, s in zip(reqs, states)],
                [len(r.output_ids) for r in reqs], [r.params for r in reqs],
                [[s.cursor.forced_rows.get(j, False) for j in range(n)]
                 for s, n in zip(states, batch.num_rows)])
        dev = logits.device
        return process_logits(logits,
                              batch.per_row([r.params.temperature for r in reqs]).to(dev, torch.float32),
                              batch.per_row([r.params.top_k for r in reqs]).to(dev),
                              batch.per_row([r.params.top_p for r in reqs]).to(dev, torch.float32))

    def _random_draws(self, batch: StepBatch,
                      greedy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The acceptance draws [N] and the Exp(1) noise [B, V] of the sampled tokens, from
        each request's own generator (a seeded request is reproducible whatever its batch);
        (None, None) when every request is greedy. One noise row per request: a step samples
        one token per request (the recovered or the bonus one), whatever its number of drafts."""
        if bool(greedy.all()):
            return None, None
        uniform, noise = [], []
        for r, s in zip(batch.reqs, batch.states):
            g = r.generator
            uniform.append(torch.rand(len(s.tokens), generator=g))
            if r.params.greedy:
                noise.append(torch.ones(1, self.vocab_size))
            else:
                noise.append(torch.empty(1, self.vocab_size).exponential_(generator=g))
        return torch.cat(uniform), torch.cat(noise)

    # -- 4. commit ------------------------------------------------------------------------
    def _commit_all(self, batch: StepBatch, result: RejectionOutput) -> None:
        at = 0  # request b's first row among batch.logprob_rows
        for b, (r, s) in enumerate(zip(batch.reqs, batch.states)):
            n_acc = int(result.num_accepted[b])
            emitted = [int(t) for t in result.output_tokens[b, : n_acc + 1]]
            before = len(r.output_ids)
            with contain("commit", [r]):  # its matcher: this request alone
                self._commit(r, s, emitted, n_acc)
                if r.params.logprobs is not None:  # the tokens committed (a stop may cut them)
                    kept = len(r.output_ids) - before
                    r.logprobs += row_logprobs(
                        batch.logprob_logits[r.params.logprobs_mode],
                        torch.arange(at, at + kept), torch.tensor(emitted[:kept]), r.params.logprobs)
            if r.params.logprobs is not None:
                at += batch.num_rows[b]

    def _commit(self, r: Request, s: DraftState, emitted: list[int], n_acc: int) -> None:
        """The emitted tokens to ``r``'s real matcher and output (up to a stop or max_tokens),
        its cache cut to the accepted positions, its stats and its ``on_tokens`` callback."""
        st = r.stats
        if self.budget is not None:
            self.budget.record(r.draft_acceptance, s.forced_flags(), n_acc)
        st.drafted_tokens += len(s.tokens)
        st.forced_tokens += sum(1 for i in s.forced_at if i < n_acc)
        st.forced_drafted += s.num_forced
        st.accepted_tokens += n_acc
        st.record_positions(len(s.tokens), n_acc)
        start = self.runner.length(r.slot) - len(s.tokens) - 1  # position of the pending token
        commit_tokens(r, emitted, s.cursor)
        # cache keeps the pending token + the accepted drafts; the new pending token is not cached
        # (when fewer tokens were kept the request has finished and its cache no longer matters)
        self.runner.truncate(r.slot, start + 1 + n_acc)
