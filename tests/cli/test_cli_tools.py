"""``constrained-spec generate --tool FILE.json --tools MODULE:FUNCTION --tool-choice``: the
flags become a ToolSet (bad ones exit 2 before a model is loaded), and ``main`` in process on
the tiny Llama (``load_model`` patched) prints the call as JSON."""

from __future__ import annotations

import json

import pytest
from test_cli_parsing import stderr_of_exit_2_before_loading

from constrained_spec.cli import main
from constrained_spec.cli.args import tools_from_args
from constrained_spec.cli.parser import build_parser

SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"enum": ["cats", "dogs"]}},
                                     "required": ["q"], "additionalProperties": False}}}
MODULE = '''
from typing import Literal

def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather of a city."""
    return city
'''


@pytest.fixture
def tool_files(tmp_path):
    (tmp_path / "search.json").write_text(json.dumps(SEARCH))
    (tmp_path / "weather_tools.py").write_text(MODULE)
    return tmp_path


def test_tool_flags_become_one_toolset(tool_files):
    args = build_parser().parse_args([
        "generate", "p", "--tool", str(tool_files / "search.json"),
        "--tools", f"{tool_files / 'weather_tools.py'}:get_weather", "--tool-choice", "required",
        "--parallel-tool-calls"])
    toolset = tools_from_args(args)
    assert [t.name for t in toolset.tools] == ["search", "get_weather"]
    assert toolset.choice == "required" and toolset.parallel
    assert tools_from_args(build_parser().parse_args(["generate", "p"])) is None


@pytest.mark.parametrize("argv, match", [
    (["--tool-choice", "required"], "--tool-choice: needs tools"),
    (["--tool", "missing.json"], "--tool: cannot read"),
    (["--tools", "nomodule_xyz:f"], "--tools: cannot import"),
    (["--tool", "{search}", "--tool-choice", "nope"], "--tool-choice: 'nope' is neither"),
    (["--tool", "{search}", "--schema", "name, age int"], "--tool: a schema applies"),
    (["--tool", "{search}", "--stream"], "--stream: tool calls are printed"),
    (["--tool", "{search}", "--batch", "-"], "--batch: tools apply to one prompt"),
])
def test_bad_tool_flags_exit_2_before_loading_a_model(tool_files, argv, match, capsys,
                                                       monkeypatch):
    argv = [a.replace("{search}", str(tool_files / "search.json")) for a in argv]
    err = stderr_of_exit_2_before_loading(["p", *argv], capsys, monkeypatch)
    assert match in err, err


def test_a_required_call_is_printed_as_one_json_line(tool_files, tiny_loaded, capsys,
                                                     monkeypatch):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: tiny_loaded)
    code = main(["generate", "Find cats", "--tool", str(tool_files / "search.json"),
                 "--tool-choice", "search", "--max-tokens", "200", "--quiet", "--system", "Go."])
    out = capsys.readouterr().out
    assert code == 0
    [line] = out.splitlines()
    call = json.loads(line)
    assert call["name"] == "search" and call["arguments"]["q"] in ("cats", "dogs")
