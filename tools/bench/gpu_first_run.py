"""A first GPU run of `small`, before any real one: N train steps in bf16 with every block compiled and
flex attention on sparse and full layers, held to an fp32 eager reference (dense attention, the
reference path) on the same batches from the same weights; with the recompile count, peak memory,
tokens/s and MFU.

    python -m tools.bench.gpu_first_run --device cuda          # configs/small.yaml, ~2-3 min on an H200
    python -m tools.bench.gpu_first_run --dry-run              # CPU plumbing: tiny, fp32 vs fp32

Verdict (last line, exit 1 on FAIL):
  * loss: |loss - loss_ref| / loss_ref <= --tol at every step. The default 0.03 is an estimate, not a
    measurement: bf16 autocast (fp32 weights and AdamW) drifts from fp32 by rounding, ~1e-2 relative
    per 12-layer step at init, and the drift compounds over the steps; a wrong kernel is off by far more.
  * recompiles: graphs dynamo builds after the warmup steps (counters["stats"]["unique_graphs"]);
    0 expected: every later step has the shapes of a warmup one.
The timed steps are the candidate's after warmup; MFU as tools/bench/bench_model.py computes it.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch
from torch._dynamo.utils import counters

from mmtrain.config import load_config
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.parallel.parallelize import block_lists
from mmtrain.run_config import RunConfig
from tools.bench.bench_model import DTYPES, _sync, matmul_peak, random_batch, train_step


def step_loss(model: MultimodalModel, opt: torch.optim.Optimizer, inputs: dict, dtype: torch.dtype) -> float:
    """One train step (bench_model's) -> its loss."""
    return float(train_step(model, opt, inputs, dtype))


def with_backend(model: MultimodalModel, backend: str) -> MultimodalModel:
    """A deep copy whose decoder attention runs `backend` on every layer (sparse and full)."""
    twin = copy.deepcopy(model)
    twin.cfg.decoder.attention.backend = backend
    twin.decoder.cfg.attention.backend = backend  # what forward reads (the same object, normally)
    return twin


def compile_blocks(model: MultimodalModel, backend: str) -> None:
    """As mmtrain/parallel/parallelize.py applies dist.compile: every vision block and decoder layer."""
    for blocks in block_lists(model):
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend=backend)


def run(model, batches, steps: int, dtype: torch.dtype, device: torch.device, warmup: int = 0):
    """-> (losses of every step, seconds of each step after `warmup`, graphs built after warmup)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    losses, times, graphs0 = [], [], 0
    for i in range(steps):
        if i == warmup:
            graphs0 = counters["stats"]["unique_graphs"]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step_loss(model, opt, batches[i % len(batches)], dtype))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return losses, times, counters["stats"]["unique_graphs"] - graphs0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--backend", default="flex", help="the candidate's attention backend, every layer")
    ap.add_argument("--ref-backend", default="dense", help="the fp32 reference's (the reference path)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="candidate steps left out of timing and recompiles")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tol", type=float, default=0.03, help="relative loss tolerance per step")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-backend", default="inductor", help="eager: dynamo's graphs without codegen")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU plumbing: tiny, fp32, gather, dynamo with the eager backend, 3 steps")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.config, args.device, args.dtype, args.backend = "configs/tiny.yaml", "cpu", "fp32", "gather"
        args.steps, args.warmup, args.batch, args.seq_len = 3, 1, 2, 256
        args.vocab, args.compile_backend = 512, "eager"  # the recompile count's plumbing, no codegen
    return args


def verdict(losses, ref, graphs: int, tol: float) -> list[str]:
    """What failed (empty: PASS)."""
    bad = []
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    if not all(math.isfinite(x) for x in losses + ref):
        bad.append("non-finite loss")
    elif max(rel) > tol:
        bad.append(f"loss off the fp32 reference by {max(rel):.2e} > {tol:g} at step {rel.index(max(rel))}")
    if graphs:
        bad.append(f"{graphs} graphs built after warmup (recompiles)")
    return bad


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = load_config(RunConfig, args.config).model
    cfg.decoder.vocab_size = args.vocab
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    base = MultimodalModel(cfg).to(device).train()
    batches = [{k: v.to(device) for k, v in random_batch(cfg, args.batch, args.seq_len, 0.25, 8).items()}
               for _ in range(2)]
    ref = with_backend(base, args.ref_backend)
    ref_losses, _, _ = run(ref, batches, args.steps, torch.float32, device)
    keys = attended_keys(ref, batches[0])
    del ref
    model = with_backend(base, args.backend)
    del base
    if not args.no_compile:
        compile_blocks(model, args.compile_backend)
    losses, times, graphs = run(model, batches, args.steps, dtype, device, args.warmup)
    report(args, model, batches[0], keys, losses, ref_losses, times, graphs, device, dtype)
    bad = verdict(losses, ref_losses, graphs, args.tol)
    print("FIRST RUN: " + ("PASS" if not bad else "FAIL (" + "; ".join(bad) + ")"))
    return 1 if bad else 0


def attended_keys(model: MultimodalModel, b: dict) -> dict[int, float]:
    """Keys per token each layer really attends on this batch (documents, sparsity): MFU's attention
    FLOPs. Counted on the eager reference, so the compiled candidate sees no extra graph."""
    with torch.no_grad():
        stats = model(**b, attn_stats=True, compute_logits=False).attn_stats
    return {i: float(st["keys"] / st["tokens"]) for i, st in stats.items()}


def report(args, model, b, keys, losses, ref, times, graphs, device, dtype) -> None:
    step_s = min(times)
    tps = args.batch * args.seq_len / step_s
    vis = float((b["modality_BS"] != 0).float().mean())
    ppm = b["patches_NP"].shape[0] / max(b["grid_thw_M3"].shape[0], 1)
    flops_tok = model.flops_per_token(args.seq_len, vis, int(ppm), keys)
    peak = matmul_peak(device, dtype, 8192 if device.type == "cuda" else 1024)
    cuda = device.type == "cuda"
    mem = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if cuda else "n/a (CPU)"
    how = "eager" if args.no_compile else f"compiled ({args.compile_backend})"
    print(f"# {args.config} on {args.device}, {args.dtype} {args.backend} {how} "
          f"vs fp32 eager {args.ref_backend}, torch {torch.__version__}")
    print("step | loss | fp32 ref | rel diff")
    for i, (a, r) in enumerate(zip(losses, ref)):
        print(f"{i} | {a:.5f} | {r:.5f} | {abs(a - r) / abs(r):.2e}")
    print(f"recompiles after warmup: {graphs} (graphs in all: {counters['stats']['unique_graphs']})")
    print(f"tokens/s {tps:,.0f} (best of {len(times)} steps, {step_s * 1e3:.1f} ms), MFU "
          f"{flops_tok * tps / peak:.1%} of a measured {peak / 1e12:.1f} TFLOP/s matmul, peak memory {mem}")


if __name__ == "__main__":
    sys.exit(main())
