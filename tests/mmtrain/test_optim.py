"""The optimizer: fused AdamW (the fast path on CPU and CUDA) against the multi-tensor reference
on fresh random parameters and gradients; weight decay only on matrices."""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.optim import OptimConfig, build_optimizer
from tools.bench import bench_optim


def test_fused_adamw_matches_foreach_and_decays_only_matrices():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 7))
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    assert all(g["fused"] for g in opt.param_groups)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    assert decayed == {id(p) for p in model.parameters() if p.ndim >= 2}
    pairs = list(zip(ref, model.parameters()))
    groups = [{"params": [r for r, p in pairs if id(p) in decayed], "weight_decay": 0.1},
              {"params": [r for r, p in pairs if id(p) not in decayed], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, lr=1e-2, betas=cfg.betas, eps=cfg.eps, foreach=True)
    for _ in range(5):
        for p, r in zip(model.parameters(), ref):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r, p0 in zip(model.parameters(), ref, start):
        assert torch.allclose(p, r, atol=1e-6, rtol=1e-5), (p - r).abs().max()
        assert (p - p0).abs().max() > 1e-3  # 5 steps of lr 1e-2 moved every tensor


def test_bench_optim_reports_both_kernels(capsys):
    bench_optim.main(["--steps", "2", "--threads", "1", "--vocab", "64"])
    out = capsys.readouterr().out
    assert "| fused |" in out and "| foreach |" in out
    diff = float(out.rsplit(":", 1)[1])
    assert diff < 1e-5
