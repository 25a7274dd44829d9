"""The declared contracts between engine, runners and drafters, and the pieces every step uses.

- The runners meet `protocols.Runner`; only the lean runner is a `protocols.FeatureSource`.
- A drafter is a `drafters.Drafter` (``resumable`` and ``release`` included); the engine
  refuses anything else when it is built, not in the middle of a step.
- One `slots.SlotAllocator` hands out the slots of every per-request cache: freed slots are
  reused, a slot freed twice is freed once, capacity doubles and stops at the context.
- `timing.StepTimer` charges each request of a step an equal share of every stage.
- `engine.contain` turns an Exception into the typed failure of the requests it names, and
  lets KeyboardInterrupt through.
"""

from __future__ import annotations

import pytest
import torch

from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.drafters import Drafter, ForcedDrafter, NgramDrafter
from constrained_spec.errors import ConfigError, GenerationError
from constrained_spec.generation.engine import Engine, Request, contain
from constrained_spec.generation.stats import SpecStats
from constrained_spec.generation.timing import StepTimer
from constrained_spec.model.protocols import FeatureSource, Runner
from constrained_spec.model.runner import HFRunner, LeanRunner
from constrained_spec.model.slots import SlotAllocator

CPU = torch.device("cpu")


def test_the_lean_runner_is_a_feature_source_and_the_transformers_runner_is_not(tiny_model):
    lean = LeanRunner(tiny_model, dtype=torch.float32, device=CPU)
    hf = HFRunner(tiny_model, dtype=torch.float32, device=CPU)
    assert isinstance(lean, Runner) and isinstance(lean, FeatureSource)
    assert isinstance(hf, Runner) and not isinstance(hf, FeatureSource)


def test_shipped_drafters_have_the_whole_drafter_interface():
    for drafter in (NgramDrafter(4, 1), ForcedDrafter(8)):
        assert isinstance(drafter, Drafter)
        assert drafter.release(object()) is None  # stateless: nothing to free
    assert NgramDrafter.resumable and not ForcedDrafter.resumable


def test_an_object_that_is_not_a_drafter_is_refused_when_the_engine_is_built(tiny_model):
    class ProposeOnly:
        name = "propose-only"

        def propose(self, states, k):
            pass

    runner = LeanRunner(tiny_model, dtype=torch.float32, device=CPU)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="resumable") as info:
        Engine(runner, speculative=spec, drafter=ProposeOnly())
    assert info.value.option == "drafter"

    class Subclassed(Drafter):  # inherits resumable = False and a release that frees nothing
        name = "subclassed"

        def propose(self, states, k):
            pass

    assert Engine(runner, speculative=spec, drafter=Subclassed()).drafter.resumable is False


def test_our_engine_meets_the_engine_contract_the_frontend_and_serving_loop_use(tiny_model):
    from constrained_spec.generation.protocols import BatchEngine

    engine = Engine(HFRunner(tiny_model, dtype=torch.float32, device=CPU), speculative=None)
    assert isinstance(engine, BatchEngine)
    assert not isinstance(object(), BatchEngine)


def test_freed_slots_are_reused_and_a_slot_freed_twice_is_freed_once():
    slots = SlotAllocator()
    a, b = slots.new_slot(), slots.new_slot()
    assert (a, b) == (0, 1) and slots.slots_in_use == 2
    slots.free_slot(a)
    slots.free_slot(a)
    assert slots.slots_in_use == 1
    assert slots.new_slot() == a and slots.new_slot() == 2  # the freed one first, then a new one
    assert slots.length(a) == 0


def test_truncate_keeps_a_prefix_only():
    slots = SlotAllocator()
    s = slots.new_slot()
    slots._lengths[s] = 5  # as a forward writing 5 positions would
    slots.truncate(s, 3)
    assert slots.length(s) == 3
    with pytest.raises(ValueError, match="cannot truncate"):
        slots.truncate(s, 4)


def test_cache_capacity_doubles_and_stops_at_the_context():
    slots = SlotAllocator()
    assert slots.grown_capacity(1, 10) == (1, 256)  # a lone request: one slot, a few hundred positions
    slots._cap_slots, slots._cap_len = 4, 256
    assert slots.grown_capacity(3, 200) is None  # fits
    assert slots.grown_capacity(5, 200) == (8, 256)
    assert slots.grown_capacity(4, 300) == (4, 512)
    assert slots.grown_capacity(4, 300, max_len=400) == (4, 400)
    assert slots.grown_capacity(4, 600, max_len=400) == (4, 600)  # one call needs more


def test_the_step_timer_charges_each_request_an_equal_share():
    timer = StepTimer(started=0.0)
    timer.drafting, timer.grammar, timer.forward, timer.verify, timer.commit = 0.6, 0.2, 1.0, 0.4, 0.2
    stats = [SpecStats(), SpecStats()]
    timer.charge(stats)
    for st in stats:
        assert st.target_forwards == 1
        assert st.drafting_s == pytest.approx(0.2)  # drafting without its grammar work
        assert st.grammar_s == pytest.approx(0.2)  # the forks' work + the commit
        assert (st.target_forward_s, st.verification_s) == pytest.approx((0.5, 0.2))


def test_the_step_timer_adds_nothing_for_a_stage_that_raised():
    timer = StepTimer()
    with timer.measure("forward"):
        pass
    ok = timer.forward
    with pytest.raises(ZeroDivisionError), timer.measure("forward"):
        raise ZeroDivisionError
    assert timer.forward == ok


def _request() -> Request:
    return Request([1, 2], None, SamplingParams(max_tokens=4), (0,))


def test_contain_fails_the_named_requests_with_the_stage_and_cause():
    a, b, other = _request(), _request(), _request()
    with contain("commit", [a, b]) as fault:
        raise KeyError("boom")
    assert fault.failed and isinstance(fault.error, KeyError)
    for r in (a, b):
        assert r.finish_reason == "error" and isinstance(r.error, GenerationError)
        assert r.error.stage == "commit" and isinstance(r.error.__cause__, KeyError)
    assert other.finish_reason is None
    with contain("commit", [other]) as fault:
        pass
    assert not fault.failed and other.finish_reason is None


def test_contain_names_the_requests_of_a_callable_when_the_exception_comes():
    reqs = [_request(), _request()]
    with contain("step", lambda: [r for r in reqs if not r.finished]):
        reqs[0].finish_reason = "stop"  # finished before the fault: keeps its reason
        raise RuntimeError("bug")
    assert [r.finish_reason for r in reqs] == ["stop", "error"]


def test_contain_without_requests_only_reports_and_lets_interrupts_through():
    with contain("draft") as fault:
        raise RuntimeError("batch")
    assert fault.failed
    r = _request()
    with pytest.raises(KeyboardInterrupt), contain("draft", [r]):
        raise KeyboardInterrupt
    assert r.finish_reason is None
