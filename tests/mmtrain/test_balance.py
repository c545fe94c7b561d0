"""Loss-weight balancers against their formulas worked by hand, checkpoint round trips, config checks
(a section per kind; the flat keys of older configs still load), the signals each kind declares
and receives, and the closed-form LM-head gradients for GradNorm against autograd."""

from __future__ import annotations

import dataclasses
import io
import math
import random
from types import SimpleNamespace

import pytest
import torch

from mmtrain.callbacks import Callbacks
from mmtrain.config import ConfigError, from_dict, to_dict
from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_NAMES
from mmtrain.objectives.balance import KINDS, BalanceConfig, build_balancer
from mmtrain.objectives.balance.base import BALANCERS, Balancer, register
from mmtrain.objectives.balance.signals import SIGNALS, check_signals
from mmtrain.objectives.terms import head_grads, task_losses

BASE = {"text": 1.0, "image_text": 0.5, "video_text": 2.0}


def make(kind: str, **knobs):
    return build_balancer(from_dict(BalanceConfig, {"kind": kind, kind: knobs}), BASE)


def observe(b, losses: dict, step: int, norms: dict | None = None) -> None:
    """What the objective hands a balancer after a step: the step signals it declares."""
    provided = {"task_loss": losses, "head_grad_norm": norms or {}}
    if b.wants("step"):
        b.observe({s: provided[s] for s in b.wants("step")}, step)


def diagnose(b, gaps: dict, step: int) -> None:
    """A diagnostics run's result reaching the balancer's on_diagnostics."""
    b.on_diagnostics(SimpleNamespace(step=step), SimpleNamespace(reliance_gap=gaps, mismatch_gap={}))


def assert_weights(balancer, mult: dict[str, float]) -> None:
    got = balancer.weights()
    for t in TASK_NAMES:
        assert got[t] == pytest.approx(BASE[t] * mult[t], rel=1e-12), t


def dwa_mult(ratio: dict[str, float], temperature: float) -> dict[str, float]:
    e = {t: math.exp(r / temperature) for t, r in ratio.items()}
    return {t: 3 * v / sum(e.values()) for t, v in e.items()}


