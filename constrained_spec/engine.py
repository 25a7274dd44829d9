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
from .sampling import process_logits
from .stats import SpecStats

logger = logging.getLogger(__name__)

# prompt tokens per prefill forward (batch x padded length), to bound activation memory
_PREFILL_TOKENS = 4096
# forced / n-gram alternations per step (each round must extend the proposal)
_MAX_DRAFT_ROUNDS = 4


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
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: BaseException | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    slot: int = -1
    generator: torch.Generator | None = None
    drafter_state: Any = None
    cancelled: bool = False

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
        waiting = list(requests)
        done = []
        while waiting or self.running:
            free = self.max_batch_size - len(self.running)
            if waiting and free > 0:
                self.add(waiting[:free])
                waiting = waiting[free:]
            self.step()
            done.extend(r for r in self.running if r.finished)
            self.reap()
        return done

    def reap(self) -> None:
        """Free the slots of finished requests and drop them from the running set."""
        for r in self.running:
            if r.finished:
                self.runner.free_slot(r.slot)
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
        states = []
        for i, r in enumerate(reqs):
            budget = r.params.max_tokens - len(r.output_ids)  # drafts beyond it cannot be emitted
            rows = bitmask[i, : min(max_rows, budget + 1) if budget >= 1 else 1]
            states.append(DraftState(r.id, r.context(), GrammarCursor(r.matcher, rows, grammar_time),
                                     r.params, r.generator, drafter_state=r.drafter_state))
        t0 = time.perf_counter()
        self._draft(states)
        num_rows = [s.cursor.finish() for s in states]
        draft_time = time.perf_counter() - t0 - grammar_time[0]
        # ---- 2. one target forward for everyone ---------------------------------------------
        t0 = time.perf_counter()
        logits = self.runner.forward([r.slot for r in reqs],
                                     [[r.pending] + s.tokens for r, s in zip(reqs, states)],
                                     num_rows)  # [sum(K_r + 1), V]
        forward_time = time.perf_counter() - t0
        # ---- 3. mask, sampling params, rejection sampling -----------------------------------
        t0 = time.perf_counter()
        result = self._verify(reqs, states, bitmask, num_rows, logits)
        verify_time = time.perf_counter() - t0
        # ---- 4. commit --------------------------------------------------------------------
        t0 = time.perf_counter()
        for b, (r, s) in enumerate(zip(reqs, states)):
            n_acc = int(result.num_accepted[b])
            emitted = [int(t) for t in result.output_tokens[b, : n_acc + 1]]
            self._commit(r, s, emitted, n_acc)
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
                self._finish(r, "error")
                r.error = RuntimeError("no token allowed by the grammar")
                break
            if r.matcher is not None:
                if not r.matcher.accept(tok):
                    # cannot happen for a masked verifier; refuse loudly rather than emit garbage
                    self._finish(r, "error")
                    r.error = RuntimeError(f"token {tok} rejected by the grammar after verification")
                    break
            if tok in r.eos_token_ids and (r.matcher is None or r.matcher.is_terminated()):
                self._finish(r, "stop")
                break
            r.output_ids.append(tok)
            kept.append(tok)
            if r.matcher is not None and r.matcher.must_stop():
                self._finish(r, "stop")
                break
        st.emitted_tokens += len(kept)
        # cache keeps the pending token + the accepted drafts; the new pending token is not cached
        # (when fewer tokens were kept the request has finished and its cache no longer matters)
        self.runner.truncate(r.slot, start + 1 + n_acc)
        if kept and r.on_tokens is not None:
            r.on_tokens(kept)
        if not r.finished and len(r.output_ids) >= r.params.max_tokens:
            self._finish(r, "length")
