"""The step's batch copy: pinned and non-blocking when (and only when) the device is CUDA. On CPU the
CUDA side is faked: pin_memory and to are recorded, not run."""

from __future__ import annotations

import pytest
import torch

from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.loop import host_copy


@pytest.mark.parametrize("device, pinned", [("cuda:1", True), ("cpu", False), ("meta", False)])
def test_pins_and_copies_asynchronously_only_on_cuda(monkeypatch, device, pinned):
    calls = []
    monkeypatch.setattr(PackedBatch, "pin_memory", lambda self: calls.append(("pin",)) or self)
    monkeypatch.setattr(PackedBatch, "to", lambda self, dev, non_blocking=False:
                        calls.append(("to", torch.device(dev), non_blocking)) or self)
    batch = object.__new__(PackedBatch)
    assert host_copy.batch_to_device(batch, torch.device(device)) is batch
    want = [("to", torch.device(device), pinned)]
    assert calls == ([("pin",)] if pinned else []) + want  # pinned before the copy, never after

