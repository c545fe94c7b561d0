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

from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.evaluation.evaluate import Autocast, EvalResult, evaluate
from mmtrain.parallel.distributed import DistEnv, all_reduce


def evaluate_ranks(model: nn.Module, batches: list[PackedBatch], device: torch.device, env: DistEnv,
                   pad: Callable[[], PackedBatch],
                   autocast: Autocast = contextlib.nullcontext, evaluates: bool = True) -> EvalResult:
    """`evaluate` over every rank's batches; in one process exactly `evaluate`. A rank that does not
    evaluate (`evaluates` False: a pipeline's later ranks, whose first rank evaluates their shared
    batches) adds nothing but joins the collectives."""
    if not env.distributed:
        return evaluate(model, batches, device, autocast)
    batches = pad_to_most(batches, env, device, pad)
    local = evaluate(model, batches if evaluates else [], device, autocast)
    return reduce_result(local, env, device)


def pad_to_most(batches: list[PackedBatch], env: DistEnv, device: torch.device,
                pad: Callable[[], PackedBatch]) -> list[PackedBatch]:
    """`batches` plus `pad()` batches up to the largest count on any rank (collective forwards)."""
    most = int(all_reduce(torch.tensor([len(batches)], device=device), env, op="max").item())
    return batches + [pad() for _ in range(most - len(batches))]


def reduce_result(local: EvalResult, env: DistEnv, device: torch.device) -> EvalResult:
    """Sum the per-task sums (evaluate.SUMS: losses, correct, tokens; blanked and mismatch losses and
    tokens) over ranks and re-form the means."""
    return EvalResult.from_sums(all_reduce(local.sums_TC().to(device), env).cpu())
