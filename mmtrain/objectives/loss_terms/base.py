"""The loss-term interface, the registry of terms, and what a micro-batch hands them.

A term is one class with `@register`: `name` (its config section `loss.<name>` when it has a
`Config`, and its field of the step's sums when it has `Sums`), `enabled(loss_cfg)`, and hooks the
objective calls in registration order (loss_terms/__init__.py's imports):

    before_forward(mb)        e.g. extra rows, an ssl mask, model kwargs (mb.inputs, mb.kwargs)
    row_count(mb) -> float    the divisor of a mean over whole rows (visual targets, documents,
                              masked patches), once every before_forward ran; the objective sums
                              them over the data-parallel ranks in one all-reduce -> mb.row_counts
    reweight(mb, losses)      the task losses to optimise (token weighting); default: unchanged
    loss(mb) -> Tensor|list   added to the micro-batch's loss (a list: one by one), in registration order
    report(cfg, total, ...)   class method, end of step: {'terms': ..., 'figures': ...} for StepStats

A term keeps what it needs between its hooks of one micro-batch in `mb.held[name]`: a pipeline
prepares all of a step's micro-batches before the first one's loss (loop/pipeline_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mmtrain.data_pipelines.batch import PackedBatch

if TYPE_CHECKING:
    from mmtrain.objectives.heads import Head
    from mmtrain.objectives.objective import Objective
    from mmtrain.objectives.terms import TaskLosses

TERMS: dict[str, type[Term]] = {}  # name -> class, in registration order


def register(cls: type[Term]) -> type[Term]:
    if cls.name in TERMS:
        raise ValueError(f"loss term {cls.name!r} registered twice")
    TERMS[cls.name] = cls
    return cls


@dataclass
class MicroBatch:
    """One micro-batch on its way through the terms' hooks."""

    batch: PackedBatch  # this rank's targets (under CP: its chunk's)
    inputs: dict  # the forward's inputs: a term may replace them (the contrast's extra rows)
    sums: Any  # the step's StepSums
    counts_T: torch.Tensor | None  # (tasks + 1,) float64 global trained tokens per task and in all
    kwargs: dict = field(default_factory=dict)  # extra forward keywords (ssl_mask_N, visual_next)
    labels_BS: torch.Tensor | None = None  # the labels of all rows of the forward (None: batch's)
    out: Any = None  # the ModelOutput, after the forward
    head: Head | None = None  # per-token CE / lse of any rows of the forward (heads.py)
    losses: TaskLosses | None = None  # the batch's own rows' task losses (unweighted)
    whole: PackedBatch | None = None  # under CP / TP: the whole rows `batch` is this rank's chunk of
    # a pipeline's row split (loop/pipeline_step.py): the batch whose rows `share_rows` these are; a
    # term's means are then over that batch (counts_T is its), not over these rows
    share_of: PackedBatch | None = None
    share_rows: range | None = None
    # the inputs of the forward one process runs where this one is a part of it or padded (a pipeline's
    # row part; its fixed row count): the MoE aux terms' and visual_next's divisors are that forward's
    ref: dict | None = None
    # what a term keeps between its hooks of this micro-batch, under its name (a pipeline prepares
    # every micro-batch of the step before the first loss)
    held: dict = field(default_factory=dict)
    # each term's `row_count` summed over the ranks holding distinct rows (a float64 tensor in a
    # distributed run): the divisor that makes its mean one process's over the global batch
    row_counts: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.batch.labels_BS.shape[0]


def at_least_one(n):
    """A divisor of 0 (nothing to average) as 1: the sum it divides is 0 too (a tensor stays one)."""
    return n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)


@dataclass
class Reported:
    terms: dict[str, float | None] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)


class Term:
    name: ClassVar[str]
    Config: ClassVar[type | None] = None  # its section loss.<name>; None: no section
    Sums: ClassVar[Callable[[], Any] | None] = None  # its field of StepSums (a factory); None: none

    def __init__(self, obj: Objective):
        self.obj = obj
        self.cfg = getattr(obj.cfg.loss, self.name, None)

    @classmethod
    def enabled(cls, loss_cfg) -> bool:
        return bool(getattr(loss_cfg, cls.name).weight)

    def before_forward(self, mb: MicroBatch) -> None:
        pass

    def row_count(self, mb: MicroBatch) -> float | None:
        return None

    def reweight(self, mb: MicroBatch, losses: TaskLosses) -> TaskLosses:
        return losses

    def loss(self, mb: MicroBatch) -> torch.Tensor | list[torch.Tensor] | None:
        return None

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        """End of step, every registered term (on or off): its entries of StepStats.terms / figures.
        `total`: the all-reduced StepSums (floats)."""
