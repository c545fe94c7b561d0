"""Atomic checkpoints in the run directory: `RUN/step_<N>/` holds everything to resume.

A checkpoint is written into a hidden temporary directory and renamed into place, so a crash
mid-save leaves the previous checkpoint as the latest valid one. Only the last K are kept.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from mmtrain.errors import UserError

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.pt"
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"  # a copy, so a checkpoint is usable without the corpus


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep_last: int):
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = []
        if self.run_dir.is_dir():
            for p in self.run_dir.iterdir():
                m = _STEP_DIR.match(p.name)
                if m and (p / STATE_FILE).is_file():
                    found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def save(
        self, step: int, state: dict[str, Any], config_text: str, files: dict[str, Path] | None = None
    ) -> Path:
        """Write `state`, the resolved config and extra `files` (name -> source) atomically."""
        final = self.run_dir / f"step_{step}"
        tmp = self.run_dir / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        for name, source in (files or {}).items():
            shutil.copyfile(source, tmp / name)
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. final == periodic): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.run_dir)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.run_dir.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)


def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{path}: not a checkpoint (no {STATE_FILE})")
    try:
        return torch.load(file, map_location=map_location, weights_only=False)
    except Exception as e:  # a truncated or foreign file: say so in one line
        raise UserError(f"{file}: cannot read checkpoint: {e}") from None


def load_for_inference(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], Path | None]:
    """(resolved config as a dict, model state dict, tokenizer file or None) of a checkpoint.

    The entry point for consumers outside training (attention maps, evaluation, export).
    """
    path = Path(path)
    state = load_state(path)
    if "model" not in state or "config" not in state:
        raise UserError(f"{path}: not an mmtrain checkpoint (no model or config inside)")
    tokenizer = path / TOKENIZER_FILE if path.is_dir() else None
    return state["config"], state["model"], tokenizer if tokenizer and tokenizer.is_file() else None


def _fsync_tree(path: Path) -> None:
    """Flush the files of a checkpoint before the rename makes it visible."""
    for f in path.iterdir():
        if f.is_file():
            _fsync(f)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
