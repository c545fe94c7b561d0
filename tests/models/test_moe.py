"""MoE: every expert path (the registry) vs the no-sorting reference, scoring, bias balancing,
modality groups.

Legend: B rows, S tokens, D dim, T tokens, E experts, K top_k.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmtrain.models.moe import MoE, MoEConfig, seq_balance_loss
from mmtrain.models.moe.experts import EXPERT_PATHS, experts_reference
from mmtrain.models.moe.grouped_mm import _grouped_mm_probe, grouped_mm_supported

# every registered path that runs here (the registry is the parametrisation)
PATHS = [name for name, p in EXPERT_PATHS.items() if p.supported("cpu", torch.float32)]


def reference(moe: MoE, x_BSD: torch.Tensor, mod_BS: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The layer's function without a dispatcher or a sorted row: the router's choice, then one
    expert at a time on the tokens that chose it, plus the shared expert."""
    B, S, D = x_BSD.shape
    x_TD, mod_T = x_BSD.reshape(B * S, D), mod_BS.reshape(-1)
    group_T = (mod_T != 0).long() if moe.cfg.modality_groups else torch.zeros_like(mod_T)
    r = moe.router(x_TD, group_T)
    y_TD = experts_reference(x_TD, r.idx_TK, r.w_TK, moe.experts.w_in_EDF2, moe.experts.w_out_EFD)
    y_TD = y_TD + (moe.shared(x_TD) if moe.shared is not None else 0)
    real_T = torch.ones_like(mod_T, dtype=torch.bool)
    return y_TD.view(B, S, D), moe.router.aux(r, group_T, mod_T, real_T, B, S)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
@pytest.mark.parametrize("groups", [False, True])
def test_dispatch_matches_reference_forward_and_backward(path: str, score: str, groups: bool) -> None:
    cfg = MoEConfig(n_routed=8, top_k=2, n_shared=1, expert_dim=24, score=score, modality_groups=groups,
                    n_text_experts=4 if groups else 0, n_visual_experts=4 if groups else 0, dispatch=path)
    fast = MoE(32, cfg)
    ref = copy.deepcopy(fast)
    torch.nn.init.normal_(fast.router.expert_bias_E, std=0.1)  # selection-only bias must not matter either
    ref.router.expert_bias_E.copy_(fast.router.expert_bias_E)
    x_BSD = torch.randn(2, 24, 32)
    mod_BS = torch.randint(0, 3, (2, 24))
    xs = [x_BSD.clone().requires_grad_(True) for _ in range(2)]
    (y_f, aux_f), (y_r, aux_r) = fast(xs[0], mod_BS), reference(ref, xs[1], mod_BS)
    torch.testing.assert_close(y_f, y_r, atol=1e-5, rtol=1e-5)
    assert torch.equal(aux_f["load_3E"], aux_r["load_3E"])
    g_BSD = torch.randn_like(y_f)
    (y_f * g_BSD).sum().add(aux_f["moe_seq_balance"] + aux_f["router_z"]).backward()
    (y_r * g_BSD).sum().add(aux_r["moe_seq_balance"] + aux_r["router_z"]).backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, atol=1e-5, rtol=1e-5)
    for (name, p_f), p_r in zip(fast.named_parameters(), ref.parameters()):
        g_r = p_r.grad if p_r.grad is not None else torch.zeros_like(p_f)
        torch.testing.assert_close(p_f.grad, g_r, atol=1e-5, rtol=1e-5, msg=name)


def test_dispatch_handles_empty_experts_and_one_token() -> None:
    for path in PATHS:
        moe = MoE(16, MoEConfig(n_routed=16, top_k=1, n_shared=0, expert_dim=8, dispatch=path))
        x_BSD = torch.randn(1, 1, 16)  # 15 of 16 experts get nothing
        torch.testing.assert_close(moe(x_BSD)[0], reference(moe, x_BSD, torch.zeros(1, 1).long())[0],
                                   atol=1e-6, rtol=1e-6)


