"""The run directory: created (or reused to resume), checked writable, holds the resolved config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

from mmtrain.config import to_dict
from mmtrain.errors import UserError

RESOLVED_CONFIG = "config.yaml"


def prepare_run_dir(path: str | Path) -> Path:
    run_dir = Path(path)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"run_dir {str(run_dir)!r}: cannot write there ({e.strerror or e})") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UserError(f"run_dir {str(run_dir)!r}: not writable")
    return run_dir


def write_resolved_config(cfg, run_dir: Path) -> str:
    """Save the config after defaults and overrides (and the tokenizer's vocab) are applied."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    (run_dir / RESOLVED_CONFIG).write_text(text, encoding="utf-8")
    return text
