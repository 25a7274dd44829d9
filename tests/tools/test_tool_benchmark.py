"""The pure parts of ``benchmarks/tools.py`` on BFCL-shaped rows written here (the benchmark
itself is run on a quiet machine, not in tests)."""

from __future__ import annotations

import gzip
import json

from benchmarks.tools import check_calls, load_tools, make_requests, summarize, tool_name


def _rows(tmp_path, n=6):
    path = tmp_path / "BFCL.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(n):
            schema = {"type": "object", "properties": {f"pkg.Cls.fn{i}": {
                "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                "required": [f"pkg.Cls.fn{i}"]}
            f.write(json.dumps({"id": f"BFCL_{i}", "schema": schema}) + "\n")
        f.write(json.dumps({"id": "two", "schema": {"properties": {"a": {}, "b": {}}}}) + "\n")
    return path


def test_bfcl_functions_become_openai_tools_with_allowed_names(tmp_path):
    tools = load_tools(_rows(tmp_path))
    assert len(tools) == 6  # the two-function row is left out
    assert tools[0]["function"]["name"] == "pkg_Cls_fn0" == tool_name("pkg.Cls.fn0")
    reqs = make_requests(tools, 3, None)
    assert [len(r["tools"]) for r in reqs] == [3, 3]
    assert [r["ask"] for r in reqs] == ["pkg_Cls_fn0", "pkg_Cls_fn4"]  # request i asks tool i % 3
    assert make_requests(tools, 3, 1) == reqs[:1]


def test_calls_are_checked_against_the_chosen_tools_schema(tmp_path):
    [req, _] = make_requests(load_tools(_rows(tmp_path)), 3, None)
    assert check_calls(req, [("pkg_Cls_fn0", {"x": 1})]) == (True, True)
    assert check_calls(req, [("pkg_Cls_fn1", {"x": 1})]) == (True, False)
    assert check_calls(req, [("pkg_Cls_fn0", {"x": "1"})])[0] is False
    assert check_calls(req, [("elsewhere", {"x": 1})]) == (False, False)
    assert check_calls(req, []) == (False, False)
    records = [{"system": "ours", "tokens": 10, "wall_s": 1.0, "forwards": 4, "completed": True,
                "valid": True, "asked": True},
               {"system": "ours", "refused": "SchemaError"}]
    table = summarize(records, ["ours"])
    assert "| ours | 2 | 1 | 100.0% (1/1) | 100.0% (1/1) | 100.0% (1/1) | 2.50 | 10.0 |" in table
