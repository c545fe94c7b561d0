"""Forwards that leave training state as they found them (collapse diagnostics, token weighting's
blank pass): `frozen_state` puts the model in eval mode (MoE layers count no load, no dropout) and
saves the CPU/CUDA RNG, restoring both after."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def frozen_state(model: nn.Module, device: torch.device):
    modes = [(m, m.training) for m in model.modules()]
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):  # saves and restores the CPU and these CUDA generators
        model.eval()
        try:
            yield
        finally:
            for module, mode in modes:
                module.training = mode
