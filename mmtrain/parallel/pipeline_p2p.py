"""The pipeline schedule's sends and receives, seen and bounded like the collectives (calls.py).

torch's schedules post a step's point-to-point batches through `schedules._batch_p2p` and wait for
them in `schedules._wait_batch_p2p`, not through torch.distributed's collective functions: calls.py
does not see them, and on gloo a receive whose peer never sends waits with no deadline (torch 2.13:
a stage that skipped a send left its peer waiting until the fault handler's dump). Inside `named(group)`
on gloo each batch is a numbered call (`p2p <what>` on the pipeline group: each op, its shape and
peer), and its wait is bounded by the process group's timeout; one that runs out names the batch on
stderr as a collective's would. Other backends are left alone: a bounded wait would block the host
on every NCCL send and receive (there torch's flight recorder is the tool, calls.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch.distributed as dist
from torch.distributed.pipelining import schedules

from mmtrain.parallel import calls

_posted: dict[int, calls.Call] = {}  # id(a posted op's Work) -> its batch, until waited for


@contextlib.contextmanager
def named(group):
    """Within: the schedule's point-to-point batches on `group` logged, their waits bounded (gloo)."""
    torch_has = all(hasattr(schedules, f) for f in ("_batch_p2p", "_wait_batch_p2p"))  # private: may go
    if dist.get_backend(group) != "gloo" or not torch_has:
        yield
        return
    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    schedules._batch_p2p, schedules._wait_batch_p2p = functools.partial(_post, post), _wait
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = post, wait
        _posted.clear()


def _post(post, p2p_ops: list, desc: str | None = None) -> list:
    ops = ", ".join(f"{getattr(op.op, '__name__', '?')} {tuple(op.tensor.shape)} peer {op.peer}"
                    for op in p2p_ops)
    entry = calls.enter(f"p2p {desc or 'batch'}", p2p_ops[0].group if p2p_ops else None, ops or "-", skip=2)
    works = post(p2p_ops, desc=desc)
    for work in works:
        _posted[id(work)] = entry
    return works


def _wait(works: list) -> None:
    for work in works:
        entry = _posted.pop(id(work), None)
        try:
            if not work.wait(calls.timeout()):
                raise RuntimeError(f"Timed out waiting {calls.timeout()} (the peer stage never came)")
        except RuntimeError as e:
            calls.name_failure(e, entry)
            raise
