"""Range checks for config dataclasses: one line in `__post_init__` per rule.

    check(self, "lr", gt=0)
    check(self, "steps", "grad_accum", ge=1)          # several fields, one rule
    check(self, "min_lr_ratio", ge=0, le=1)
    check(self, "betas", ge=0, lt=1)                  # a tuple/list: each element
    check(self, "vocab_size", ge=1, none_ok=True)
    check(self, "backend", choices=BACKENDS)

A violation raises `ValueError("<field>: must be <rule> (got <value>)")` (docs/CONVENTIONS.md); the
config loader prefixes the dotted key and the file. Consistency checks between fields stay
hand-written next to these.

A leaf: it imports only the standard library, so that `models/` and `data_pipelines/` (which import
neither the trainer nor each other) can use it too (tests/test_imports.py keeps it one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def rule(ge=None, gt=None, le=None, lt=None, choices: Sequence | None = None) -> str:
    """The rule in words: '>= 1', 'in (0, 1]', 'one of a, b'."""
    if choices is not None:
        return "one of " + ", ".join(map(str, choices))
    lo, lo_open = (gt, True) if gt is not None else (ge, False)
    hi, hi_open = (lt, True) if lt is not None else (le, False)
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"


def ok(value: Any, ge=None, gt=None, le=None, lt=None, choices: Sequence | None = None) -> bool:
    if choices is not None:
        return value in choices
    return ((ge is None or value >= ge) and (gt is None or value > gt)
            and (le is None or value <= le) and (lt is None or value < lt))


def check(cfg: Any, *names: str, ge=None, gt=None, le=None, lt=None, choices: Sequence | None = None,
          none_ok: bool = False) -> None:
    """Raise ValueError naming the first field of `names` on `cfg` that breaks the rule."""
    bounds = dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices)
    for name in names:
        value = getattr(cfg, name)
        if value is None and none_ok:
            continue
        each = isinstance(value, (tuple, list)) and choices is None
        if not all(ok(v, **bounds) for v in (value if each else [value])):
            words = ("each must be " if each else "must be ") + rule(**bounds)
            shown = list(value) if each else repr(value) if isinstance(value, str) else value
            raise ValueError(f"{name}: {words}{' or null' if none_ok else ''} (got {shown})")
