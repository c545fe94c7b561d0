"""The run directory: created (or reused to resume), checked writable, holds the resolved config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
