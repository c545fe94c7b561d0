"""How many CPU cores the loader needs per GPU at a step time, by arithmetic from a measured rate.

cores a GPU = core-seconds the loader spends on one batch x batches a step / step seconds.

The core-seconds come from the config's own train loader run here, in this process at 0 workers
(process CPU time: all of its work on this machine's cores, no worker hand-off), after a warm-up
batch (the shuffle buffers fill first). Workers add their hand-off on top (docs/BENCHMARKS.md,
"Loader headspace"); a faster or slower core than this machine's scales the figure. No local
shards (a cluster path planned from a laptop): the figure is unknown, and the plan says why.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer


def core_seconds_per_batch(data: DataConfig, batches: int = 3, warmup: int = 1) -> float:
    """CPU seconds of this process per train batch of `data`, read at 0 workers."""
    tok = load_tokenizer(data.tokenizer)
    # a short shuffle buffer: filling it is a one-time cost, and a batch costs the same after it
    it = iter(build_loader(replace(data, num_workers=0, shuffle_buffer=min(data.shuffle_buffer, 32)), tok,
                           "train"))
    for _ in range(warmup):
        next(it)
    c0 = time.process_time()
    for _ in range(batches):
        next(it)
    return (time.process_time() - c0) / batches


def cores_per_gpu(core_s_per_batch: float, batches_per_step: int, step_s: float) -> float:
    return core_s_per_batch * batches_per_step / step_s


def loader_need(cfg, step_s: float, batches: int = 3) -> dict:
    """The plan's `loader` entry for a RunConfig at a step time (a rank's step: one GPU's)."""
    try:
        core_s = core_seconds_per_batch(cfg.data, batches)
    except (DataError, OSError) as e:
        return {"unknown": f"{e}".splitlines()[0], "step_s": step_s}
    accum = cfg.train.grad_accum
    return {"core_s_per_batch": core_s, "batches_per_step": accum, "step_s": step_s, "batches": batches,
            "cores": cores_per_gpu(core_s, accum, step_s)}


def text(need: dict) -> list[str]:
    if not need:
        return []
    if "unknown" in need:
        return [f"loader: cores a GPU unknown here (its rate is measured on data.train's shards: "
                f"{need['unknown']})"]
    return [f"loader: the loader needs ~{need['cores']:.1f} cores a GPU at this step time "
            f"({need['core_s_per_batch']:.3f} core-s a batch of data.train, measured here at 0 workers over "
            f"{need['batches']} batches; {need['batches_per_step']} batch(es) a step of "
            f"{need['step_s']:.3f} s)"]
