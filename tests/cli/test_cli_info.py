"""`constrained-spec info`: the machine's CPU flags, torch's capability, a model's kernel plan."""

from __future__ import annotations

import json

from constrained_spec import cli


def test_info_without_a_model_names_the_cpu_flags_and_torch_capability(capsys, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cli.main(["info", "--no-model", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["machine"]
    assert set(m) >= {"cpu", "flags", "torch", "capability", "threads", "isa_env"}
    assert m["isa_env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and "model" not in report
    assert cli.main(["info", "--no-model"]) == 0
    text = capsys.readouterr().out
    assert "cpu flags:" in text and "restricted by: ONEDNN_MAX_CPU_ISA=AVX2" in text
