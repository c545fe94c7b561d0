"""Throughput, MFU and memory.

MFU = achieved model FLOP/s per device / peak FLOP/s per device. Achieved FLOPs come from the
model's own counter (`MultimodalModel.flops_per_token`: 6 x active matmul parameters plus
attention -- with the keys per token each layer really attended on the latest measured batch
(`attn_keys`) -- plus the vision tower for the visual share of tokens) times the tokens trained;
the peak is `train.peak_tflops`, or for known GPUs their dense bf16 peak.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), SXM parts; matched on the device name.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """Per-device peak: the config value, else the table above for a known GPU, else None."""
    if configured:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory of this process, or its peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


@dataclass
class Window:
    """Global (all-rank) token counts and wall time over some steps."""

    tokens: float = 0.0
    visual_tokens: float = 0.0
    media: float = 0.0
    patches: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, visual: float, media: float, patches: float, seconds: float) -> None:
        self.tokens += tokens
        self.visual_tokens += visual
        self.media += media
        self.patches += patches
        self.seconds += seconds
        self.steps += 1

    def tokens_per_s_per_device(self, world_size: int) -> float:
        return self.tokens / world_size / max(self.seconds, 1e-9)

    def mfu(self, model, seq_len: int, world_size: int, peak: float | None,
            attn_keys: dict[int, float] | None = None) -> float | None:
        if not peak or not self.tokens:
            return None
        visual_fraction = self.visual_tokens / self.tokens
        patches_per_medium = self.patches / self.media if self.media else 256
        flops = model.flops_per_token(seq_len, visual_fraction, int(max(1, patches_per_medium)), attn_keys)
        return flops * self.tokens_per_s_per_device(world_size) / (peak * 1e12)
