"""Hostile or mistaken environment variables: refused with a typed error, or warned about.

A fixed kernel plan with a bucket bound below 1 is a `ConfigError` naming the variable and the
bound (it used to be accepted and sorted first); a ``CONSTRAINED_SPEC_*`` name the package does
not read (a misspelling) is warned about once, with the closest known name, and no name the
package does read is ever warned about.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import constrained_spec.settings as settings_mod
from constrained_spec.errors import ConfigError
from constrained_spec.plan_syntax import parse_buckets
from constrained_spec.settings import (
    PREFIX,
    Settings,
    known_variables,
    reload_settings,
    unknown_variables,
    warn_unknown_variables,
)

ROOT = Path(__file__).resolve().parents[1]
PLAN = "CONSTRAINED_SPEC_PLAN"


@pytest.mark.parametrize("plan, bound", [
    ("decode=int4:-5/bf16", "-5"),
    ("decode=int4:0/bf16", "0"),
    ("prefill=fp32:-1/bf16,decode=int4", "-1"),
    ("decode=int4:12/int8:-3/bf16", "-3"),
])
def test_a_bucket_bound_below_one_is_refused_naming_the_variable_and_the_bound(plan, bound):
    with pytest.raises(ConfigError) as e:
        Settings.from_env({PLAN: plan})
    assert e.value.option == PLAN
    assert str(e.value).startswith(PLAN + ":")
    assert f"row limit {bound} " in str(e.value)


def test_bucket_bounds_of_one_row_and_more_are_still_accepted():
    assert parse_buckets("int4:1/bf16") == [(1, "int4"), (1 << 30, "bf16")]
    assert Settings.from_env({PLAN: "prefill=fp32:300/bf16,decode=int4:12/bf16"}).plan


def test_a_misspelled_variable_is_warned_about_with_the_closest_known_name(caplog):
    env = {"CONSTRAINED_SPEC_CAHCE": "/tmp/x", "CONSTRAINED_SPEC_MEMROY": "lean",
           "CONSTRAINED_SPEC_ZZZZZZZZ": "1", "CONSTRAINED_SPEC_CACHE": "/tmp/y"}
    assert unknown_variables(env) == [
        ("CONSTRAINED_SPEC_CAHCE", "CONSTRAINED_SPEC_CACHE"),
        ("CONSTRAINED_SPEC_MEMROY", "CONSTRAINED_SPEC_MEMORY"),
        ("CONSTRAINED_SPEC_ZZZZZZZZ", None),  # nothing close: no suggestion
    ]
    with caplog.at_level(logging.WARNING, logger="constrained_spec.settings"):
        assert warn_unknown_variables(env) is True
    [record] = caplog.records
    message = record.getMessage()
    assert "CONSTRAINED_SPEC_CAHCE (did you mean CONSTRAINED_SPEC_CACHE?)" in message
    assert "CONSTRAINED_SPEC_MEMROY (did you mean CONSTRAINED_SPEC_MEMORY?)" in message
    assert "CONSTRAINED_SPEC_ZZZZZZZZ" in message and "docs/options.md" in message


def test_no_variable_the_package_reads_is_warned_about(caplog):
    env = {name: "x" for name in known_variables()}
    env["OTHER_PROGRAM_VAR"] = "1"  # not ours: never warned about
    assert unknown_variables(env) == []
    with caplog.at_level(logging.WARNING, logger="constrained_spec.settings"):
        assert warn_unknown_variables(env) is False
    assert not caplog.records


def _names_in(paths: list[Path]) -> dict[str, str]:
    """Every full ``CONSTRAINED_SPEC_NAME`` written in ``paths`` -> the first file it is in."""
    found: dict[str, str] = {}
    pattern = re.compile(r"\bCONSTRAINED_SPEC_[A-Z0-9_]*[A-Z0-9]\b")
    for path in paths:
        for name in pattern.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_name_read_anywhere_in_the_code_is_a_known_one():
    # the package, the benchmarks and examples, and the options table: a name read with
    # os.environ outside settings.py must be in settings.READ_ELSEWHERE
    paths = [p for folder in ("constrained_spec", "benchmarks", "examples")
             for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts]
    paths.append(ROOT / "docs" / "options.md")
    found = _names_in(paths)
    assert "CONSTRAINED_SPEC_CACHE" in found  # the scan reads what it should
    unknown = {name: where for name, where in found.items() if name not in known_variables()}
    assert not unknown, f"read but not known to settings (add to READ_ELSEWHERE): {unknown}"


def test_the_unknown_name_warning_is_given_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(settings_mod, "_warned", False)
    monkeypatch.setenv(PREFIX + "CAHCE", "/tmp/x")
    with caplog.at_level(logging.WARNING, logger="constrained_spec.settings"):
        reload_settings()
        reload_settings()  # a test or a command reading the environment again
    assert len(caplog.records) == 1 and "CAHCE" in caplog.records[0].getMessage()
