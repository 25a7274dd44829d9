"""The public-catalog source of the coverage sweep (benchmarks/catalogs.py), offline: a tiny fake
package (a folder and the same files as a wheel), its schemas found, instances generated and
labelled by the final validator, and the sweep run on them."""

from __future__ import annotations

import json
import zipfile

import pytest

SCHEMA = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "tags": {"type": "array", "items": {"type": "string",
                                                             "pattern": "^[a-z]{2,4}$"},
                                  "maxItems": 3},
                         "level": {"type": "integer", "minimum": 1, "maximum": 5},
                         "kind": {"enum": ["a", "b"]}},
          "required": ["name", "level"], "additionalProperties": False}


@pytest.fixture()
def fake_package(tmp_path):
    root = tmp_path / "fakepkg"
    (root / "fakepkg" / "schemas").mkdir(parents=True)
    (root / "fakepkg" / "schemas" / "thing.json").write_text(json.dumps(SCHEMA))
    (root / "fakepkg" / "schemas" / "other.json").write_text(json.dumps(
        {"anyOf": [{"type": "integer"}, {"type": "string", "format": "date"}]}))
    (root / "fakepkg" / "data.json").write_text(json.dumps([1, 2, 3]))        # data, not a schema
    (root / "fakepkg" / "settings.json").write_text(json.dumps({"debug": True}))
    (root / "fakepkg" / "broken.json").write_text("{not json")
    (root / "fakepkg-1.0.dist-info").mkdir()
    (root / "fakepkg-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.4\nName: fakepkg\nVersion: 1.0\nLicense-Expression: MIT\n\nA README "
        "that mentions License: GPL in its body.\n")
    (root / "fakepkg-1.0.dist-info" / "licenses").mkdir()
    (root / "fakepkg-1.0.dist-info" / "licenses" / "LICENSE").write_text("MIT")
    return root


def _as_wheel(folder, tmp_path):
    whl = tmp_path / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                z.write(p, p.relative_to(folder).as_posix())
    return whl


def test_bundled_schemas_are_found_and_data_files_skipped(fake_package, tmp_path):
    from benchmarks.catalogs import licence_of, load_schemas

    for source in (fake_package, _as_wheel(fake_package, tmp_path)):
        found = load_schemas(source)
        assert [p for p, _ in found] == ["fakepkg/schemas/other.json", "fakepkg/schemas/thing.json"]
        assert found[1][1] == SCHEMA
    assert licence_of(_as_wheel(fake_package, tmp_path)) == "MIT (licence files: 1)"


def test_package_rows_name_each_schema_and_ask_for_generated_instances(fake_package):
    from benchmarks.catalogs import package_rows

    split, rows, _ = package_rows(str(fake_package), seed=3, n_valid=2, n_invalid=4)
    assert split == "fakepkg"
    assert [r["id"] for r in rows] == ["fakepkg/fakepkg/schemas/other.json",
                                       "fakepkg/fakepkg/schemas/thing.json"]
    assert all(r["tests"] is None and r["generate"] == {"seed": 3, "n_valid": 2, "n_invalid": 4}
               for r in rows)


def test_an_unpinned_package_is_refused_before_any_download():
    from benchmarks.catalogs import fetch_wheel

    with pytest.raises(ValueError, match="NAME==VERSION"):
        fetch_wheel("check-jsonschema>=0.30")


def test_generated_instances_are_labelled_by_the_final_validator_and_seeded():
    import jsonschema

    from benchmarks.catalogs import generate_tests

    tests = generate_tests(SCHEMA, seed=0, n_valid=5, n_invalid=10)
    valid = [t["data"] for t in tests if t["valid"]]
    invalid = [t["data"] for t in tests if not t["valid"]]
    assert len(valid) == 5 and len(invalid) == 10
    check = jsonschema.Draft7Validator(SCHEMA)
    assert all(check.is_valid(v) for v in valid) and not any(check.is_valid(v) for v in invalid)
    assert len({json.dumps(t["data"], sort_keys=True) for t in tests}) == len(tests)
    assert generate_tests(SCHEMA, seed=0, n_valid=5, n_invalid=10) == tests
    assert generate_tests(SCHEMA, seed=1, n_valid=5, n_invalid=10) != tests


def test_a_pattern_string_is_drawn_from_the_pattern():
    import random
    import re

    from benchmarks.catalogs import InstanceSampler

    sampler = InstanceSampler({}, random.Random(0))
    for pattern in (r"^[a-z]{2,4}$", r"^v\d+\.\d+(-(rc|beta)\d)?$", r"^(\w+)-\1$", r"[^x]y"):
        s = sampler.string_from_pattern(pattern)
        assert s is not None and re.search(pattern, s), (pattern, s)


def test_the_sweep_runs_on_a_package_with_generated_instances(fake_package, coverage_mod):
    """What a worker does with a catalog row: generate, then check ours; nothing invalid is
    accepted undeclared and the valid instances of this fully supported schema are accepted."""
    from benchmarks.catalogs import generate_tests, package_rows

    _, rows, _ = package_rows(str(fake_package), seed=0, n_valid=4, n_invalid=8)
    ctx = coverage_mod.Context(coverage_mod.tokenizer_vocab("ascii"))
    for row in rows:
        row = {**row, "tests": generate_tests(row["schema"], **row["generate"])}
        result = coverage_mod.evaluate(ctx, row, "ours", time_limit=30.0)
        assert result["status"] == "compiled"
        counts = result["counts"]
        assert counts["silent"] == 0 and counts["valid_rejected"] == 0, (row["id"], counts)
        assert counts["valid_ok"] >= 2 and counts["invalid_rejected"] >= 4
