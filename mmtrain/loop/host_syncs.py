"""Count the device-to-host syncs of a piece of code, each named by where it was called from.

A sync makes the host wait until the accelerator's queue has run up to that point: `.item()`,
`float(t)`, `bool(t)`, `.tolist()`, and every op whose output shape depends on the data
(`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `repeat_interleave` without
`output_size`, `bincount`). On a GPU each one drains the launch queue, so the next kernels start
late; on a CPU they cost nothing, which is why nothing else would show them. This mode sees them
on the CPU too: the ops through `TorchDispatchMode`, `.tolist()` / `.numpy()` (which dispatch no op
on a CPU tensor) by wrapping those two methods while the mode is active.

    with HostSyncs() as syncs:
        trainer.train_step(it)
    syncs.by_site()   # {"mmtrain/loop/trainer.py:277 train_step": {"_local_scalar_dense": 1}, ...}
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages' parent of mmtrain)
_ALWAYS = {  # the op's output needs a value on the host (a scalar, or a data-dependent size)
    aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default,
    aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.bincount.default,
}


@dataclass(frozen=True)
class Sync:
    op: str  # the aten op, or "tolist" / "numpy"
    site: str  # "path/in/repo.py:LINE function" of the innermost frame of ours that caused it


class HostSyncs(TorchDispatchMode):
    """Records one `Sync` per device-to-host read inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[Sync] = []
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self._record(func.__name__.split(".")[0])
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def _counting(self, name: str, original):
        def method(t, *args, **kwargs):
            self._record(name)
            return original(t, *args, **kwargs)
        return method

    def _record(self, op: str) -> None:
        self.syncs.append(Sync(op, _our_site()))

    def by_site(self, lines: bool = True) -> dict[str, Counter]:
        """{site: {op: count}}; lines=False keys by "path function" (stable as code moves)."""
        out: dict[str, Counter] = {}
        for s in self.syncs:
            site = s.site if lines else _without_line(s.site)
            out.setdefault(site, Counter())[s.op] += 1
        return out

    def __len__(self) -> int:
        return len(self.syncs)


def _syncs(func, args, kwargs) -> bool:
    if func in _ALWAYS:
        return True
    if func is aten.repeat_interleave.Tensor:  # its output length is repeats.sum() on the host
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _without_line(site: str) -> str:
    path, _, rest = site.partition(":")
    return f"{path} {rest.partition(' ')[2]}" if rest else site


def _our_site() -> str:
    """The innermost frame in this project's code (not torch's, not this module's)."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = Path(frame.filename).resolve()
        if path == here or not path.is_relative_to(_ROOT) or {"torch", "site-packages"} & set(path.parts):
            continue
        return f"{path.relative_to(_ROOT)}:{frame.lineno} {frame.name}"
    return "<outside the project>"
