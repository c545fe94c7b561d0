"""Evaluation across ranks: each rank evaluates its disjoint share of the val split, the sums are
all-reduced. Ranks may hold different numbers of val batches; under FSDP every forward is
collective, so the ranks first agree on the largest count and the shorter ones pad with dummy
batches (one row of padding: no trained token, no medium) that add nothing to any sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from mmtrain.data_pipelines.batch import MEDIA_TASKS, TASK_NAMES, PackedBatch
from mmtrain.evaluation.evaluate import EvalResult, evaluate
from mmtrain.parallel.distributed import DistEnv, all_reduce


def evaluate_ranks(model: nn.Module, batches: list[PackedBatch], device: torch.device, env: DistEnv,
                   pad: Callable[[], PackedBatch],
                   autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   ) -> EvalResult:
    """`evaluate` over every rank's batches; in one process exactly `evaluate`."""
    if not env.distributed:
        return evaluate(model, batches, device, autocast)
    local = evaluate(model, pad_to_most(batches, env, device, pad), device, autocast)
    return reduce_result(local, env, device)


def pad_to_most(batches: list[PackedBatch], env: DistEnv, device: torch.device,
                pad: Callable[[], PackedBatch]) -> list[PackedBatch]:
    """`batches` plus `pad()` batches up to the largest count on any rank (collective forwards)."""
    most = int(all_reduce(torch.tensor([len(batches)], device=device), env, op="max").item())
    return batches + [pad() for _ in range(most - len(batches))]


def reduce_result(local: EvalResult, env: DistEnv, device: torch.device) -> EvalResult:
    """Sum per-task (loss, correct, tokens, blank loss) over ranks and re-form the means."""
    rows = []
    for task in TASK_NAMES:
        n = local.tokens.get(task, 0)
        rows.append([local.loss.get(task, 0.0) * n, local.accuracy.get(task, 0.0) * n, float(n),
                     local.blank_loss.get(task, 0.0) * n])
    totals = all_reduce(torch.tensor(rows, dtype=torch.float64, device=device), env).tolist()
    out = EvalResult()
    for task, (loss_sum, correct, n, blank_sum) in zip(TASK_NAMES, totals):
        if n == 0:
            continue
        out.tokens[task] = int(n)
        out.loss[task] = loss_sum / n
        out.accuracy[task] = correct / n
        if task in MEDIA_TASKS:
            out.blank_loss[task] = blank_sum / n
    return out
