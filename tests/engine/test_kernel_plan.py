"""The kernel plan: parsed, measured, cached per machine, and followed by the runner.

Every kernel the plan can pick must give the logits of the same weights: the plan changes the
speed, not the model (within each kernel's stated rounding).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random

import pytest
import torch
from test_runner_int4 import quantized_tiny_llama

from constrained_spec.errors import ConfigError
from constrained_spec.model import plan as plan_module
from constrained_spec.model.plan import (
    PLAN_FILE,
    Conditions,
    KernelPlan,
    _merge,
    choose_plan,
    flag_plan,
    machine_info,
    measure,
    plan_to_measure,
)
from constrained_spec.model.runner import LeanRunner, exact_4bit_groups
from constrained_spec.model.weights import ROW_INVARIANT_KERNELS, Int4Groups, Linear
from constrained_spec.plan_syntax import ALL_ROWS

CPU = torch.device("cpu")


def _runner() -> LeanRunner:
    model = quantized_tiny_llama()
    packs = exact_4bit_groups(model)
    return LeanRunner(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16, device=CPU,
                       groups=packs)


def test_plan_text_round_trips_and_bad_text_names_the_variable():
    plan = KernelPlan.parse("prefill=fp32:300/bf16,decode=int4:12/bf16,lm_head=bf16")
    assert plan.prefill_kernel(100) == "fp32" and plan.prefill_kernel(301) == "bf16"
    assert plan.decode_kernel(1) == "int4" and plan.decode_kernel(12) == "int4"
    assert plan.decode_kernel(13) == "bf16" and plan.kv == "bf16"
    assert KernelPlan.parse(plan.describe()).describe() == plan.describe()
    assert KernelPlan.from_json(json.loads(json.dumps(plan.to_json()))).describe() == plan.describe()
    for bad in ("prefill=fp32", "decode=int3", "speed=fast,decode=int4", "decode=int4:x",
                "decode=int4,memory=small"):
        with pytest.raises(ConfigError) as e:
            KernelPlan.parse(bad)
        assert e.value.option == "CONSTRAINED_SPEC_PLAN"


def test_buckets_switch_kernel_only_for_a_clear_gain():
    times = {1: {"int4": 10.0, "bf16": 30.0}, 6: {"int4": 20.0, "bf16": 19.0},
             24: {"int4": 80.0, "bf16": 40.0}}
    assert _merge(times) == [(15, "int4"), (1 << 30, "bf16")]  # 19 vs 20 at 6 rows: noise


def test_int4_groups_dequantize_exactly_and_every_kernel_follows_the_dense_product():
    w = quantized_tiny_llama().model.layers[0].mlp.down_proj.weight.detach().float()
    groups = Int4Groups.from_dense(w)
    assert groups is not None and torch.equal(groups.dequantize(), w)
    lin = Linear(int4=groups)
    x = torch.randn(5, w.shape[1])
    want = x @ w.T
    assert torch.allclose(lin(x, "fp32"), want, atol=1e-5)
    for kernel in ("bf16", "int4", "int8"):
        got = lin(x, kernel).float()
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.05 * want.abs().max(), kernel
    assert Int4Groups.from_dense(torch.randn(64, 64)) is None  # not 4-bit: stays dense


@pytest.mark.parametrize("kernel", ["fp32", "bf16", "int4"])
def test_every_planned_kernel_gives_the_models_logits(kernel):
    ref = LeanRunner(quantized_tiny_llama(), dtype=torch.float32, device=CPU)
    runner = _runner()
    runner.set_plan(KernelPlan.uniform(kernel))
    prompt = [3, 9, 4, 1, 7, 2, 8, 5]
    outs = []
    for r in (ref, runner):
        slot = r.new_slot()
        r.forward([slot], [prompt], [0], phase="prefill")
        outs.append(r.forward([slot], [[6, 2, 11]], [3], phase="decode"))
    want, got = outs
    # the 4-bit linears are exact in every kernel; embeddings, norms and the LM head are kept
    # in bf16 by this runner, so even the fp32 kernel carries their bf16 rounding
    tol = 0.01 if kernel == "fp32" else 0.03
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_mixed_plan_prefill_fp32_then_decode_int4_keeps_one_cache():
    runner = _runner()
    runner.set_plan(KernelPlan.parse("prefill=fp32,decode=int4,lm_head=bf16,kv=bf16,memory=lean"))
    same = _runner()
    same.set_plan(KernelPlan.parse("prefill=int4,decode=int4,lm_head=bf16,kv=bf16"))
    outs = []
    for r in (runner, same):
        slot = r.new_slot()
        r.forward([slot], [[3, 9, 4, 1, 7, 2, 8, 5]], [0], phase="prefill")
        outs.append(r.forward([slot], [[6]], [1], phase="decode"))
    assert (outs[0] - outs[1]).abs().max() <= 0.03 * outs[1].abs().max()
    assert runner.k_cache[0].dtype == torch.bfloat16
    # lean memory: no dense copy of 4-bit weights is kept for a streamed fp32 prefill
    assert all(not L.qkv._dense for L in runner.layers)
    # fast memory (the default): the prefill's fp32 copies stay resident, the numbers do not change
    fast = _runner()
    fast.set_plan(KernelPlan.parse("prefill=fp32,decode=int4,lm_head=bf16,kv=bf16,memory=fast"))
    assert all(L.qkv._dense for L in fast.layers)
    slot = fast.new_slot()
    fast.forward([slot], [[3, 9, 4, 1, 7, 2, 8, 5]], [0], phase="prefill")
    # (fp32 products may split their reduction differently with the machine's load: not bits)
    assert torch.allclose(fast.forward([slot], [[6]], [1], phase="decode"), outs[0], rtol=1e-4, atol=1e-4)


def test_measured_plan_picks_the_fastest_measured_kernel_per_phase():
    runner = _runner()
    plan = measure(runner, ["fp32", "bf16", "int4"], rows=(1, 6), prefill_rows=(16,), repeats=1)
    # decode keeps at most one dense copy of the model (fp32 fastest at 1 row and bf16 at 6,
    # as a loaded machine can time them, is not two dense copies): the fastest of the packed
    # kernel and the dense one it chose, at each row count (within the 10% that keeps buckets)
    dense = {plan.decode_kernel(r) for r in (1, 6)} & {"fp32", "bf16"}
    assert len(dense) <= 1
    for r in (1, 6):
        t = plan.times_ms[f"decode@{r}"]
        assert set(t) == {"fp32", "bf16", "int4"}
        assert t[plan.decode_kernel(r)] <= 1.1 * min(t[k] for k in {"int4"} | dense)
    assert plan.prefill_kernel(16) == min(plan.times_ms["prefill@16"], key=plan.times_ms["prefill@16"].get)
    assert plan.source == "measured" and runner.slots_in_use == 0


@pytest.fixture
def quiet_machine(monkeypatch):
    """A machine nothing else runs on, as the measurement sees it: a steady clock (every timed
    call takes 1 ms), no other load, no steal."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(plan_module, "_clock", lambda: next(ticks) * 1e-3)
    monkeypatch.setattr(plan_module, "_load_average", lambda: 0.0)
    monkeypatch.setattr(plan_module, "_cpu_times", lambda: None)


