"""Small command-line defaults: ``--tools mod.py:f1,f2`` takes several functions from one
module (imported once), and ``generate`` says on stderr that it is loading the model and how
long that took, while stdout keeps the result alone (the tiny Llama, ``load_model`` patched)."""

from __future__ import annotations

import json

import pytest

from constrained_spec.cli import main
from constrained_spec.cli.args import tool_refs, tools_from_args
from constrained_spec.cli.parser import build_parser

MODULE = '''
from typing import Literal

IMPORTS = globals().setdefault("IMPORTS", [])
IMPORTS.append(1)


def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather of a city."""
    return city


def search(q: Literal["cats", "dogs"]) -> str:
    """Search the web."""
    return q
'''


@pytest.fixture
def module_file(tmp_path):
    path = tmp_path / "two_tools.py"
    path.write_text(MODULE)
    return path


def test_a_name_without_a_module_is_from_the_module_before_it():
    assert tool_refs("mod.py:f1, f2,other:g,h") == ["mod.py:f1", "mod.py:f2", "other:g", "other:h"]
    assert tool_refs("f1") == ["f1"]  # no module at all: import_ref refuses it, naming the form


def test_tools_takes_several_functions_from_one_module_imported_once(module_file):
    args = build_parser().parse_args(["generate", "p", "--tools",
                                      f"{module_file}:get_weather,search"])
    toolset = tools_from_args(args)
    assert [t.name for t in toolset.tools] == ["get_weather", "search"]
    weather, search = (t.function for t in toolset.tools)
    assert weather.__globals__ is search.__globals__  # one module object
    assert weather.__globals__["IMPORTS"] == [1]  # its code ran once


def test_generate_says_loading_and_the_load_time_on_stderr_only(module_file, tiny_loaded,
                                                                 capsys, monkeypatch):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: tiny_loaded)
    code = main(["generate", "Find cats", "--tools", f"{module_file}:get_weather,search",
                 "--tool-choice", "search", "--max-tokens", "200", "--system", "Go."])
    captured = capsys.readouterr()
    assert code == 0
    [line] = captured.out.splitlines()  # stdout: the call alone
    assert json.loads(line)["name"] == "search"
    assert "loading model" in captured.err and "model loaded in" in captured.err
    main(["generate", "Find cats", "--tools", f"{module_file}:search", "--tool-choice", "search",
          "--max-tokens", "200", "--system", "Go.", "--quiet"])
    assert "loading model" not in capsys.readouterr().err  # --quiet: errors only


def test_python_takes_the_command_lines_reasoning_words(tiny_loaded):
    from constrained_spec import ConfigError, Generator
    from constrained_spec.frontend.reasoning import check_reasoning_option, resolve_reasoning

    assert check_reasoning_option("on") is True and check_reasoning_option("off") is False
    assert resolve_reasoning("off", tiny_loaded.tokenizer) is None
    assert resolve_reasoning("on", tiny_loaded.tokenizer) is not None  # markers, as True gives
    assert Generator(tiny_loaded, reasoning="off").reasoning is None
    with pytest.raises(ConfigError, match="'auto', 'on', 'off'"):
        check_reasoning_option("yes")
