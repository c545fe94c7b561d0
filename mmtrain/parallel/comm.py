"""What the expert- and context-parallel layers share: an uneven all-to-all that autograd runs
backwards (the reverse exchange), and the per-step count of the bytes each kind of collective
sends to other ranks (a callback: TensorBoard `comm/<kind>_MiB`).

Legend: N rows exchanged, P ranks of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmtrain.callbacks import Callback
from mmtrain.parallel import calls

Tensor = torch.Tensor


class Traffic(Callback):
    """Bytes this rank sent to other ranks by collective kind (forward, recompute and backward),
    per optimizer step: `last` holds the finished step's, TensorBoard gets `comm/<kind>_MiB`."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.last: dict[str, int] = {}

    def add(self, kind: str, nbytes: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + nbytes

    def on_step_end(self, trainer, stats) -> None:
        self.last, self.sent = self.sent, {}

    def on_log(self, trainer, stats, scalars: dict) -> None:
        scalars.update({f"comm/{kind}_MiB": n / 2**20 for kind, n in self.last.items()})


class AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single whose backward is the reverse exchange; both count their bytes."""

    @staticmethod
    def forward(ctx, x_ND, out_P, in_P, group, count):
        ctx.splits, ctx.group, ctx.count = (out_P, in_P), group, count
        ctx.site = calls.site(1, depth=4)  # a timeout in backward names the forward's callers
        return all_to_all(x_ND, out_P, in_P, group, count)

    @staticmethod
    def backward(ctx, dy_ND):
        out_P, in_P = ctx.splits
        with calls.within(f"backward of {ctx.site}"):
            return all_to_all(dy_ND, in_P, out_P, ctx.group, ctx.count), None, None, None, None


def all_to_all(x_ND: Tensor, out_P: list[int], in_P: list[int], group, count) -> Tensor:
    """in_P[p] rows to rank p, out_P[p] rows from it."""
    count(x_ND, in_P)
    out_ND = x_ND.new_empty(sum(out_P), *x_ND.shape[1:])
    all_to_all_single(out_ND, x_ND.contiguous(), out_P, in_P, group)
    return out_ND


def all_to_all_single(out: Tensor, x: Tensor, out_P: list[int] | None, in_P: list[int] | None, group) -> None:
    """dist.all_to_all_single that honours the process group's timeout on gloo: its all-to-all was
    seen waiting past it for a peer that never joined (torch 2.13: a skipped EP dispatch on 4 ranks,
    still waiting after 10 min in a wait with no deadline), where its other collectives time out.
    Any other backend enqueues it and returns: on NCCL a host wait would block the CPU until the GPU
    finished (~342 times a micro-batch at m3), and NCCL's watchdog bounds the collective itself."""
    if dist.get_backend(group) != "gloo":
        dist.all_to_all_single(out, x, out_P, in_P, group=group)
        return
    work = dist.all_to_all_single(out, x, out_P, in_P, group=group, async_op=True)
    try:
        if not work.wait(calls.timeout()):
            raise RuntimeError(f"Timed out waiting {calls.timeout()} (a peer never joined)")
    except RuntimeError as e:
        calls.name_failure(e)  # the all-to-all just entered
        raise
