"""The wheel installs one import root, `mmtrain`: the layout's top-level folders land under it, and
benchmarks and experiment scripts are not installed."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder in the checkout -> where the wheel puts it
MAPPED = {
    "mmtrain": "mmtrain",
    "models": "mmtrain/models",
    "data_pipelines": "mmtrain/data_pipelines",
    "tools/attention_maps": "mmtrain/attention_maps",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
    subprocess.run([*cmd, str(ROOT)], check=True, cwd=out, capture_output=True, timeout=300)
    (path,) = out.glob("mmtrain-*.whl")
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    return set(wheel.namelist())


def test_only_top_level_name_is_mmtrain(wheel_names):
    tops = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"mmtrain"}


def test_every_module_of_the_layout_is_installed_under_mmtrain(wheel_names):
    for folder, target in MAPPED.items():
        sources = [p.relative_to(ROOT / folder) for p in (ROOT / folder).rglob("*.py")]
        assert sources, folder
        missing = [str(p) for p in sources if f"{target}/{p.as_posix()}" not in wheel_names]
        assert not missing, (folder, missing)


def test_benchmarks_and_experiments_are_not_installed(wheel_names):
    assert not [n for n in wheel_names if "/bench/" in n or "/experiments/" in n or "word_probe" in n]


def test_console_scripts_point_into_mmtrain(wheel, wheel_names):
    (entry,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry).decode()
    assert "mmtrain = mmtrain.cli:main" in text
    assert "mmtrain-attn = mmtrain.attention_maps.cli:main" in text


def test_every_entry_point_names_a_function_in_the_wheel(wheel, wheel_names):
    """Console scripts and the `lmms_eval.models` entry point: the module is installed and defines
    the name (read, not imported: lmms_eval is not a dependency)."""
    import ast

    (entry,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    targets = [line.split("=", 1)[1].strip() for line in wheel.read(entry).decode().splitlines()
               if "=" in line]
    assert len(targets) >= 3, targets
    for target in targets:
        module, attr = target.split(":")
        path = module.replace(".", "/") + ".py"
        assert path in wheel_names, target
        tree = ast.parse(wheel.read(path).decode())
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert attr in names, target
