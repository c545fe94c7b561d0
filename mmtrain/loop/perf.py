"""Throughput, MFU and memory, and the `Throughput` callback that logs them.

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
from typing import TYPE_CHECKING

import torch

from mmtrain.callbacks import Callback, StepStats
from mmtrain.parallel.distributed import all_reduce

if TYPE_CHECKING:
    from mmtrain.loop.trainer import Trainer

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


PERF_WARMUP_STEPS = 3  # steps of each launch left out of the run's throughput (allocation, compile)


class Throughput(Callback):
    """Tokens/s, MFU, peak memory, data-wait share and attention sparsity: per log window in
    TensorBoard (`perf/*`, `attn/*`), per run in the summary. Not checkpointed: throughput is a
    property of one launch (whose first PERF_WARMUP_STEPS steps the run's figures leave out)."""

    name = "throughput"

    def __init__(self, peak: float | None):
        self.peak = peak  # per-device TFLOP/s, None: no MFU
        self.window, self.run = Window(), Window()
        self.wait_s = self.step_s = 0.0  # since this process started
        self.steps = 0

    def on_step_end(self, trainer: Trainer, s: StepStats) -> None:
        self.wait_s += s.data_wait_s
        self.step_s += s.step_s
        self.steps += 1
        self.window.add(s.tokens, s.visual_tokens, s.media, s.patches, s.step_s)
        if self.steps > PERF_WARMUP_STEPS:
            self.run.add(s.tokens, s.visual_tokens, s.media, s.patches, s.step_s)

    def on_log(self, trainer: Trainer, s: StepStats, scalars: dict[str, float]) -> None:
        scalars.update(self.scalars(trainer, s))
        self.window = Window()

    def scalars(self, trainer: Trainer, s: StepStats) -> dict[str, float]:
        world = trainer.env.world_size
        out = {"perf/data_wait_frac": s.wait_fraction(),
               "perf/tokens_per_s": s.tokens_per_s_per_device(world) * world,
               "perf/tokens_per_s_per_device": self.window.tokens_per_s_per_device(world),
               "perf/peak_mem_gib": global_peak_memory(trainer)}
        for i, a in trainer.objective.attn_stats.items():
            out[f"attn/keys_per_token_L{i}"] = a["keys_per_token"]
            if a["sparse"]:
                out[f"attn/kept_block_frac_L{i}"] = a["kept_frac"]
        mfu = self.mfu(trainer, self.window)
        if mfu is not None:
            out["perf/mfu"] = mfu
        return out

    def mfu(self, trainer: Trainer, window: Window) -> float | None:
        attn = trainer.objective.attn_stats  # measured attention FLOPs
        keys = {i: a["keys_per_token"] for i, a in attn.items()}
        world = trainer.env.world_size
        return window.mfu(trainer.raw_model, trainer.cfg.data.seq_len, world, self.peak, keys)

    def on_train_end(self, trainer: Trainer, summary: dict) -> None:
        perf = self.run if self.run.steps else self.window
        summary.update({
            "data_wait_fraction": self.wait_s / max(self.step_s, 1e-9),
            "tokens_per_s_per_device": perf.tokens_per_s_per_device(trainer.env.world_size),
            "mfu": self.mfu(trainer, perf), "peak_mem_gib": global_peak_memory(trainer),
            "attention": {str(i): a for i, a in trainer.objective.attn_stats.items()},
        })


def global_peak_memory(trainer: Trainer) -> float:
    """GiB, the largest over ranks (a collective: called at the same steps on every rank)."""
    mem = torch.tensor([peak_memory_gib(trainer.device)], dtype=torch.float64, device=trainer.device)
    return float(all_reduce(mem, trainer.env, op="max").item())
