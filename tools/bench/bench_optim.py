"""AdamW step: the fused kernel (what `mmtrain.optim.build_optimizer` uses on CPU and CUDA) against
the multi-tensor `foreach` path, on the parameters of a run config's model (random gradients).

    python -m tools.bench.bench_optim --config configs/tiny.yaml --steps 20 --threads 2

Both optimizers step identical copies of the parameters, interleaved; medians. The last column
is the largest difference between the two copies after all steps (the kernels round differently).
"""

from __future__ import annotations

import argparse
import time

import torch

from mmtrain.config import load_config
from mmtrain.models import MultimodalModel
from mmtrain.run_config import RunConfig
from tools.bench.table import print_ratio_table


def copies(params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for p in params:
        q = p.detach().clone().requires_grad_()
        q.grad = p.grad.clone()
        out.append(q)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(RunConfig, args.config, [f"model.decoder.vocab_size={args.vocab}"]).model
    params = [p for p in MultimodalModel(cfg).parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    sides = {kind: copies(params) for kind in ("foreach", "fused")}
    opts = {kind: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, **{kind: True})
            for kind, ps in sides.items()}
    times: dict[str, list[float]] = {kind: [] for kind in opts}
    for i in range(args.steps + 2):
        for kind, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            if i >= 2:  # the first steps allocate the moments
                times[kind].append(time.perf_counter() - t0)
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(sides["foreach"], sides["fused"]))
    print(f"# {args.config}: {len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.2f}M parameters, "
          f"{args.threads} threads, medians of {args.steps} steps")
    print_ratio_table("AdamW", "step", times, "foreach")
    print(f"# largest parameter difference after {args.steps + 2} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