def test_a_registered_expert_path_is_selectable_and_held_to_the_reference() -> None:
    """A new way to run the experts is a function plus its registration: the config accepts its
    name and the layer runs it (here a toy: the loop path under another name)."""
    from mmtrain.models.moe.experts import ExpertPath, register_expert_path

    calls = []

    def toy(x_RD, counts_E, w_in, w_out):
        calls.append(x_RD.shape[0])
        return EXPERT_PATHS["loop"].run(x_RD, counts_E, w_in, w_out)

    register_expert_path(ExpertPath("toy", toy, lambda dev, dtype: True, host_sync=True, auto=False))
    try:
        moe = MoE(16, MoEConfig(n_routed=4, top_k=2, n_shared=0, expert_dim=8, dispatch="toy"))
        x_BSD, mod_BS = torch.randn(2, 9, 16), torch.zeros(2, 9, dtype=torch.long)
        got, want = moe(x_BSD, mod_BS)[0], reference(moe, x_BSD, mod_BS)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert calls  # the layer ran the registered path
    finally:
        del EXPERT_PATHS["toy"]
    with pytest.raises(ValueError, match="dispatch:"):
        MoEConfig(dispatch="toy")


def test_legacy_state_dict_names_load() -> None:
    """A state dict of the single-module layout (bias and expert weights on the layer) loads."""
    moe = MoE(16, MoEConfig(n_routed=4, top_k=2, n_shared=1, expert_dim=8))
    torch.nn.init.normal_(moe.router.expert_bias_E)
    old = {k.replace("router.expert_bias_E", "expert_bias_E").replace("experts.", ""): v.clone()
           for k, v in moe.state_dict().items()}
    fresh = MoE(16, MoEConfig(n_routed=4, top_k=2, n_shared=1, expert_dim=8))
    fresh.load_state_dict(old)
    for k, v in moe.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_grouped_mm_probe_is_cached_and_boolean() -> None:
    first = grouped_mm_supported("cpu", torch.float32)
    hits = _grouped_mm_probe.cache_info().hits
    assert grouped_mm_supported("cpu", torch.float32) is first
    assert _grouped_mm_probe.cache_info().hits == hits + 1


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_combine_weights(score: str) -> None:
    moe = MoE(16, MoEConfig(n_routed=6, top_k=3, n_shared=0, expert_dim=8, score=score, dispatch="loop"))
    from mmtrain.models.moe import route

    logits_TE = torch.randn(10, 6)
    idx_TK, w_TK, p_TE = route(logits_TE, moe.router.expert_bias_E, None, moe.cfg)
    torch.testing.assert_close(p_TE.sum(-1), torch.ones(10))
    if score == "sigmoid":  # normalised over the chosen k
        torch.testing.assert_close(w_TK.sum(-1), torch.ones(10))
    else:  # raw softmax probabilities of the chosen experts
        torch.testing.assert_close(w_TK, logits_TE.softmax(-1).gather(-1, idx_TK))
    assert torch.equal(idx_TK.sort(-1).values, logits_TE.topk(3).indices.sort(-1).values)


def _imbalance(load_E: torch.Tensor) -> float:
    load_E = load_E.float()
    return (load_E.std() / load_E.mean()).item()


def test_bias_balancing_evens_out_skewed_routing() -> None:
    cfg = MoEConfig(n_routed=8, top_k=2, n_shared=0, expert_dim=8, bias_update_rate=0.02, dispatch="batched")
    moe = MoE(16, cfg)
    with torch.no_grad():  # a frozen router that strongly prefers the low experts
        moe.router.weight.normal_(std=0.2)
        moe.router.weight[:, 0] += torch.linspace(2.0, -2.0, 8)
    moe.requires_grad_(False)
    offset_D = torch.zeros(16)
    offset_D[0] = 1.0

    def step() -> torch.Tensor:
        _, aux = moe(torch.randn(4, 64, 16) + offset_D)
        moe.accumulate_load(aux["load_3E"])
        load_E = moe.load_E.clone()
        moe.update_bias()
        return load_E

    before = _imbalance(step())
    for _ in range(150):
        step()
    after = _imbalance(sum(step() for _ in range(10)))
    assert before > 0.5, before
    assert after < 0.25 * before, (before, after)
    assert moe.load_E.sum() == 0  # cleared by update_bias