def test_a_first_load_takes_the_flag_plan_and_times_nothing(tmp_path, cs_env, monkeypatch):
    cs_env(CONSTRAINED_SPEC_PLAN=None, CONSTRAINED_SPEC_MEMORY=None)

    def no_timing(*args, **kwargs):
        raise AssertionError("a first load must not time the kernels")

    monkeypatch.setattr(plan_module, "measure", no_timing)
    runner = _runner()
    plan = choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True)
    assert plan.source == "flags" and plan.times_ms == {} and plan.memory == "lean"
    assert not (tmp_path / PLAN_FILE).exists()
    assert plan_to_measure(runner, dtype="auto", cache=tmp_path) is False


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16 units", "avx2 only"])
def test_the_flag_plan_follows_the_cpu_class_and_the_weights(bf16, monkeypatch):
    monkeypatch.setattr(plan_module, "bf16_units", lambda: bf16)
    runner = _runner()
    plan = flag_plan(runner, memory="auto")
    decode = "q4" if runner.supports_kernel("q4") else "int4"
    # decode and the LM head on one row-invariant kernel: exact, as a measured plan is
    assert plan.decode == [(ALL_ROWS, decode)] and plan.kernels() <= ROW_INVARIANT_KERNELS | {"fp32"}
    assert plan.lm_head in ROW_INVARIANT_KERNELS and plan.kv == "bf16"
    if bf16 and decode == "q4":
        assert plan.prefill == [(ALL_ROWS, "q4")]
    else:  # a long prompt on a dense product: float32 where bf16 is emulated
        assert plan.prefill_kernel(16) == decode
        assert plan.prefill_kernel(1000) == ("bf16" if bf16 else "fp32")
    # the plan runs: the runner takes it and gives logits
    runner.set_plan(plan)
    slot = runner.new_slot()
    assert torch.isfinite(runner.forward([slot], [[3, 9, 4]], [0], phase="prefill")).all()
    # weights with no 4-bit groups decode on bf16
    dense = LeanRunner(quantized_tiny_llama().to(torch.bfloat16), dtype=torch.bfloat16, device=CPU)
    assert flag_plan(dense, memory="fast").decode == [(ALL_ROWS, "bf16")]


