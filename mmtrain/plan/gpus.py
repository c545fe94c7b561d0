"""GPU specs for `mmtrain plan` (vendor datasheets; dense bf16, no sparsity). The memory verdict
keeps `MARGIN_GIB` aside for what the fake trace does not see: the CUDA context and kernels
(~0.5-1 GiB), NCCL's buffers (~1-2 GiB at 8-way groups), and the caching allocator's
fragmentation."""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.errors import UserError

MARGIN_GIB = 6.0


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # HBM
    bf16_tflops: float  # dense peak
    hbm_tbps: float  # HBM bandwidth, TB/s
    intra_gbps: float  # per-GPU bandwidth inside a node (NVLink), GB/s one direction
    inter_gbps: float  # per-GPU bandwidth across nodes (one NIC per GPU), GB/s one direction
    per_node: int = 8

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - MARGIN_GIB) * 2**30


GPUS = {g.name: g for g in (
    GPU("a100", 80.0, 312.0, 2.04, 300.0, 25.0),
    GPU("h100", 80.0, 989.4, 3.35, 450.0, 50.0),
    GPU("h200", 141.0, 989.4, 4.8, 450.0, 50.0),
    GPU("b200", 180.0, 2250.0, 8.0, 900.0, 50.0),
    GPU("mi300x", 192.0, 1307.4, 5.3, 448.0, 50.0),
)}


def gpu(name: str) -> GPU:
    if name.lower() not in GPUS:
        raise UserError(f"--gpu: unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[name.lower()]
