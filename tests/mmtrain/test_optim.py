"""The optimizer: fused AdamW (the fast path on CPU and CUDA) against the multi-tensor reference
on fresh random parameters and gradients; weight decay only on matrices; the ViT's own lr and decay
(`optim.vision_lr_mult` / `vision_weight_decay`), and nothing changed at their defaults."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmtrain.optim import OptimConfig, build_optimizer, build_scheduler, param_part
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


# ----- optim.vision_lr_mult / vision_weight_decay, param_part ------------------------------------
def _toy() -> nn.Module:
    """The model's layout in small: the ViT (`vision.*`), its projector, the decoder."""
    vision = nn.Module()
    vision.blocks = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
    vision.projector = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8))
    model = nn.Module()
    model.vision, model.decoder = vision, nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    return model


def _previous_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """build_optimizer as it was before the ViT's own groups."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def _groups(opt) -> list[tuple[list[int], float, float]]:
    return [([id(p) for p in g["params"]], g["lr"], g["weight_decay"]) for g in opt.param_groups]


def _train(model: nn.Module, opt, grads: list[list[torch.Tensor]] | None = None) -> None:
    """Four scheduled steps on `grads` (one list per step; default: fresh random ones)."""
    sched = build_scheduler(opt, 10, OptimConfig())
    for step in range(4):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn_like(p) if grads is None else grads[step][i].clone()
        opt.step()
        sched.step()


def test_param_part_strips_wrapper_prefixes():
    assert param_part("vision.blocks.0._orig_mod.attn.qkv.weight") == "vision"
    assert param_part("module._orig_mod.vision.projector.fc1.weight") == "projector"
    assert param_part("_checkpoint_wrapped_module.vision.patch_embed.weight") == "vision"
    assert param_part("decoder.layers.0.attn.wq.weight") == "decoder"
    assert param_part("visionary.weight") == "decoder"
    assert param_part("visual_head.weight") == param_part("module.visual_head.bias") == "decoder"


def test_default_groups_are_the_previous_two():
    """Defaults (and an explicit mult 1.0): the two groups and state layout of before the option."""
    model, cfg = _toy(), OptimConfig()
    old = _previous_optimizer(model, cfg)
    for new in (build_optimizer(model, cfg), build_optimizer(model, OptimConfig(vision_lr_mult=1.0))):
        assert _groups(new) == _groups(old)
        assert new.state_dict()["param_groups"] == old.state_dict()["param_groups"]


def test_default_training_is_bit_identical_to_the_previous_groups():
    a, b = _toy(), _toy()
    b.load_state_dict(a.state_dict())
    grads = [[torch.randn_like(p) for p in a.parameters()] for _ in range(4)]
    cfg = OptimConfig()
    for model, opt in ((a, build_optimizer(a, cfg)), (b, _previous_optimizer(b, cfg))):
        _train(model, opt, grads)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_vision_lr_mult_zero_freezes_the_vit_but_not_its_projector():
    model = _toy()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, build_optimizer(model, OptimConfig(vision_lr_mult=0.0)))
    for name, p in model.named_parameters():
        assert torch.equal(p, start[name]) == (param_part(name) == "vision"), name


def test_projector_lr_mult_with_vision_lr_mult_zero_freezes_the_whole_visual_path():
    model = _toy()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(vision_lr_mult=0.0, projector_lr_mult=0.0))
    assert len(opt.param_groups) == 6
    _train(model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(p, start[name]) == (param_part(name) != "decoder"), name
    assert param_part("vision.out_norm.weight") == "projector"


def test_vision_weight_decay_applies_to_vit_matrices_only():
    model = _toy()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1, vision_weight_decay=0.3, vision_lr_mult=0.5))
    settings = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    lr = OptimConfig().lr
    for name, p in model.named_parameters():
        vit = param_part(name) == "vision"
        want_decay = 0.0 if p.ndim < 2 else 0.3 if vit else 0.1
        assert settings[id(p)] == pytest.approx((lr * (0.5 if vit else 1.0), want_decay)), name
    assert len(opt.param_groups) == 4


def test_resuming_with_the_vits_own_groups_toggled_says_why(make_config, tmp_path):
    """The optimizer state of a default run has 2 groups; with optim.vision_lr_mult set it has 4:
    resuming across the change is refused with the setting named, not a bare DCP error."""
    from mmtrain.errors import UserError
    from mmtrain.loop.trainer import Trainer

    run = tmp_path / "run"
    Trainer(make_config(run, ["train.steps=2", "train.ckpt_every=2"]), verbose=False).fit()
    with pytest.raises(UserError, match="optim.vision_lr_mult differ"):
        Trainer(make_config(run, ["train.steps=4", "optim.vision_lr_mult=0.0"]), verbose=False)
    trainer = Trainer(make_config(run, ["train.steps=4"]), verbose=False)  # the same settings resume
    assert trainer.step == 2


def test_vision_hold_steps_freezes_the_vit_then_trains_it():
    """Held for 2 steps: those steps equal a frozen-ViT run's (same gradients), then the ViT moves
    while the frozen run's stays."""
    held, frozen = _toy(), _toy()
    frozen.load_state_dict(held.state_dict())
    start = {n: p.detach().clone() for n, p in held.named_parameters()}
    grads = [[torch.randn_like(p) for p in held.parameters()] for _ in range(4)]
    cfgs = (OptimConfig(vision_hold_steps=2), OptimConfig(vision_lr_mult=0.0))
    opts = [build_optimizer(m, c) for m, c in zip((held, frozen), cfgs)]
    scheds = [build_scheduler(o, 10, c) for o, c in zip(opts, cfgs)]
    for step in range(4):
        for model, opt, sched in zip((held, frozen), opts, scheds):
            for i, p in enumerate(model.parameters()):
                p.grad = grads[step][i].clone()
            opt.step()
            sched.step()
        same = all(torch.equal(p, q) for p, q in zip(held.parameters(), frozen.parameters()))
        assert same == (step < 2), step
    for name, p in held.named_parameters():
        assert not torch.equal(p, start[name]), name  # every part has moved by step 4
    assert {g.get("part") for g in opts[0].param_groups} == {"vision", None}