def test_plan_is_cached_per_machine_and_the_environment_overrides_it(tmp_path, cs_env,
                                                                     quiet_machine):
    cs_env(CONSTRAINED_SPEC_PLAN="measure", CONSTRAINED_SPEC_MEMORY=None)
    runner = _runner()
    assert plan_to_measure(runner, dtype="auto", cache=tmp_path)
    first = choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True)
    stored = json.loads((tmp_path / PLAN_FILE).read_text())
    assert len(stored["plans"]) == 1 and first.source == "measured"
    cs_env(CONSTRAINED_SPEC_PLAN=None)  # read from the cache from now on
    again = choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True)
    assert again.source == "measured" and again.times_ms == first.times_ms
    assert again.conditions == first.conditions and again.conditions["timing_spread"] == 1.0
    cs_env(CONSTRAINED_SPEC_PLAN="measure", CONSTRAINED_SPEC_MEMORY="lean")  # a plan of its own
    lean = choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True)
    assert lean.memory == "lean" and len(json.loads((tmp_path / PLAN_FILE).read_text())["plans"]) == 2
    with pytest.raises(ConfigError):
        cs_env(CONSTRAINED_SPEC_MEMORY="small")
    cs_env(CONSTRAINED_SPEC_MEMORY=None, CONSTRAINED_SPEC_PLAN="prefill=fp32,decode=int4")
    fixed = choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True)
    assert fixed.source == "env" and fixed.prefill_kernel(1000) == "fp32"
    # an explicit dtype is a fixed plan: float32 everywhere is exact
    assert choose_plan(runner, dtype="float32", cache=tmp_path, quiet=True).kernels() == {"fp32"}


def test_a_measurement_the_machine_disturbed_is_not_cached(tmp_path, cs_env, monkeypatch, caplog):
    # a clock under which the same call takes 1 to 3 ms: what another process on the cores does
    rng = random.Random(0)
    now = [0.0]

    def jittery() -> float:
        now[0] += rng.uniform(1e-3, 3e-3)
        return now[0]

    monkeypatch.setattr(plan_module, "_clock", jittery)
    monkeypatch.setattr(plan_module, "_load_average", lambda: 0.0)
    monkeypatch.setattr(plan_module, "_cpu_times", lambda: None)
    cs_env(CONSTRAINED_SPEC_PLAN="measure", CONSTRAINED_SPEC_MEMORY=None)
    runner = _runner()
    with caplog.at_level(logging.WARNING, logger="constrained_spec.model.plan"):
        plan = choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True)
    assert plan.source == "flags" and not (tmp_path / PLAN_FILE).exists()
    assert "not kept" in caplog.text and ("disagreed" in caplog.text or "reference" in caplog.text)
    # measured plans the rest of the time: the next, steady, measurement is kept
    ticks = iter(range(10**9))
    monkeypatch.setattr(plan_module, "_clock", lambda: next(ticks) * 1e-3)
    assert choose_plan(runner, dtype="auto", cache=tmp_path, quiet=True).source == "measured"
    assert (tmp_path / PLAN_FILE).exists()


def test_conditions_name_what_disturbed_a_measurement():
    quiet = Conditions(at="t", load_before=0.3, load_after=2.1, steal=0.0, reference_spread=1.05,
                       timing_spread=1.04, threads=2, cores=2)
    assert quiet.disturbed() is None and "load average 0.3/2.1" in quiet.describe()
    busy = dataclasses.replace(quiet, load_before=6.5)  # 4.5 runnable besides our 2 threads
    assert "busy" in (busy.disturbed() or "")
    assert "hypervisor" in (dataclasses.replace(quiet, steal=0.25).disturbed() or "")
    assert "reference" in (dataclasses.replace(quiet, reference_spread=1.6).disturbed() or "")
    assert "disagreed" in (dataclasses.replace(quiet, timing_spread=1.5).disturbed() or "")


def test_machine_info_names_the_cpu_flags_and_torch_capability(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    info = machine_info()
    assert info["isa_env"] == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert isinstance(info["flags"], list) and info["capability"]


def test_auto_memory_keeps_dense_copies_only_where_they_win_by_the_margin():
    from constrained_spec.model.plan import RESIDENT_PREFILL_GAIN, _auto_memory

    packed_decode = [(1 << 30, "int4")]
    per_call = {128: {"bf16": 1.3, "int4": 2.0}, 512: {"bf16": 5.2, "int4": 8.0}}
    clear_win = {128: {"bf16": 1.0}, 512: {"bf16": 4.0}}  # 30% faster at every length
    small_win = {128: {"bf16": 1.0}, 512: {"bf16": 5.0}}  # 4% at the long prompt
    assert _auto_memory(packed_decode, per_call, clear_win) == "fast"
    assert _auto_memory(packed_decode, per_call, small_win) == "lean"
    # a dense decode bucket keeps its copies anyway: a prompt may use them for free
    assert _auto_memory([(12, "int4"), (1 << 30, "bf16")], per_call, small_win) == "fast"
    assert 0 < RESIDENT_PREFILL_GAIN < 1


def test_auto_memory_plan_records_both_prefill_timings_and_a_resolved_mode():
    runner = _runner()
    plan = measure(runner, ["fp32", "bf16", "int4"], rows=(1,), prefill_rows=(16,), repeats=1,
                   memory="auto")
    assert plan.memory in ("fast", "lean")
    assert set(plan.times_ms["prefill@16 resident"]) == {"fp32", "bf16"}
    assert "int4" in plan.times_ms["prefill@16"]
    assert runner.slots_in_use == 0
