"""The step's host-to-device copy of a packed batch.

On CUDA the batch is pinned first, then copied with non_blocking=True: from pageable memory a
"non-blocking" copy is staged through a pinned buffer synchronously, so the host would wait for
every tensor. The pinned source may be freed right after: the caching host allocator records the
copy's stream and reuses the block only once the copy has finished. Elsewhere (CPU, MPS) a plain
copy: pinning needs CUDA, and there is nothing to overlap.
"""

from __future__ import annotations

import torch

from mmtrain.data_pipelines.batch import PackedBatch


def pins(device: torch.device) -> bool:
    return device.type == "cuda"


def batch_to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    if not pins(device):
        return batch.to(device)  # the reference path
    return batch.pin_memory().to(device, non_blocking=True)
