"""Every range a config class checks with `mmtrain.checks.check` rejects a value just outside it,
with a one-line message that names the field and the allowed range.

The rules are read from the source (`check(self, "name", ..., ge=1)` calls in `__post_init__`), so a
field that gains a check is covered here without a new test.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import re
from pathlib import Path

import pytest

from mmtrain.checks import check, rule

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"mmtrain": "mmtrain", "models": "mmtrain.models", "data_pipelines": "mmtrain.data_pipelines"}
# classes whose defaults are not valid on their own
VALID = {"StageConfig": {"until_step": 1, "sources": ["a"]}}


def _module(path: Path) -> str:
    for folder, name in FOLDERS.items():
        if path.is_relative_to(ROOT / folder):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            return ".".join([name, *(p for p in parts if p != "__init__")])
    raise AssertionError(path)


def _rules_in(cls: ast.ClassDef):
    for fn in cls.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__"):
            continue
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "check":
                names = [a.value for a in call.args[1:] if isinstance(a, ast.Constant)]
                try:
                    bounds = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
                except ValueError:  # a bound computed from another field: a consistency check
                    continue
                yield from ((n, bounds) for n in names)


def discovered_rules() -> list[tuple[str, str, str, dict]]:
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                out += [(_module(path), cls.name, n, b) for n, b in _rules_in(cls)]
    return out


RULES = discovered_rules()


def outside(bounds: dict, default):
    """A value just outside the rule, of the field's type (a tuple: its first element broken)."""
    if isinstance(default, (tuple, list)):
        return type(default)([outside(bounds, default[0]), *default[1:]])
    if bounds.get("choices") is not None:
        return "not-" + "-".join(map(str, bounds["choices"]))
    lo = bounds.get("gt", bounds.get("ge"))
    if lo is not None:
        return lo if "gt" in bounds else (lo - 1 if isinstance(default, int) else lo - 0.5)
    hi = bounds.get("lt", bounds.get("le"))
    return hi if "lt" in bounds else (hi + 1 if isinstance(default, int) else hi + 0.5)


def test_rules_are_found_across_the_packages():
    classes = {c for _, c, _, _ in RULES}
    assert {"OptimConfig", "TrainConfig", "DataConfig", "MediaConfig", "AttentionConfig", "DecoderConfig",
            "MoEConfig", "VisionConfig", "DWAConfig", "GradNormConfig", "RelianceGuardConfig",
            "UncertaintyConfig", "SamplingConfig"} <= classes
    assert len(RULES) >= 80


@pytest.mark.parametrize(("module", "cls_name", "name", "bounds"), RULES,
                         ids=[f"{c}.{n}" for _, c, n, _ in RULES])
def test_out_of_range_value_is_rejected_naming_the_field(module, cls_name, name, bounds):
    cls = getattr(importlib.import_module(module), cls_name)
    base = VALID.get(cls_name, {})
    default = {f.name: f for f in dataclasses.fields(cls)}[name]
    default = base.get(name, default.default if default.default is not dataclasses.MISSING
                       else default.default_factory())
    cls(**base)  # the defaults pass
    bad = outside(bounds, default)
    with pytest.raises(ValueError) as e:
        cls(**{**base, name: bad})
    msg = str(e.value)
    assert msg.startswith(f"{name}: "), msg
    assert rule(**{k: v for k, v in bounds.items() if k != "none_ok"}) in msg and "\n" not in msg, msg


@pytest.mark.parametrize(("kw", "good", "bad", "words"), [
    ({"ge": 1}, 1, 0, ">= 1"), ({"gt": 0}, 1e-9, 0.0, "> 0"), ({"le": 1}, 1, 1.5, "<= 1"),
    ({"ge": 0, "lt": 1}, 0.0, 1.0, "in [0, 1)"), ({"gt": 0, "le": 1}, 1.0, 0.0, "in (0, 1]"),
    ({"choices": ("a", "b")}, "b", "c", "one of a, b"), ({"ge": 0}, 0.0, math.nan, ">= 0"),
    ({"gt": 0}, (1.0, 2.0), (1.0, 0.0), "each must be > 0"),
])
def test_check_rules_and_messages(kw, good, bad, words):
    @dataclasses.dataclass
    class C:
        x: object = None

    check(C(good), "x", **kw)
    with pytest.raises(ValueError, match="^x: .*" + re.escape(words)):
        check(C(bad), "x", **kw)
    check(C(None), "x", none_ok=True, **kw)