def test_modality_groups_route_within_group() -> None:
    cfg = MoEConfig(n_routed=10, top_k=2, n_shared=1, expert_dim=8, modality_groups=True,
                    n_text_experts=6, n_visual_experts=4)
    moe = MoE(16, cfg)
    mod_BS = torch.randint(0, 3, (3, 20))
    _, aux = moe(torch.randn(3, 20, 16), mod_BS)
    load_3E = aux["load_3E"]
    assert load_3E[0, 6:].sum() == 0 and load_3E[1:, :6].sum() == 0
    counts_3 = torch.bincount(mod_BS.reshape(-1), minlength=3)
    assert torch.equal(load_3E.sum(-1), counts_3 * cfg.top_k)
    assert load_3E.sum() == 3 * 20 * cfg.top_k


def test_seq_balance_loss_is_one_when_balanced() -> None:
    E, K, S = 4, 2, 8
    idx_SK = torch.tensor([[0, 1], [2, 3]] * (S // 2))
    chosen_1SE = torch.zeros(S, E).scatter_(-1, idx_SK, 1.0)[None]
    p_1SE = torch.full((1, S, E), 1 / E)
    loss = seq_balance_loss(p_1SE, chosen_1SE, torch.zeros(1, S, dtype=torch.long), [E], K)
    torch.testing.assert_close(loss, torch.tensor(1.0))


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(top_k=9), "top_k:"),
    (dict(modality_groups=True, n_text_experts=3, n_visual_experts=3), "n_text_experts:"),
    (dict(score="relu"), "score:"),
    (dict(dispatch="magic"), "dispatch:"),
    (dict(bias_update_rate=-1.0), "bias_update_rate:"),
])
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MoEConfig(n_routed=8, **kwargs)


@pytest.mark.parametrize("path", PATHS)
def test_padding_is_not_routed_counted_or_in_the_losses(path: str) -> None:
    """A batch with padding routes exactly the real tokens: load, balance, z-loss and entropy are
    those of the real tokens alone, whatever the padding holds; padding gets the shared expert only."""
    torch.manual_seed(0)
    moe = MoE(32, MoEConfig(n_routed=8, top_k=2, n_shared=1, expert_dim=16, dispatch=path))
    x_BSD = torch.randn(2, 20, 32, requires_grad=True)
    mod_BS = torch.randint(0, 3, (2, 20))
    real_BS = torch.ones(2, 20, dtype=torch.bool)
    real_BS[0, 13:], real_BS[1, 17:] = False, False
    y, aux = moe(x_BSD, mod_BS, real_BS)
    x2 = torch.where(real_BS[..., None], x_BSD, 50 * torch.randn_like(x_BSD))  # other padding
    y2, aux2 = moe(x2, mod_BS, real_BS)
    torch.testing.assert_close(y[real_BS], y2[real_BS])
    for name in ("moe_seq_balance", "router_z", "load_3E", "router_entropy_3"):
        torch.testing.assert_close(aux[name], aux2[name], msg=name)
    assert int(aux["load_3E"].sum()) == 2 * int(real_BS.sum())
    torch.testing.assert_close(y[~real_BS], moe.shared(x_BSD[~real_BS]))
    # Rows of real tokens alone, one row at a time: the same load and routed outputs.
    for b, n in ((0, 13), (1, 17)):
        y_b, aux_b = moe(x_BSD[b:b + 1, :n], mod_BS[b:b + 1, :n])
        torch.testing.assert_close(y_b[0], y[b, :n], atol=1e-6, rtol=1e-5)
    (y.square().sum() + aux["router_z"] + aux["moe_seq_balance"]).backward()
    assert torch.isfinite(x_BSD.grad).all()
