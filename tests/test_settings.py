"""The settings object: every CONSTRAINED_SPEC_* variable parsed by one rule, read once."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from constrained_spec.errors import ConfigError
from constrained_spec.settings import PREFIX, Settings, overridden, reload_settings, settings

BOOLEANS = {"EXACT": "exact", "INT4": "int4", "DEBUG": "debug", "AMX": "amx"}


def test_an_empty_environment_gives_the_documented_defaults():
    assert Settings.from_env({}) == Settings(cache=None, smollm2_wheel=None, dtype="auto",
                                             memory="auto", plan=None, exact=None, int4=True,
                                             debug=False, activations="int8")
    # an empty or blank variable is an unset one
    assert Settings.from_env({f"{PREFIX}{n}": " " for n in
                              ("CACHE", "SMOLLM2_WHEEL", "DTYPE", "MEMORY", "PLAN", "ACTIVATIONS",
                               *BOOLEANS)}) \
        == Settings()


@pytest.mark.parametrize("name", sorted(BOOLEANS))
def test_every_on_off_variable_takes_the_same_words_in_any_case(name):
    field = BOOLEANS[name]
    for word in ("1", "true", "TRUE", "Yes", "on", " On "):
        assert getattr(Settings.from_env({f"CONSTRAINED_SPEC_{name}": word}), field) is True
    for word in ("0", "false", "False", "NO", "off"):
        assert getattr(Settings.from_env({f"CONSTRAINED_SPEC_{name}": word}), field) is False


@pytest.mark.parametrize("name", sorted(BOOLEANS))
def test_a_bad_on_off_value_names_the_variable_and_the_accepted_words(name):
    variable = f"CONSTRAINED_SPEC_{name}"
    with pytest.raises(ConfigError) as e:
        Settings.from_env({variable: "yes please"})
    assert e.value.option == variable
    assert variable in str(e.value) and "yes please" in str(e.value)
    assert all(word in str(e.value) for word in ("1", "true", "yes", "on", "0", "false", "no", "off"))


def test_paths_choices_and_plan_are_parsed():
    s = Settings.from_env({"CONSTRAINED_SPEC_CACHE": "/tmp/cs-cache",
                           "CONSTRAINED_SPEC_SMOLLM2_WHEEL": "~/w.whl",
                           "CONSTRAINED_SPEC_DTYPE": "float32", "CONSTRAINED_SPEC_MEMORY": "lean",
                           "CONSTRAINED_SPEC_PLAN": "prefill=fp32,decode=int4:12/bf16"})
    assert s.cache == Path("/tmp/cs-cache")
    assert s.smollm2_wheel == Path("~/w.whl").expanduser()
    assert (s.dtype, s.memory, s.plan) == ("float32", "lean", "prefill=fp32,decode=int4:12/bf16")
    assert Settings.from_env({"CONSTRAINED_SPEC_PLAN": "measure"}).plan == "measure"


@pytest.mark.parametrize("name,bad", [("DTYPE", "float64"), ("MEMORY", "small"),
                                      ("PLAN", "decode=int3"), ("PLAN", "speed=fast"),
                                      ("PLAN", "decode=q4,act=fp8"), ("ACTIVATIONS", "int4")])
def test_a_bad_choice_or_plan_names_the_variable(name, bad):
    with pytest.raises(ConfigError) as e:
        Settings.from_env({f"CONSTRAINED_SPEC_{name}": bad})
    assert e.value.option == f"CONSTRAINED_SPEC_{name}"


def test_every_variable_is_in_the_options_table():
    table = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    for f in dataclasses.fields(Settings):
        assert f"`{PREFIX}{f.name.upper()}`" in table


def test_the_environment_is_read_once_until_reloaded(cs_env, monkeypatch):
    cs_env(CONSTRAINED_SPEC_MEMORY="lean")
    reads = []
    real = Settings.from_env
    monkeypatch.setattr(Settings, "from_env", classmethod(lambda cls, environ=None: (
        reads.append(1), real(environ))[1]))
    first = reload_settings()
    assert settings() is first and settings() is first and len(reads) == 1
    os.environ["CONSTRAINED_SPEC_MEMORY"] = "fast"  # cs_env restores it
    assert settings().memory == "lean"  # kept: not read again
    assert reload_settings().memory == "fast" and len(reads) == 2


def test_overridden_changes_a_field_for_a_block_only(cs_env):
    cs_env(CONSTRAINED_SPEC_PLAN=None)
    with overridden(plan="measure") as inside:
        assert settings() is inside and settings().plan == "measure"
    assert settings().plan is None


def test_the_command_line_reports_a_bad_variable_as_a_usage_error(cs_env, capsys):
    from constrained_spec import cli
    from constrained_spec.cli import exit_codes

    with pytest.raises(ConfigError):
        cs_env(CONSTRAINED_SPEC_DEBUG="maybe")
    code = cli.main(["info", "--no-model", "--json"])
    assert code == exit_codes.exit_code_for(ConfigError("x")) and code != exit_codes.EXIT_OK
    err = capsys.readouterr().err
    assert "CONSTRAINED_SPEC_DEBUG" in err and "'maybe'" in err


def test_info_measure_asks_for_a_measured_plan_without_touching_the_environment(cs_env, monkeypatch,
                                                                                capsys):
    from constrained_spec import cli
    from constrained_spec.cli import exit_codes
    from constrained_spec.model import loading as models
    cs_env(CONSTRAINED_SPEC_PLAN=None)
    seen = []

    class Loaded:
        def describe_kernels(self):
            seen.append(settings().plan)  # the plan is chosen here, when the runner is built
            return {"plan": "fixed"}

    monkeypatch.setattr(models, "load_model", lambda *a, **k: Loaded())
    assert cli.main(["info", "--measure", "--json"]) == exit_codes.EXIT_OK
    assert cli.main(["info", "--json"]) == exit_codes.EXIT_OK
    assert seen == ["measure", None]
    assert "CONSTRAINED_SPEC_PLAN" not in os.environ and settings().plan is None
    capsys.readouterr()
