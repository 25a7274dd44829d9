"""The decoding engine: batched draft -> verify -> commit steps over running requests.

The engine knows nothing about tokenization or schemas: it sees token ids, one grammar
matcher per request (or none, for free text) and a runner that owns the KV cache.

One step, for all running requests at once (DESIGN.md, "One decoding step"):

1. drafts: forced tokens first, then the model drafter continues; every draft position is
   masked by a fork of the request's matcher, which also records the K+1 target mask rows;
2. one target forward over ``[pending token, drafts...]`` for every request;
3. the mask rows are applied to the target logits (kernel), sampling parameters applied,
   then masked rejection sampling (kernel) picks the accepted prefix + recovered/bonus token;
4. commit: emitted tokens go to the real matcher, the KV cache keeps accepted positions.

Cache invariant: between steps the cache holds ``prompt + output[:-1]``; the last token
(the *pending* token, the prompt's last token before the first step) is fed with the drafts.

Faults stay with their request: an exception from one request's own work (its matcher while
drafting or committing, the drafter on its proposal, its ``on_tokens`` callback) finishes that
request alone with ``finish_reason == "error"`` and a :class:`GenerationError` naming the
stage; one from the shared forward or verification finishes the requests of that step. The
engine stays usable either way: finished requests' slots are freed by ``reap``. Only
``Exception`` is caught: KeyboardInterrupt and SystemExit always propagate (a failed prefill
gives its slots back first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from constrained_spec.kernels import apply_bitmask, rejection_sample

from .config import SamplingParams, SpeculativeConfig
from .drafters.base import DraftState, Drafter, GrammarCursor
from .drafters.forced import ForcedDrafter
from .errors import ConfigError, GenerationError
from .loops import LoopDetector
from .sampling import apply_repetition_guard, process_logits
from .stats import SpecStats

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
    matcher: Any | None  # grammar.Matcher; None = free text, stops at an eos token
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Engine:
    """Runs requests to completion in batched speculative steps."""

    def __init__(self, runner: Any, *, speculative: SpeculativeConfig | None,
                 drafter: Drafter | None = None, max_batch_size: int = 64) -> None:
        _check_batch_size(max_batch_size)
        self.runner = runner
        self.spec = speculative
        self.forced = ForcedDrafter(speculative.max_forced_tokens) if (
            speculative is not None and speculative.forced and speculative.max_forced_tokens > 0) else None
        self.drafter = drafter
        self.k = speculative.num_speculative_tokens if (speculative and drafter) else 0
        self.max_batch_size = max_batch_size
        self.vocab_size = runner.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.running: list[Request] = []
        self._next_id = 0
        self.failed_steps = 0  # steps whose shared forward / verification raised

    # -- admission ------------------------------------------------------------------------
    def add(self, reqs: Sequence[Request]) -> None:
        """Admit requests: give each a slot and prefill their prompts (batched)."""
        for req in reqs:
            req.id = self._next_id
            self._next_id += 1
            if req.params.seed is not None:
                req.generator = torch.Generator().manual_seed(req.params.seed)
            elif not req.params.greedy:
                req.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))
            req.slot = self.runner.new_slot()
        try:
            # prefill in chunks of similar size: padding a short prompt to a long one wastes compute
            order = sorted(reqs, key=lambda r: len(r.prompt_ids))
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
            for req in reqs:
                if req.slot >= 0:
                    self.runner.free_slot(req.slot)
                    req.slot = -1
            raise
        for req in reqs:
            self.running.append(req)
            if req.matcher is not None and req.matcher.must_stop():
                self._finish(req, "stop")  # e.g. a grammar that accepts only the empty string

    @torch.inference_mode()
    def _prefill(self, reqs: Sequence[Request]) -> None:
        t0 = time.perf_counter()
        batch = [r for r in reqs if len(r.prompt_ids) > 1]
        if batch:
            self.runner.forward([r.slot for r in batch], [r.prompt_ids[:-1] for r in batch],
                                [0] * len(batch))
        dt = time.perf_counter() - t0
        for r in reqs:
            r.stats.prefill_s += dt / len(reqs)
            r.stats.prompt_tokens = len(r.prompt_ids)

    # -- the loop -------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> list[Request]:
        """Add requests (up to ``max_batch_size`` at once) and step until all finish."""
        _check_batch_size(self.max_batch_size)  # an attribute a caller may have changed
        waiting = list(requests)
        done = []
        while waiting or self.running:
            free = self.max_batch_size - len(self.running)
            if waiting and free > 0:
                admitted, waiting = waiting[:free], waiting[free:]
                try:
                    self.add(admitted)
                except Exception as e:  # the batched prefill: add() admitted none of them
                    logger.exception("prefill failed; ending its %d requests", len(admitted))
                    for r in admitted:
                        self._fail(r, "admit", e)
                    done.extend(admitted)
            try:
                self.step()
            except Exception as e:  # outside the per-request guards: end this step's requests
                logger.exception("engine step failed; ending its %d requests", len(self.running))
                self.failed_steps += 1
                for r in self.running:
                    if not r.finished:
                        self._fail(r, "step", e)
            done.extend(r for r in self.running if r.finished)
            self.reap()
        return done

    def reap(self) -> None:
        """Free the slots of finished requests (and their drafter's memory: a draft model's
        cache slot) and drop them from the running set."""
        release = getattr(self.drafter, "release", None)
        for r in self.running:
            if r.finished:
                self.runner.free_slot(r.slot)
                if release is not None and r.drafter_state is not None:
                    release(r.drafter_state)
                    r.drafter_state = None
        self.running = [r for r in self.running if not r.finished]

    def _finish(self, req: Request, reason: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = reason

    @torch.inference_mode()
    def step(self) -> None:
        """One draft -> verify -> commit step for every running, unfinished request."""
        reqs = [r for r in self.running if not r.finished and not r.cancelled]
        for r in self.running:
            if r.cancelled:
                self._finish(r, "cancelled")
        if not reqs:
            return
        step_start = time.perf_counter()
        # ---- 1. drafts + mask rows ----------------------------------------------------------
        max_rows = 1 + self.k + (self.forced.max_tokens if self.forced else 0)
        bitmask = torch.empty((len(reqs), max_rows, self.words), dtype=torch.int32)
        grammar_time = [0.0]
        t0 = time.perf_counter()
        drafted = self._draft_each(reqs, bitmask, grammar_time)
        draft_time = time.perf_counter() - t0 - grammar_time[0]
        if len(drafted) < len(reqs):  # a request whose own drafting failed has left the step
            keep = [i for i, _, _ in drafted]
            reqs, bitmask = [reqs[i] for i in keep], bitmask[keep]
            if not reqs:
                return
        states = [s for _, s, _ in drafted]
        num_rows = [n for _, _, n in drafted]
        stage = "forward"
        try:
            # ---- 2. one target forward for everyone -----------------------------------------
            t0 = time.perf_counter()
            logits = self.runner.forward([r.slot for r in reqs],
                                         [[r.pending] + s.tokens for r, s in zip(reqs, states)],
                                         num_rows)  # [sum(K_r + 1), V]
            forward_time = time.perf_counter() - t0
            # ---- 3. mask, sampling params, rejection sampling -------------------------------
            stage = "verify"
            t0 = time.perf_counter()
            result = self._verify(reqs, states, bitmask, num_rows, logits)
            verify_time = time.perf_counter() - t0
        except Exception as e:
            # shared by every request of the step: none can go on (their slots are freed at
            # the next reap; the runner's lengths only matter for requests that go on)
            logger.exception("the batched %s failed; ending the %d requests of this step",
                             stage, len(reqs))
            self.failed_steps += 1
            for r in reqs:
                self._fail(r, stage, e)
            return
        # ---- 4. commit --------------------------------------------------------------------
        t0 = time.perf_counter()
        for b, (r, s) in enumerate(zip(reqs, states)):
            n_acc = int(result.num_accepted[b])
            emitted = [int(t) for t in result.output_tokens[b, : n_acc + 1]]
            try:
                self._commit(r, s, emitted, n_acc)
            except Exception as e:  # its matcher: this request alone
                logger.exception("request %s failed while committing tokens", r.id)
                self._fail(r, "commit", e)
        commit_time = time.perf_counter() - t0
        total = time.perf_counter() - step_start
        for r, s in zip(reqs, states):
            st = r.stats
            st.target_forwards += 1
            st.drafting_s += draft_time / len(reqs)
            st.grammar_s += (grammar_time[0] + commit_time) / len(reqs)
            st.target_forward_s += forward_time / len(reqs)
            st.verification_s += verify_time / len(reqs)
            st.step_s += total / len(reqs)

    def _draft_each(self, reqs: Sequence[Request], bitmask: torch.Tensor,
                    grammar_time: list[float]) -> list[tuple[int, DraftState, int]]:
        """``(index in reqs, draft state, mask rows)`` of every request whose drafting worked.

        Drafting runs batched. If it raises (a request's matcher, or the drafter), every
        request drafts again on its own, from fresh forks of its matcher (the real matcher is
        never touched while drafting), and only those that fail alone are failed. Drafts do
        not change what is emitted (verification decides), so the retry changes no output;
        only a sampled drafter's random draws differ from an undisturbed run.
        """
        max_rows = bitmask.shape[1]

        def new_state(i: int, r: Request) -> DraftState:
            budget = r.params.max_tokens - len(r.output_ids)  # drafts beyond it cannot be emitted
            rows = bitmask[i, : min(max_rows, budget + 1) if budget >= 1 else 1]
            cursor = GrammarCursor(r.matcher, rows, grammar_time, note_forced=r.params.guarded)
            return DraftState(r.id, r.context(), cursor, r.params, r.generator,
                              drafter_state=r.drafter_state, prompt_len=len(r.prompt_ids),
                              slot=r.slot)

        def draft(rs: Sequence[Request], states: list[DraftState]) -> None:
            try:
                self._draft(states)
            finally:  # what a model drafter keeps per request (its cache slot) stays with it
                for r, s in zip(rs, states):
                    r.drafter_state = s.drafter_state

        try:
            states = [new_state(i, r) for i, r in enumerate(reqs)]
            draft(reqs, states)
            return [(i, s, s.cursor.finish()) for i, s in enumerate(states)]
        except Exception:
            if len(reqs) > 1:
                logger.warning("drafting %d requests together failed; drafting them one by one",
                               len(reqs), exc_info=True)
        drafted = []
        for i, r in enumerate(reqs):
            try:
                s = new_state(i, r)
                draft([r], [s])
                drafted.append((i, s, s.cursor.finish()))
            except Exception as e:
                logger.exception("request %s failed while drafting", r.id)
                self._fail(r, "draft", e)
        return drafted

    def _fail(self, r: Request, stage: str, exc: BaseException) -> None:
        """End ``r`` with a typed error (its slot is freed at the next reap); the tokens it
        already emitted stay on the error. Overrides a finish reason set in the same step: the
        consumer may not have received the last tokens."""
        r.finish_reason = "error"
        r.error = GenerationError.from_exception(stage, exc, token_ids=r.output_ids, stats=r.stats)

    def _draft(self, states: list[DraftState]) -> None:
        """Forced tokens, then the model drafter; for drafters that can resume anywhere (n-gram),
        alternate the two while either extends the proposal: a copied value, the forced
        punctuation and key after it, the next copied value, ... in one step."""
        active = states
        for _ in range(_MAX_DRAFT_ROUNDS):
            before = [len(s.tokens) for s in active]
            if self.forced is not None:
                self.forced.propose([s for s in active if s.cursor.constrained])
            if self.drafter is not None and self.k > 0:
                self.drafter.propose(active, self.k)
            if not getattr(self.drafter, "resumable", False):
                return
            active = [s for s, n in zip(active, before) if len(s.tokens) > n and not s.cursor.exhausted]
            if not active:
                return

    def _verify(self, reqs: Sequence[Request], states: Sequence[DraftState], bitmask: torch.Tensor,
                num_rows: Sequence[int], logits: torch.Tensor) -> Any:
        dev = logits.device
        # rows of the flat bitmask that each logits row uses
        flat_mask = bitmask.view(-1, self.words)
        row_index = torch.tensor([b * bitmask.shape[1] + j for b, n in enumerate(num_rows)
                                  for j in range(n)], dtype=torch.long)
        constrained = [s.cursor.constrained for s in states]
        if any(constrained):
            apply_bitmask(logits, flat_mask.to(dev), row_index.to(dev))
        if any(r.params.guarded for r in reqs):
            # each row with its own prefix (output + the drafts before it): as without speculation
            logits = apply_repetition_guard(
                logits, [r.output_ids + s.tokens for r, s in zip(reqs, states)],
                [len(r.output_ids) for r in reqs], [r.params for r in reqs],
                [[s.cursor.forced_rows.get(j, False) for j in range(n)]
                 for s, n in zip(states, num_rows)])
        reps = torch.tensor(num_rows)
        temps = torch.repeat_interleave(torch.tensor([r.params.temperature for r in reqs]), reps)
        top_k = torch.repeat_interleave(torch.tensor([r.params.top_k for r in reqs]), reps)
        top_p = torch.repeat_interleave(torch.tensor([r.params.top_p for r in reqs]), reps)
        logits = process_logits(logits, temps.to(dev, torch.float32), top_k.to(dev),
                                top_p.to(dev, torch.float32))
        draft_tokens = torch.tensor([t for s in states for t in s.tokens], dtype=torch.long)
        cu = torch.zeros(len(reqs) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor([len(s.tokens) for s in states]), 0)
        greedy = torch.tensor([r.params.greedy for r in reqs])
        draft_probs = None
        if any(q is not None for s in states for q in s.q):
            draft_probs = torch.zeros((int(cu[-1]), self.vocab_size), dtype=torch.float32)
            i = 0
            for s in states:
                for tok, q in zip(s.tokens, s.q):
                    if q is None:
                        draft_probs[i, tok] = 1.0  # a point mass is a one-hot q
                    else:
                        draft_probs[i] = q
                    i += 1
            draft_probs = draft_probs.to(dev)
        uniform = exp_noise = None
        if not bool(greedy.all()):
            # per-request generators keep a seeded request reproducible whatever its batch
            uni, noise = [], []
            for r, s, n in zip(reqs, states, num_rows):
                g = r.generator
                uni.append(torch.rand(len(s.tokens), generator=g))
                if r.params.greedy:
                    noise.append(torch.ones(n, self.vocab_size))
                else:
                    noise.append(torch.empty(n, self.vocab_size).exponential_(generator=g))
            uniform = torch.cat(uni).to(dev)
            exp_noise = torch.cat(noise).to(dev)
        return rejection_sample(logits, draft_tokens.to(dev), cu.to(dev), draft_probs,
                                greedy=greedy.to(dev), uniform=uniform, exp_noise=exp_noise)

    def _commit(self, r: Request, s: DraftState, emitted: list[int], n_acc: int) -> None:
        st = r.stats
        st.drafted_tokens += len(s.tokens)
        st.forced_tokens += sum(1 for i in s.forced_at if i < n_acc)
        st.forced_drafted += s.num_forced
        st.accepted_tokens += n_acc
        st.record_positions(len(s.tokens), n_acc)
        start = self.runner.length(r.slot) - len(s.tokens) - 1  # position of the pending token
        kept: list[int] = []
        for tok in emitted:
            if len(r.output_ids) >= r.params.max_tokens:
                break
            if tok < 0:
                # no token is allowed here (all-masked row): the grammar reached a dead end
                self._fail(r, "commit", RuntimeError("no token allowed by the grammar"))
                break
            if r.matcher is not None:
                if not r.matcher.accept(tok):
                    # cannot happen for a masked verifier; refuse loudly rather than emit garbage
                    self._fail(r, "commit", RuntimeError(
                        f"token {tok} rejected by the grammar after verification"))
                    break
            if tok in r.eos_token_ids and (r.matcher is None or r.matcher.is_terminated()):
                self._finish(r, "stop")
                break
            r.output_ids.append(tok)
            kept.append(tok)
            if r.matcher is not None and r.matcher.must_stop():
                self._finish(r, "stop")
                break
            if r.loops is not None and r.loops.push(tok) is not None:
                # a repetition loop (loops.py) would spend the rest of max_tokens: stop it here
                self._finish(r, "loop")
                st.record_loop(r.params.max_tokens - len(r.output_ids))
                break
        st.emitted_tokens += len(kept)
        # cache keeps the pending token + the accepted drafts; the new pending token is not cached
        # (when fewer tokens were kept the request has finished and its cache no longer matters)
        self.runner.truncate(r.slot, start + 1 + n_acc)
        if kept and r.on_tokens is not None:
            try:
                r.on_tokens(kept)
            except Exception as e:
                logger.exception("the on_tokens callback of request %s failed", r.id)
                self._fail(r, "callback", e)
        if not r.finished and len(r.output_ids) >= r.params.max_tokens:
            self._finish(r, "length")
