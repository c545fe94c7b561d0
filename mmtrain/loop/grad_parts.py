"""Per-part gradient norms and update ratios, measured on log steps only (issue 26: when does a
text-heavy run start reading the pixels?).

The parts are `mmtrain.optim.param_part`'s: "vision" (the ViT), "projector" (vision -> decoder) and
"decoder". On a log step the trainer calls `measure_grads` after accumulation and the expert-gradient
scale, before clipping (the three squares sum to the global pre-clip norm's square), and wraps the
optimizer step in `measure_update` (one copy of this rank's parameter shards, freed after the step):

    grad_norm/<part>     ||g_part||
    update_ratio/<part>  ||theta_after - theta_before|| / ||theta_before||   (not on skipped steps)

Norms are over full tensors (`parallel.parallelize.global_norm`: per mesh, summed over shards and
ranks), so FSDP2 / HSDP / expert-parallel runs log what one process would. Other steps cost nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mmtrain.optim import param_part
from mmtrain.parallel.parallelize import global_norm

PARTS = ("vision", "projector", "decoder")


def part_params(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trained parameters of each part (read afresh: FSDP and resume may swap the objects)."""
    out: dict[str, list[nn.Parameter]] = {part: [] for part in PARTS}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[param_part(name)].append(p)
    return out


class GradParts:
    """Holds a log step's `grad_norm/*` and `update_ratio/*` until the trainer logs them (`pop`)."""

    def __init__(self, model: nn.Module, norm=None):
        self.model = model
        self.norm = norm or global_norm  # dist.pp > 1: a stage's norm summed over the pipeline
        self.scalars: dict[str, float] = {}

    def measure_grads(self) -> None:
        """Each part's gradient norm (collective under FSDP: called on every rank at the same steps)."""
        for part, params in part_params(self.model).items():
            grads = [p.grad for p in params if p.grad is not None]
            self.scalars[f"grad_norm/{part}"] = float(self.norm(grads))

    @contextlib.contextmanager
    def measure_update(self, due: bool):
        """Around the optimizer step: each part's update ratio when `due`, else nothing at all."""
        if not due:
            yield
            return
        parts = part_params(self.model)
        before = {part: [p.detach().clone() for p in params] for part, params in parts.items()}
        norm_before = {part: self.norm(b) for part, b in before.items()}
        yield
        for part, params in parts.items():
            for b, p in zip(before[part], params):
                b.sub_(p.detach())  # -(the update)
            ratio = self.norm(before[part]) / norm_before[part].clamp_min(torch.finfo(torch.float32).tiny)
            self.scalars[f"update_ratio/{part}"] = float(ratio)

    def pop(self) -> dict[str, float]:
        """This step's scalars (empty on other steps), cleared for the next."""
        out, self.scalars = self.scalars, {}
        return out
