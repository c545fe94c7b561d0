"""The torch floor: importing mmtrain under an older torch fails in one line naming the floor; the
floor pyproject.toml declares is the one checked."""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from pathlib import Path

import pytest

import mmtrain

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old", ["2.8.1+cu128", "2.6.0", "1.13.1"])
def test_import_below_the_floor_fails_in_one_line(monkeypatch, old):
    monkeypatch.setattr(metadata, "version", lambda name: old if name == "torch" else "0")
    with pytest.raises(ImportError) as e:
        importlib.reload(mmtrain)
    msg = str(e.value)
    assert "\n" not in msg and old in msg and "torch >= 2.9" in msg


@pytest.mark.parametrize("ok", ["2.9.0", "2.10.0a0+git1234", "2.13.0+cpu", None])
def test_floor_and_newer_pass(ok):
    mmtrain.check_torch(ok)


def test_pyproject_declares_the_checked_floor():
    pin = re.search(r'"torch>=(\d+)\.(\d+)', (REPO / "pyproject.toml").read_text())
    assert (int(pin[1]), int(pin[2])) == mmtrain.TORCH_FLOOR