# -- config ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, field, value", [
    ("dwa", "temperature", 0.0), ("dwa", "window", 0), ("uncertainty", "lr", 0.0), ("gradnorm", "lr", -1.0),
    ("gradnorm", "alpha", -0.1), ("reliance_guard", "min_gap", -0.01), ("reliance_guard", "tolerance", 1.5),
    ("reliance_guard", "tolerance", -0.1), ("reliance_guard", "gain", 0.9), ("reliance_guard", "decay", 1.1),
    ("reliance_guard", "max_weight", 0.5), ("gradnorm", "min_weight", 0.0), ("gradnorm", "min_weight", 1.5),
])
def test_bad_config_values_raise(kind, field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        BALANCERS[kind].Config(**{field: value})
    with pytest.raises(ConfigError, match=f"loss.balancer.{kind}.{field}: must be"):
        from_dict(BalanceConfig, {kind: {field: value}}, prefix="loss.balancer.")


def test_the_config_has_kind_and_one_section_per_registered_kind():
    with pytest.raises(ValueError, match="^kind: must be"):
        BalanceConfig(kind="softmax")
    assert list(to_dict(BalanceConfig())) == ["kind", *KINDS]
    cfg = from_dict(BalanceConfig, {"kind": "dwa", "dwa": {"window": 3}})
    assert build_balancer(cfg, BASE).cfg == BALANCERS["dwa"].Config(window=3)


def test_flat_keys_of_older_configs_go_to_every_kind_that_has_them():
    old = {"kind": "gradnorm", "temperature": 3.0, "window": 5, "lr": 0.5, "alpha": 1.0, "min_gap": 0.1,
           "tolerance": 0.3, "gain": 2.0, "decay": 0.4, "max_weight": 3.0, "min_weight": 0.1}  # all of them
    cfg = from_dict(BalanceConfig, old)
    assert (cfg.dwa.temperature, cfg.dwa.window, cfg.uncertainty.lr) == (3.0, 5, 0.5)
    assert (cfg.gradnorm.lr, cfg.gradnorm.alpha, cfg.gradnorm.min_weight) == (0.5, 1.0, 0.1)
    assert cfg.reliance_guard == BALANCERS["reliance_guard"].Config(0.1, 0.3, 2.0, 0.4, 3.0)
    assert from_dict(BalanceConfig, to_dict(cfg)) == cfg
    section_wins = from_dict(BalanceConfig, {"window": 5, "dwa": {"window": 7}})
    assert section_wins.dwa.window == 7
    with pytest.raises(ConfigError, match="typo: unknown key"):
        from_dict(BalanceConfig, {"typo": 1})


def test_unknown_kind_and_missing_base_weights_raise():
    cfg = BalanceConfig()
    cfg.kind = "pcgrad"  # set after validation: build_balancer must still refuse it
    with pytest.raises(ValueError, match="kind"):
        build_balancer(cfg, BASE)
    with pytest.raises(ValueError, match="video_text"):
        build_balancer(BalanceConfig(), {"text": 1.0, "image_text": 1.0})


def test_each_kind_declares_known_signals_and_is_the_checkpoint_part_balancer():
    declared = {kind: BALANCERS[kind].signals for kind in KINDS}
    assert declared == {"static": (), "dwa": ("task_loss",), "uncertainty": ("task_loss",),
                        "gradnorm": ("task_loss", "head_grad_norm"), "reliance_guard": ("reliance_gap",)}
    assert all(s in SIGNALS for signals in declared.values() for s in signals)
    for kind in KINDS:  # older checkpoints hold the balancer's state under "balancer"
        assert list(Callbacks([make(kind)]).parts(per_rank=False)) == ["balancer"]


def test_a_new_kind_is_a_class_and_its_registration_and_gets_only_what_it_declares():
    @dataclasses.dataclass
    class ToyConfig:
        gain: float = 2.0

    class Toy(Balancer):
        kind, Config, signals = "toy", ToyConfig, ("task_loss", "mismatch_gap")

        def observe(self, signals, step):
            self.seen.append((sorted(signals), step))

    register(Toy)
    try:
        with pytest.raises(ValueError, match="registered twice"):
            register(Toy)
        b = BALANCERS["toy"](ToyConfig(), BASE)
        b.seen = []
        observe(b, {"text": 1.0}, 1, {"text": 2.0})
        b.on_diagnostics(SimpleNamespace(step=2), SimpleNamespace(mismatch_gap={"image_text": 0.1}))
        assert b.seen == [(["task_loss"], 1), (["mismatch_gap"], 2)]
    finally:
        del BALANCERS["toy"]

    class Unknown(Balancer):
        kind, signals = "unknown_signal", ("loss_curvature",)

    with pytest.raises(ValueError, match="unknown signals"):
        register(Unknown)


@pytest.mark.parametrize("signals, diag, cp, error", [
    (("task_loss",), {"every": 0, "mismatch": False}, 1, None),
    (("reliance_gap",), {"every": 0, "mismatch": True}, 1, "set diagnostics.every > 0"),
    (("mismatch_gap",), {"every": 10, "mismatch": False}, 1, "set diagnostics.mismatch: true"),
    (("mismatch_gap",), {"every": 10, "mismatch": True}, 1, None),
    # the head gradients of the ranks' chunks add up (CP(2), TP(2) parity with one process: test_distributed,
    # test_tensor_parallel)
    (("head_grad_norm",), {"every": 0, "mismatch": False}, 2, None),
])
def test_a_declared_signal_the_config_cannot_provide_is_named(signals, diag, cp, error):
    cfg = SimpleNamespace(diagnostics=SimpleNamespace(**diag), dist=SimpleNamespace(cp=cp))
    if error is None:
        check_signals(cfg, signals, "loss.balancer.kind: toy")
    else:
        with pytest.raises(ValueError, match=error):
            check_signals(cfg, signals, "loss.balancer.kind: toy")


# -- static -----------------------------------------------------------------------------------------------

def test_static_weights_never_change():
    b = make("static")
    for step in range(1, 6):
        observe(b, {"text": 5.0 / step, "image_text": 1.0}, step, {"text": 1.0})
        diagnose(b, {"image_text": 0.0}, step)
    assert b.weights() == BASE
    assert b.scalars() == {}
    b.load_state_dict({"weights": {"text": 9.0}})  # a checkpoint from before the adaptive balancers
    assert b.weights() == BASE


# -- DWA ----------------------------------------------------------------------------------------------------

def test_dwa_ratio_of_window_means():
    b = make("dwa", window=2, temperature=2.0)
    history = [
        {"text": 4.0, "image_text": 6.0, "video_text": 5.0},
        {"text": 2.0, "image_text": 6.0},  # window 1 means: text 3, image 6, video 5
        {"text": 2.0, "image_text": 6.0},
        {"text": 1.0, "image_text": 3.0},  # window 2: text 1.5, image 4.5, video absent
        {"text": 1.0, "image_text": 3.0, "video_text": 4.0},
        {"text": 1.0, "image_text": 3.0, "video_text": float("nan")},  # window 3: 1, 3, 4 (nan ignored)
    ]
    ones = dict.fromkeys(TASK_NAMES, 1.0)
    for step, losses in enumerate(history[:3], start=1):
        observe(b, losses, step)
        assert_weights(b, ones)  # one window seen: r = 1 for all
    observe(b, history[3], 4)
    ratio = {"text": 1.5 / 3.0, "image_text": 4.5 / 6.0, "video_text": 1.0}  # video: only one window yet
    assert_weights(b, dwa_mult(ratio, 2.0))
    observe(b, history[4], 5)
    assert_weights(b, dwa_mult(ratio, 2.0))  # mid-window: unchanged
    observe(b, history[5], 6)
    ratio = {"text": 1.0 / 1.5, "image_text": 3.0 / 4.5, "video_text": 4.0 / 5.0}  # video: its windows 1, 3
    assert_weights(b, dwa_mult(ratio, 2.0))
    assert b.scalars()["balance/dwa_ratio_video_text"] == pytest.approx(0.8)
    assert sum(b.mult.values()) == pytest.approx(3.0)


# -- uncertainty ------------------------------------------------------------------------------------------

UNC_HISTORY = [
    {"text": 2.0, "image_text": 0.5, "video_text": 3.0},
    {"text": 1.5, "image_text": 0.5},
    {"text": 1.0, "video_text": 2.0},
]


def test_uncertainty_closed_form_steps():
    lr = 0.1
    b = make("uncertainty", lr=lr)
    for step, losses in enumerate(UNC_HISTORY, start=1):
        observe(b, losses, step)
    s_text = 0.0 - lr * (1 - 2.0)
    s_text = s_text - lr * (1 - math.exp(-s_text) * 1.5)
    s_text = s_text - lr * (1 - math.exp(-s_text) * 1.0)
    s_image = 0.0 - lr * (1 - 0.5)
    s_image = s_image - lr * (1 - math.exp(-s_image) * 0.5)
    s_video = 0.0 - lr * (1 - 3.0)
    s_video = s_video - lr * (1 - math.exp(-s_video) * 2.0)
    s = {"text": s_text, "image_text": s_image, "video_text": s_video}
    assert_weights(b, {t: math.exp(-v) for t, v in s.items()})
    assert b.scalars() == pytest.approx({f"balance/log_var_{t}": v for t, v in s.items()})


def test_uncertainty_step_equals_sgd_on_the_objective():
    lr = 0.1
    b = make("uncertainty", lr=lr)
    s_K = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([s_K], lr=lr)
    for step, losses in enumerate(UNC_HISTORY, start=1):
        opt.zero_grad()
        present = [(k, t) for k, t in enumerate(TASK_NAMES) if t in losses]
        objective = sum(torch.exp(-s_K[k]) * losses[t] + s_K[k] for k, t in present)
        objective.backward()
        opt.step()
        observe(b, losses, step)
        for k, t in enumerate(TASK_NAMES):
            assert b.log_var[t] == pytest.approx(float(s_K[k].detach()), rel=1e-12, abs=1e-15)


def test_non_finite_losses_are_ignored():
    b = make("uncertainty")
    observe(b, {"text": 2.0}, 1)
    before = b.state_dict()
    observe(b, {"text": float("nan"), "image_text": float("inf")}, 2)
    assert b.state_dict() == before


# -- GradNorm -----------------------------------------------------------------------------------------------

def test_gradnorm_steps_by_hand():
    lr, alpha = 0.1, 1.5
    b = make("gradnorm", lr=lr, alpha=alpha, min_weight=0.05)
    # step 1: L = L(0), so r = 1 and every target is Gbar = (1 + 2 + 0.5) / 3 = 7/6
    observe(b, {"text": 2.0, "image_text": 4.0, "video_text": 3.0}, 1,
              {"text": 1.0, "image_text": 2.0, "video_text": 0.5})
    w = {"text": 1 + lr * 1.0, "image_text": 1 - lr * 2.0, "video_text": 1 + lr * 0.5}  # signs -, +, -
    w = {t: v * 3 / sum(w.values()) for t, v in w.items()}
    assert_weights(b, w)

    # step 2: Ltilde = (0.5, 0.9, 0.5); image's grad norm 20 drives it into the floor
    g = {"text": 1.0, "image_text": 20.0, "video_text": 0.2}
    lt = {"text": 1.0 / 2.0, "image_text": 3.6 / 4.0, "video_text": 1.5 / 3.0}
    observe(b, {"text": 1.0, "image_text": 3.6, "video_text": 1.5}, 2, g)
    G = {t: w[t] * g[t] for t in TASK_NAMES}
    g_mean, lt_mean = sum(G.values()) / 3, sum(lt.values()) / 3
    target = {t: g_mean * (lt[t] / lt_mean) ** alpha for t in TASK_NAMES}
    assert G["text"] < target["text"] and G["image_text"] > target["image_text"]
    assert G["video_text"] < target["video_text"]
    w = {"text": w["text"] + lr * 1.0, "image_text": 0.05, "video_text": w["video_text"] + lr * 0.2}
    w = {t: v * 3 / sum(w.values()) for t, v in w.items()}
    assert_weights(b, w)
    assert b.scalars()["balance/grad_norm_image_text"] == 20.0
    assert b.scalars()["balance/loss_ratio_image_text"] == pytest.approx(0.9)

    # step 3: video only has a grad norm, image only a loss -> only text steps, alone: G = target, no change
    observe(b, {"text": 0.8, "image_text": 3.0}, 3, {"text": 1.0, "video_text": 5.0})
    assert_weights(b, w)

    # step 4: text and image step; video keeps its weight and the two keep their sum
    g = {"text": 1.0, "image_text": 1.0}
    lt = {"text": 0.8 / 2.0, "image_text": 3.2 / 4.0}
    observe(b, {"text": 0.8, "image_text": 3.2}, 4, g)
    G = {t: w[t] * g[t] for t in g}
    g_mean, lt_mean = sum(G.values()) / 2, sum(lt.values()) / 2
    target = {t: g_mean * (lt[t] / lt_mean) ** alpha for t in g}
    assert G["text"] > target["text"] and G["image_text"] < target["image_text"]
    pair = w["text"] + w["image_text"]
    stepped = {"text": w["text"] - lr, "image_text": w["image_text"] + lr}
    w = {**w, **{t: v * pair / sum(stepped.values()) for t, v in stepped.items()}}
    assert_weights(b, w)
    assert sum(b.mult.values()) == pytest.approx(3.0)


# -- reliance guard ---------------------------------------------------------------------------------------

def test_reliance_guard_raises_on_shrinking_gap_and_relaxes_otherwise():
    b = make("reliance_guard")  # min_gap 0.05, tolerance 0.25, gain 1.5, decay 0.5, max 4
    observe(b, {"text": 3.0, "image_text": 9.0}, 1)  # no-op for this balancer
    checks = [
        # (image gap, image mult after), (video gap, video mult after)
        ((0.40, 1.0), (0.01, 1.5)),  # image healthy (best 0.4); video collapsed
        ((0.25, 1.5), (0.02, 2.25)),  # image < 0.75 * 0.4 = 0.3
        ((0.20, 2.25), (0.03, 3.375)),
        ((0.35, 1.625), (0.00, 4.0)),  # image back above 0.3: 1 + 1.25 * 0.5; video capped at 4
        ((0.50, 1.3125), (0.20, 2.5)),  # new best 0.5; video healthy: 1 + 3 * 0.5
    ]
    for step, ((g_img, w_img), (g_vid, w_vid)) in enumerate(checks, start=1):
        diagnose(b, {"image_text": g_img, "video_text": g_vid}, step * 10)
        assert_weights(b, {"text": 1.0, "image_text": w_img, "video_text": w_vid})
    diagnose(b, {"image_text": 0.30}, 60)  # 0.3 < 0.75 * 0.5: raised; video absent: kept
    assert_weights(b, {"text": 1.0, "image_text": 1.3125 * 1.5, "video_text": 2.5})
    assert b.scalars()["balance/best_gap_image_text"] == 0.5
    assert b.scalars()["balance/best_gap_video_text"] == 0.2
    with pytest.raises(ValueError, match="text"):
        diagnose(b, {"text": 0.1}, 70)


# -- missing tasks, checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["static", "uncertainty", "gradnorm"])
def test_missing_task_keeps_its_weight(kind):
    b = make(kind)
    observe(b, {"text": 2.0, "image_text": 3.0, "video_text": 4.0}, 1,
              {"text": 1.0, "image_text": 0.5, "video_text": 2.0})
    video = b.weights()["video_text"]
    observe(b, {"text": 1.0, "image_text": 3.5}, 2, {"text": 1.0, "image_text": 0.5})
    assert b.weights()["video_text"] == video


def history(n: int, seed: int = 0):
    """Per step: (losses, grad norms, gaps or None); tasks drop out at random."""
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        present = [t for t in TASK_NAMES if rng.random() < 0.8] or ["text"]
        losses = {t: rng.uniform(0.5, 4.0) / step**0.3 for t in present}
        norms = {t: rng.uniform(0.1, 3.0) for t in present}
        gaps = {t: rng.uniform(-0.02, 0.5) for t in ("image_text", "video_text")} if step % 2 == 0 else None
        out.append((losses, norms, gaps))
    return out


def feed(b, steps, start: int) -> None:
    for step, (losses, norms, gaps) in enumerate(steps, start=start):
        observe(b, losses, step, norms)
        if gaps is not None:
            diagnose(b, gaps, step)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_continues_identically(kind):
    cfg = {"window": 3} if kind == "dwa" else {}
    steps = history(16)
    whole = make(kind, **cfg)
    feed(whole, steps, 1)

    first = make(kind, **cfg)
    feed(first, steps[:7], 1)  # 7: mid DWA window
    buf = io.BytesIO()
    torch.save({"balancer": first.state_dict()}, buf)
    buf.seek(0)
    resumed = make(kind, **cfg)
    resumed.load_state_dict(torch.load(buf, weights_only=True)["balancer"])  # plain python data only
    feed(resumed, steps[7:], 8)

    assert resumed.weights() == whole.weights()
    assert resumed.scalars() == whole.scalars()
    assert resumed.state_dict() == whole.state_dict()
    if kind != "static":
        assert whole.weights() != BASE  # the history did move the weights


def test_loading_another_kinds_state_warns_and_starts_afresh():
    dwa = make("dwa", window=1)
    feed(dwa, history(4), 1)
    b = make("uncertainty")
    with pytest.warns(UserWarning, match="dwa"):
        b.load_state_dict(dwa.state_dict())
    assert b.weights() == BASE


# -- closed-form LM-head gradients ---------------------------------------------------------------------------

def head_case(seed: int = 0, B: int = 2, S: int = 9, V: int = 13, D: int = 6):
    g = torch.Generator().manual_seed(seed)
    hidden_BSD = torch.randn(B, S, D, generator=g)
    head_VD = torch.randn(V, D, generator=g, requires_grad=True)
    labels_BS = torch.randint(0, V, (B, S), generator=g)
    labels_BS[torch.rand(B, S, generator=g) < 0.25] = IGNORE_INDEX
    task_BS = torch.arange(B * S).remainder(3).view(B, S)  # all three tasks present
    return hidden_BSD, head_VD, labels_BS, task_BS


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("with_counts", [False, True])
def test_head_grads_match_autograd(with_counts):
    hidden_BSD, head_VD, labels_BS, task_BS = head_case()
    logits_BSV = hidden_BSD @ head_VD.T
    losses = task_losses(logits_BSV, labels_BS, task_BS)
    assert all(int(losses.count[t]) > 0 for t in TASK_NAMES)
    counts = None
    if with_counts:  # as if other ranks held more of each task's tokens
        counts = {t: losses.count[t] * (k + 2) for k, t in enumerate(TASK_NAMES)}
        losses.count = counts
    grads = head_grads(hidden_BSD, logits_BSV.detach(), labels_BS, task_BS, head_VD.detach(), counts)
    assert set(grads) == set(TASK_NAMES)
    for t in TASK_NAMES:
        (ref_VD,) = torch.autograd.grad(losses.mean(t), head_VD, retain_graph=True)
        assert rel_err(grads[t], ref_VD) < 1e-4, t


def test_head_grads_leave_out_tasks_without_tokens():
    hidden_BSD, head_VD, labels_BS, task_BS = head_case(seed=1)
    task_BS = task_BS.clamp(max=1)  # no video_text tokens here
    logits_BSV = hidden_BSD @ head_VD.detach().T
    assert set(head_grads(hidden_BSD, logits_BSV, labels_BS, task_BS, head_VD.detach())) == {
        "text", "image_text"}
    counts = {"text": torch.tensor(30), "image_text": torch.tensor(30), "video_text": torch.tensor(5)}
    grads = head_grads(hidden_BSD, logits_BSV, labels_BS, task_BS, head_VD.detach(), counts)
    assert torch.equal(grads["video_text"], torch.zeros_like(head_VD))  # other ranks have video: zeros here
    with pytest.raises(ValueError, match="head_VD"):
        head_grads(hidden_BSD, logits_BSV, labels_BS, task_BS, head_VD.detach().T)
