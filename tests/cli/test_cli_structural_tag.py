"""``--structural-tag``: free text with tagged segments from the command line, in vLLM's and
xgrammar's JSON shapes, inline or from a file; the text printed as a JSON string."""

from __future__ import annotations

import json

import pytest

from constrained_spec.cli import main
from constrained_spec.schemas import StructuralTag

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TAG = {"type": "structural_tag", "triggers": ["<function="], "at_least_one": True,
       "stop_after_first": True,
       "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}]}


def test_the_flag_takes_inline_json_or_a_file(tmp_path):
    from constrained_spec.cli.args import structural_tag_arg

    path = tmp_path / "tag.json"
    path.write_text(json.dumps(TAG))
    for value in (json.dumps(TAG), str(path)):
        tag = structural_tag_arg(value)
        assert isinstance(tag, StructuralTag) and tag.tags[0].begin == "<function=get_weather>"


def test_a_bad_structural_tag_is_a_schema_error_naming_the_flag(capsys):
    assert main(["generate", "x", "--structural-tag", '{"type": "structural_tag"}']) == 3
    assert "--structural-tag" in capsys.readouterr().err


@pytest.mark.model
def test_generate_prints_the_tagged_text_with_a_valid_segment(embedded, capsys, monkeypatch):
    monkeypatch.setattr("constrained_spec.model.loading.load_model", lambda *a, **k: embedded)
    code = main(["generate", "What is the weather in Paris? Call get_weather.", "--quiet",
                 "--structural-tag", json.dumps(TAG), "--max-tokens", "60"])
    assert code == 0
    text = json.loads(capsys.readouterr().out)
    assert text.startswith("<function=get_weather>") and text.endswith("</function>")
    assert "city" in json.loads(text[len("<function=get_weather>"):-len("</function>")])
