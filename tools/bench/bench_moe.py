"""MoE layer forward+backward: the fast dispatch paths against the per-expert loop, same run.

    python -m tools.bench.bench_moe                       # CPU, fp32
    python -m tools.bench.bench_moe --device cuda --dtype bf16 --tokens 16384 --dim 1024

Prints best-of-N ms per forward+backward for each path and experts count, and the speedup over
the loop.
The router, shared expert and losses run in every path; only the expert dispatch differs.
"""

from __future__ import annotations

import argparse
import time

import torch

from mmtrain.models.moe import MoE, MoEConfig
from mmtrain.models.moe.grouped_mm import grouped_mm_supported

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(moe: MoE, x_BSD: torch.Tensor, iters: int, warmup: int = 2) -> float:
    """Best-of-iters ms of forward + backward (the min: robust to other load on a shared host)."""
    times = []
    for i in range(warmup + iters):
        _sync(x_BSD.device)
        t0 = time.perf_counter()
        y_BSD, aux = moe(x_BSD)
        (y_BSD.float().square().mean() + aux["moe_seq_balance"] + aux["router_z"]).backward()
        _sync(x_BSD.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        moe.zero_grad(set_to_none=True)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--expert-dim", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    paths = ["batched"] + (["grouped_mm"] if grouped_mm_supported(device.type, dtype) else [])
    print(f"# tokens {args.tokens}, dim {args.dim}, expert_dim {args.expert_dim}, top_k {args.top_k}, "
          f"{args.device} {args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'experts':>8} {'loop ms':>9} " + " ".join(f"{p + ' ms':>14} {'x loop':>7}" for p in paths))
    for n_exp in args.experts:
        cfg = MoEConfig(n_routed=n_exp, top_k=min(args.top_k, n_exp), n_shared=1,
                        expert_dim=args.expert_dim, dispatch="loop")
        moe = MoE(args.dim, cfg).to(device=device, dtype=dtype)
        x_BSD = torch.randn(1, args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
        loop_ms = time_step(moe, x_BSD, args.iters)
        row = f"{n_exp:>8} {loop_ms:>9.1f} "
        for path in paths:
            moe.experts.path = path
            ms = time_step(moe, x_BSD, args.iters)
            row += f"{ms:>14.1f} {loop_ms / ms:>6.2f}x "
        print(row, flush=True)


if __name__ == "__main__":
    main()
