"""The collectives this process entered, the latest last: what a timed-out run reports.

Ranks that stop calling the same collectives in the same order hang until `dist.timeout_s`, and
gloo then says only "Timed out waiting 120000ms for recv operation". `install()` (called by
`init_distributed`) wraps the collective functions of `torch.distributed` -- ours in
mmtrain/parallel, FSDP2's, DCP's, the trainer's all-reduces -- so that each call is numbered and
remembered with its op, group, shape and our call site. When one raises (a timeout, a peer gone),
the error carries, and stderr gets, one line per rank naming it:

    rank 1: all_to_all_single #212 on group mesh_ep [0, 1] ((37, 32)) from
    mmtrain/parallel/comm.py:54 < mmtrain/parallel/expert_parallel.py:71 < models/moe/layer.py:84 failed: ...

plus the collectives entered before it (`recent()`): comparing the ranks' numbers shows where
they parted. Not seen: functional collectives (DTensor redistribution, torch.compile'd graphs),
which do not go through these functions; with NCCL, whose errors surface asynchronously, torch's
flight recorder (TORCH_FR_BUFFER_SIZE) is the tool.

Cheap on the step's path: a call records its group and tensor shapes as they are and names them
only when printed (a failure, `report()`); its numbers and log are per thread, so DCP's async
writer thread does not renumber the training thread's calls; inside a graph torch.compile is
tracing, the wrapper steps aside (no frame walk in the trace: no graph break).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all",
       "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
       "broadcast", "reduce", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv",
       "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
KEEP = int(os.environ.get("MMTRAIN_CALL_LOG", 16))  # calls remembered (MMTRAIN_CALL_LOG)
_ROOT = Path(__file__).resolve().parents[2]  # the repository (mmtrain/, models/)
_TORCH = Path(torch.__file__).resolve().parent
_timeout = timedelta(minutes=10)  # torch's default for gloo


class _Log(threading.local):
    """One thread's calls: its count, its last KEEP calls, its `within` labels."""

    def __init__(self) -> None:
        self.count = 0
        self.recent: deque[Call] = deque(maxlen=KEEP)
        self.within: list[str] = []  # e.g. "backward of <the forward's site>" (autograd: no frames)


_log = _Log()


@dataclass
class Call:
    n: int  # this thread's collective number (1, 2, ...): equal on every rank while they agree
    op: str
    group: object  # the process group (None: the world), named when printed
    shape: object  # the tensor arguments (or a description), named when printed
    site: str

    def __str__(self) -> str:
        shape = self.shape if isinstance(self.shape, str) else _shape(self.shape)
        return f"{self.op} #{self.n} on group {_group(self.group)} ({shape}) from {self.site}"


def install(timeout: timedelta | None = None) -> None:
    """Wrap torch.distributed's collective functions once per process (idempotent); `timeout`: the
    process group's, for the waits that gloo leaves unbounded (comm.all_to_all_single)."""
    global _timeout
    _timeout = timeout or _timeout
    for op in OPS:
        fn = getattr(dist, op, None)
        if fn is not None and not getattr(fn, "_mmtrain_logged", False):
            setattr(dist, op, _logged(op, fn))


@contextlib.contextmanager
def within(label: str):
    """Calls made inside are reported as made from `label` too (an autograd backward: its forward's
    call site, from `site()`)."""
    _log.within.append(label)
    try:
        yield
    finally:
        _log.within.pop()


def timeout() -> timedelta:
    return _timeout


def recent() -> list[Call]:
    return list(_log.recent)


def report() -> str:
    """This rank's last collectives, the latest first (the one it waits in, if any)."""
    if not _log.recent:
        return ""
    lines = [f"rank {_rank()}: last collectives entered, latest first:"]
    lines += [f"  {c}" for c in reversed(_log.recent)]
    return "\n".join(lines)


def enter(op: str, group=None, shape: str = "-", skip: int = 1) -> Call:
    """Number and remember a call entered now (a wrapped collective, or the pipeline schedule's
    point-to-point batch: pipeline_p2p.py); its site starts `skip` frames up from enter's caller
    (1: the caller itself)."""
    _log.count += 1
    entry = Call(_log.count, op, group, shape, site(skip + 1))
    _log.recent.append(entry)
    return entry


def _logged(op: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced into a graph: nothing to record at run time
            return fn(*args, **kwargs)
        entry = enter(op, kwargs.get("group"), _tensors(args), skip=2)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            name_failure(e, entry)
            raise

    call._mmtrain_logged = True
    return call


def name_failure(e: Exception, entry: Call | None = None) -> None:
    """Name the collective `e` came from (default: the last one entered) on stderr and in e's notes."""
    entry = entry or (_log.recent[-1] if _log.recent else None)
    if entry is None or getattr(e, "_mmtrain_named", False):  # the innermost call names it (object ops nest)
        return
    e._mmtrain_named = True
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    line = f"rank {_rank()}: {entry} failed: {why}"
    print(f"mmtrain: {line}", file=sys.stderr, flush=True)
    e.add_note(line)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _group(group) -> str:
    if group is None or not dist.is_initialized():
        return "world"
    try:
        return f"{getattr(group, 'group_desc', '?')} {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):
        return repr(group)


def _tensors(args) -> tuple:
    """What _shape names later: the shapes now (a tensor's data may change, its shape is kept), as
    torch.Size tuples, and lists of tensors as (count, the first one's shape)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a.shape)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            out.append((len(a), a[0].shape))
    return tuple(out)


def _shape(shapes: tuple) -> str:
    """The shapes of the tensor arguments (lists of tensors: the first one's, times their count)."""
    out = [tuple(s) if isinstance(s, torch.Size) else f"{s[0]} x {tuple(s[1])}" for s in shapes]
    return ", ".join(map(str, out)) or "-"


def site(skip: int = 1, depth: int = 3) -> str:
    """The innermost `depth` frames of this repository that led here (file:line), innermost first,
    after torch's innermost one when torch made the call (FSDP2's hooks, autograd, DCP); `skip`
    frames above the caller's are left out."""
    frames, f = [], sys._getframe(skip)
    while f is not None and len(frames) < depth:
        torch_file, name = _where(f.f_code.co_filename)
        if name is not None and (not torch_file or not frames):
            frames.append(f"{name}:{f.f_lineno}")
        f = f.f_back
    return " < ".join(frames + _log.within[-1:]) or "?"


@functools.cache
def _where(filename: str) -> tuple[bool, str | None]:
    """(torch's file?, the name site() shows, None for other libraries): once per file, since every
    collective walks its stack (Path arithmetic per frame cost ~0.3 ms a call at depth 30)."""
    path = Path(filename)
    if path.is_relative_to(_TORCH):
        return True, f"torch/{path.relative_to(_TORCH)}"
    if path.is_relative_to(_ROOT) and "site-packages" not in path.parts:
        return False, str(path.relative_to(_ROOT))
    return False, None
