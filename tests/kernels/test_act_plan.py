"""Int8 activations as a kernel-plan choice (``act=int8``; ``CONSTRAINED_SPEC_ACTIVATIONS``).

The activations of the native decode stack's 4-bit products are a field of the plan: written
in a fixed plan, measured when asked ("auto": taken only for a clear gain), forced ("int8"),
and a plan that says int8 where they cannot run is an error, not a silent bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from constrained_spec.errors import ConfigError
from constrained_spec.kernels import cpu_native
from constrained_spec.model import plan as plan_module
from constrained_spec.model.plan import KernelPlan, choose_plan, measure

sys.path.insert(0, str(Path(__file__).parent))
from test_native_forward import decode_and_verify, model_of, runner, tokens  # noqa: E402

needs_int8 = pytest.mark.skipif(not cpu_native.int8_activations(),
                                reason="the native kernels do not load here")


def test_plan_text_carries_the_activations():
    plan = KernelPlan.parse("prefill=bf16,decode=q4,lm_head=bf16,act=int8")
    assert plan.act == "int8" and plan.describe().endswith(",act=int8")
    assert KernelPlan.parse(plan.describe()).act == "int8"
    assert KernelPlan.from_json(plan.to_json()).act == "int8"
    plain = KernelPlan.parse("decode=q4")
    assert plain.act == "bf16" and "act" not in plain.describe()  # bf16 plans read as before
    assert KernelPlan.from_json({k: v for k, v in plain.to_json().items() if k != "act"}).act == "bf16"
    with pytest.raises(ConfigError) as e:
        KernelPlan.parse("decode=q4,act=fp8")
    assert e.value.option == "CONSTRAINED_SPEC_PLAN" and "bf16 or int8" in str(e.value)


@needs_int8
def test_a_plan_with_int8_activations_runs_the_int8_stack_row_invariant():
    model = model_of("llama3")
    V = model.config.vocab_size
    prompt, drafts = tokens(V, 30, 3), tokens(V, 7, 4)
    opt_in = runner(model, native=True)
    opt_in.int8_activations = True
    want, _ = decode_and_verify(opt_in, prompt, drafts)
    r = runner(model, native=True)
    assert r.act_choices("q4") == ("bf16", "int8") and r.act_choices("bf16") == ("bf16",)
    r.set_plan(KernelPlan(prefill="q4", decode=[(1 << 30, "q4")], lm_head="bf16", act="int8"))
    decodes, verify = decode_and_verify(r, prompt, drafts)
    assert list(r._native_stacks) == ["q4|int8"]
    assert torch.equal(decodes, want) and torch.equal(verify, decodes)


@needs_int8
def test_the_runners_own_switch_overrides_the_plans_activations():
    model = model_of("llama3")
    V = model.config.vocab_size
    prompt, drafts = tokens(V, 20, 5), tokens(V, 5, 6)
    bf16, _ = decode_and_verify(runner(model, native=True), prompt, drafts)
    r = runner(model, native=True)
    r.set_plan(KernelPlan(prefill="q4", decode=[(1 << 30, "q4")], lm_head="bf16", act="int8"))
    r.int8_activations = False  # a benchmark's bf16 side under a default (int8) plan
    off, _ = decode_and_verify(r, prompt, drafts)
    assert list(r._native_stacks) == ["q4"] and torch.equal(off, bf16)


def _fake_times(r, int8_ratio: float):
    """`plan._timed` replaced: 1 ms for q4 forwards, 2 ms for bf16 ones, ``int8_ratio`` ms for
    q4 decode rows with int8 activations (the plan the runner holds while timed says which)."""
    def timed(repeats, fn, *, warm=True):
        fn()
        if r.plan.decode_kernel(1) == "bf16":
            return 2e-3
        return 1e-3 * (int8_ratio if r.plan.act == "int8" else 1.0)
    return timed


@needs_int8
@pytest.mark.parametrize("ratio,chosen", [(0.8, "int8"), (0.95, "bf16"), (1.2, "bf16")])
def test_a_measured_plan_takes_int8_activations_only_for_a_clear_gain(monkeypatch, ratio, chosen):
    r = runner(model_of("llama3"), native=True)
    monkeypatch.setattr(plan_module, "_timed", _fake_times(r, ratio))
    plan = measure(r, ["bf16", "q4"], rows=(1, 7), prefill_rows=(16,), repeats=2, exact=True,
                   activations="auto")
    assert plan.decode_kernel(1) == "q4" and plan.act == chosen and r.slots_in_use == 0
    assert plan.times_ms["decode@7 act"] == {"bf16": 1.0, "int8": round(ratio, 3)}
    assert measure(r, ["bf16", "q4"], rows=(1,), prefill_rows=(16,), repeats=1, exact=True).act == "bf16"


@needs_int8
def test_the_activations_setting_forces_or_clears_int8(tmp_path, cs_env):
    r = runner(model_of("llama3"), native=True)
    cs_env(CONSTRAINED_SPEC_PLAN="prefill=bf16,decode=q4,lm_head=bf16", CONSTRAINED_SPEC_ACTIVATIONS="int8")
    assert choose_plan(r, dtype="auto", cache=tmp_path, quiet=True).act == "int8"
    cs_env(CONSTRAINED_SPEC_PLAN="prefill=bf16,decode=bf16,lm_head=bf16")
    assert choose_plan(r, dtype="auto", cache=tmp_path, quiet=True).act == "bf16"  # no 4-bit: bf16
    cs_env(CONSTRAINED_SPEC_PLAN="prefill=bf16,decode=q4,lm_head=bf16,act=int8",
           CONSTRAINED_SPEC_ACTIVATIONS=None)
    assert choose_plan(r, dtype="auto", cache=tmp_path, quiet=True).act == "int8"  # as written
    # a plan that keys on the activations setting: "auto" is measured apart from bf16
    keys = set()
    for act in (None, "auto"):
        cs_env(CONSTRAINED_SPEC_ACTIVATIONS=act)
        keys.add(plan_module.plan_key(r))
    assert len(keys) == 2


def test_a_fixed_int8_plan_where_int8_cannot_run_names_the_variable(cs_env, tmp_path):
    r = runner(model_of("llama3"), native=False)  # decode rows off the native layer stack
    assert r.act_choices("q4") == ("bf16",)
    cs_env(CONSTRAINED_SPEC_PLAN="prefill=bf16,decode=q4,lm_head=bf16,act=int8")
    with pytest.raises(ConfigError) as e:
        choose_plan(r, dtype="auto", cache=tmp_path, quiet=True)
    assert e.value.option == "CONSTRAINED_SPEC_PLAN" and "native layer stack" in str(e.value)
    cs_env(CONSTRAINED_SPEC_PLAN="prefill=bf16,decode=q4,lm_head=bf16", CONSTRAINED_SPEC_ACTIVATIONS="int8")
    assert choose_plan(r, dtype="auto", cache=tmp_path, quiet=True).act == "bf16"  # asked, not there


@needs_int8
def test_switching_the_activations_drops_the_prompt_prefixes_computed_under_the_other():
    model = model_of("llama3")
    prompt = tokens(model.config.vocab_size, 40, 8)
    r = runner(model, native=True)
    r.int8_activations = True
    assert r.prefiller.invariant(len(prompt))
    assert r.prefill([r.new_slot()], [prompt]) == [len(prompt)]
    assert r.prefill([r.new_slot()], [prompt]) == [len(prompt) % 16]  # its 16-token blocks cached
    r.int8_activations = True  # no change: kept
    assert r.prefill([r.new_slot()], [prompt]) == [len(prompt) % 16]
    r.int8_activations = False  # blocks of int8 keys and values must not serve bf16 rows
    assert r.prefill([r.new_slot()], [prompt]) == [len(prompt)]
    r.native_forward = False  # nor the torch path's
    assert r.prefill([r.new_slot()], [prompt]) == [len(prompt)]
