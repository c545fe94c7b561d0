"""Strict config loading: every way a config can be wrong names the key and the file."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from mmtrain.config import apply_override, from_dict, load_config, to_dict
from mmtrain.errors import ConfigError


@dataclass
class Inner:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    mode: Literal["a", "b"] = "a"

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0 (got {self.lr})")


@dataclass
class Item:
    name: str
    weight: float = 1.0


@dataclass
class Outer:
    steps: int = 10
    flag: bool = False
    path: str | None = None
    inner: Inner = field(default_factory=Inner)
    items: list[Item] = field(default_factory=list)


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_full_round_trip(tmp_path):
    p = write(tmp_path, "steps: 5\nflag: true\ninner: {lr: 3e-4, betas: [0.8, 0.9], mode: b}\n"
                        "items: [{name: x}, {name: y, weight: 2}]\n")
    cfg = load_config(Outer, p)
    assert cfg.steps == 5 and cfg.flag is True and cfg.path is None
    assert cfg.inner == Inner(lr=3e-4, betas=(0.8, 0.9), mode="b")
    assert cfg.items == [Item("x"), Item("y", 2.0)]
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_overrides_parse_as_yaml(tmp_path):
    p = write(tmp_path, "steps: 5\n")
    cfg = load_config(Outer, p, ["inner.lr=0.5", "steps=7", "path=somewhere", "inner.mode=b"])
    assert (cfg.inner.lr, cfg.steps, cfg.path, cfg.inner.mode) == (0.5, 7, "somewhere", "b")


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("stepz: 3\n", [], "run.yaml: stepz: unknown key"),
        ("inner: {lrr: 1}\n", [], "run.yaml: inner.lrr: unknown key"),
        ("steps: many\n", [], "run.yaml: steps: expected int, got 'many'"),
        ("steps: 1.5\n", [], "run.yaml: steps: expected int, got 1.5"),
        ("flag: 1\n", [], "run.yaml: flag: expected bool, got 1"),
        ("inner: {lr: -1}\n", [], "run.yaml: inner.lr: must be > 0"),
        ("inner: {mode: c}\n", [], "run.yaml: inner.mode: must be one of ['a', 'b']"),
        ("inner: {betas: [0.9]}\n", [], "run.yaml: inner.betas: expected 2 items, got 1"),
        ("items: [{weight: 1}]\n", [], "run.yaml: items[0].name: required key is missing"),
        ("inner: 3\n", [], "run.yaml: inner: expected a mapping, got 3"),
        ("- a\n- b\n", [], "run.yaml: top level must be a mapping"),
        ("steps: [\n", [], "run.yaml: not valid YAML"),
        ("steps: 1\n", ["inner.lr=fast"], "run.yaml: inner.lr: expected float, got 'fast'"),
        ("steps: 1\n", ["steps.x=1"], "steps is not a section"),
        ("steps: 1\n", ["novalue"], "expected KEY=VALUE"),
        ("items: [{name: a}]\n", ["items.1.weight=2"], "items has no item '1' (a list of 1)"),
        ("items: [{name: a}]\n", ["items.x.weight=2"], "items has no item 'x'"),
    ],
)
def test_errors_name_key_and_file(tmp_path, text, overrides, expected):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(Outer, p, overrides)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Outer, tmp_path / "nope.yaml")


def test_apply_override_creates_sections():
    raw = {}
    apply_override(raw, "a.b.c=[1, 2]")
    assert raw == {"a": {"b": {"c": [1, 2]}}}


def test_override_indexes_lists():
    raw = {"items": [{"name": "a"}, {"name": "b", "weight": 1}]}
    apply_override(raw, "items.1.weight=2.5")
    apply_override(raw, "items.0=c")
    assert raw == {"items": ["c", {"name": "b", "weight": 2.5}]}


def test_base_file_is_edited_not_copied(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny.yaml").write_text(
        "steps: 5\ninner: {lr: 0.1, mode: b}\nitems: [{name: x}, {name: y}]\n")
    mine = write(tmp_path, "base: recipes/tiny.yaml\ninner: {lr: 0.2}\nitems: [{name: z}]\n")
    cfg = load_config(Outer, mine, ["steps=6"])
    assert cfg.steps == 6 and cfg.inner == Inner(lr=0.2, mode="b")  # mappings merge key by key
    assert cfg.items == [Item("z")]  # a list is replaced whole
    (tmp_path / "recipes" / "tiny.yaml").write_text("base: ../run.yaml\n")
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_config(Outer, mine)
    mine.write_text("base: absent.yaml\n")
    with pytest.raises(ConfigError, match="absent.yaml: config file not found .the base of"):
        load_config(Outer, mine)
