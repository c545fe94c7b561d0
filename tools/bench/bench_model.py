"""Train-step throughput of a model size on random packed batches, and MFU against the matmul
peak measured in the same run.

    python -m tools.bench.bench_model --config configs/tiny.yaml              # CPU, fp32
    python -m tools.bench.bench_model --config configs/small.yaml --device cuda --dtype bf16 \
        --batch 4 --seq-len 4096 --compile
    python -m tools.bench.bench_model --config configs/base.yaml --count-only # parameters only

The model section of the run config is used; the data section is not (batches are random).

A step = forward + cross-entropy + MoE aux losses + backward + AdamW + MoE bias update. MFU =
model FLOPs per token (models.counting: 6 x active matmul params + attention at the keys each
layer attended on the batch + the vision tower for the visual share) x tokens/s / measured peak.
The peak is a large square matmul in the same dtype, so MFU here is "fraction of achievable
matmul rate".
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mmtrain.config import load_config
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.parallel.parallelize import block_lists
from mmtrain.run_config import RunConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, iters: int = 5) -> float:
    """Achievable FLOP/s of an n x n x n matmul (best of iters)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(iters + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def random_batch(cfg, batch: int, seq_len: int, visual_share: float, frame_hw: int) -> dict:
    """Rows of documents -- text + one image (every third a 4-frame video) -- until ~full."""
    V, P, m = cfg.decoder.vocab_size, cfg.vision.patch_dim, cfg.vision.merge
    rows = []
    for _ in range(batch):
        docs, used = [], 0
        while True:
            kind = VIDEO if len(docs) % 3 == 2 else IMAGE
            grid = (2 if kind == VIDEO else 1, frame_hw, frame_hw)
            n_vis = grid[0] * frame_hw * frame_hw // m ** 2 if visual_share > 0 else 0
            n_text = max(int(n_vis * (1 - visual_share) / visual_share), 4) if n_vis else 256
            media = ((kind, grid),) if n_vis else ()
            need = n_text + (n_vis + max(n_text // 2, 1) if n_vis else 0)
            if used + need > seq_len:
                break
            docs.append(random_doc(V, P, n_text, media))
            used += need
        rows.append(docs)
    return pack(rows, seq_len, P, merge=m)


def train_step(model: MultimodalModel, opt: torch.optim.Optimizer, inputs: dict,
               dtype: torch.dtype) -> torch.Tensor:
    """One step (forward, CE + MoE aux, backward, AdamW, MoE bias update) -> its loss, detached."""
    dev = inputs["tokens_BS"].device
    with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(**inputs)
        labels_BS = inputs["tokens_BS"].roll(-1, dims=1)
        loss = F.cross_entropy(out.logits_BSV.flatten(0, 1).float(), labels_BS.flatten())
        loss = loss + sum(out.aux_losses.values())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.update_moe_bias()
    return loss.detach()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml", help="run config whose model section is used")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary size (the tokenizer's, in a run)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--visual-share", type=float, default=0.25, help="visual tokens / tokens (approx.)")
    ap.add_argument("--frame", type=int, default=8, help="patch grid side of each image / video frame")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--backend", default=None, help="override attention backend (auto, dense, gather, flex)")
    ap.add_argument("--peak-n", type=int, default=None, help="matmul size for the peak (2048 CPU, 8192 CUDA)")
    ap.add_argument("--compile", action="store_true", help="compile every block (inductor), as dist.compile")
    ap.add_argument("--count-only", action="store_true")
    args = ap.parse_args(argv)

    cfg = load_config(RunConfig, args.config).model
    if args.backend:
        cfg.decoder.attention.backend = args.backend
    cfg.decoder.vocab_size = args.vocab
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.count_only:
        with torch.device("meta"):
            model = MultimodalModel(cfg)
        print(f"{args.config}: {model.num_params()}, vocab {cfg.decoder.vocab_size}")
        return

    torch.manual_seed(0)
    model = MultimodalModel(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    eager = model
    if args.compile:  # as mmtrain/parallel/parallelize.py applies dist.compile: every vision block and layer
        import copy

        eager = copy.deepcopy(model)  # the FLOP count's forward (attention statistics) runs eagerly
        for blocks in block_lists(model):
            for i, block in enumerate(blocks):
                blocks[i] = torch.compile(block)
    batches = [{k: v.to(device) for k, v in random_batch(cfg, args.batch, args.seq_len, args.visual_share,
                                                           args.frame).items()} for _ in range(2)]
    for i in range(args.warmup):
        train_step(model, opt, batches[i % 2], dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        train_step(model, opt, batches[i % 2], dtype)
        _sync(device)
        times.append(time.perf_counter() - t0)
    step_s = min(times)  # best step: robust to other load on a shared host; the median is printed too
    median_s = sorted(times)[len(times) // 2]

    tokens = args.batch * args.seq_len
    b = batches[0]
    vis_frac = float((b["modality_BS"] != 0).float().mean())
    ppm = b["patches_NP"].shape[0] / max(b["grid_thw_M3"].shape[0], 1)
    with torch.no_grad():  # the keys each layer really attends on this batch (documents, sparsity)
        stats = eager(**b, attn_stats=True, compute_logits=False).attn_stats
    keys = {i: float(st["keys"] / st["tokens"]) for i, st in stats.items()}
    flops_tok = model.flops_per_token(args.seq_len, vis_frac, int(ppm), keys)
    peak = matmul_peak(device, dtype, args.peak_n or (8192 if device.type == "cuda" else 2048))
    tps = tokens / step_s
    print(f"# {args.config}: {model.num_params()}")
    print(f"# {args.device} {args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"batch {args.batch} x seq {args.seq_len}, visual {vis_frac:.0%}, {ppm:.0f} patches/medium, "
          f"keys/token by layer {', '.join(f'{k:.0f}' for k in keys.values())}")
    print(f"step best {step_s * 1e3:.1f} ms (median {median_s * 1e3:.1f}), {tps:,.0f} tokens/s, "
          f"{flops_tok / 1e9:.4f} GFLOP/token, "
          f"model {flops_tok * tps / 1e12:.3f} TFLOP/s, matmul peak {peak / 1e12:.3f} TFLOP/s, "
          f"MFU {flops_tok * tps / peak:.1%}{_peak_memory(device)}" + (", compiled" if args.compile else ""))


def _peak_memory(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"


if __name__ == "__main__":
    main()
