"""Errors that mean "the user asked for something wrong": printed as one line, no traceback.

`run_guarded` is what every command line (`mmtrain`, `mmtrain-attn`, `python -m mmtrain.train`)
runs its work through; it lives here, below the CLIs, so that they import it one way."""

from __future__ import annotations

import sys
from collections.abc import Callable

from mmtrain.data_pipelines.errors import DataError


class UserError(Exception):
    """Bad input from the user (config, paths, checkpoints): the CLI prints it and exits 2."""


class ConfigError(UserError):
    """A config file or override that does not parse or validate; the message names key and file."""


def run_guarded(fn: Callable[[], int]) -> int:
    """fn(); a user mistake prints one line and returns 2, Ctrl-C returns 130, a bug keeps its traceback."""
    try:
        return fn()
    except (UserError, DataError) as e:
        print(f"mmtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmtrain: interrupted", file=sys.stderr)
        return 130
