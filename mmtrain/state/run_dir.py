"""The run directory: created (or reused to resume), checked writable, holds the resolved config."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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


@contextmanager
def undone_on_error(path: str | Path) -> Iterator[None]:
    """Around setting up a run: if it fails (a config, tokenizer or shard error) and `path` did not
    exist before, remove the directory it made, when nothing but the resolved config is in it."""
    run_dir, existed = Path(path), Path(path).exists()
    try:
        yield
    except BaseException:
        if not existed and run_dir.is_dir():
            (run_dir / RESOLVED_CONFIG).unlink(missing_ok=True)
            with suppress(OSError):
                run_dir.rmdir()  # only if empty: whatever else is there stays
        raise
