"""The objective without a Trainer: a model, a batch and a balancer. Its loss is the sum of the
terms the config names, its step sums count what the batch holds, GradNorm's closed-form head
gradient norms equal autograd's, token weighting changes the optimised loss but not the logged
one, the SSL term adds weight x the masked-patch loss, the visual-next term weight x its pixel loss
(nothing, not even a gradient, at weight 0), and a log step measures attention. The chunked head
(`loss.ce_chunk`) gives the reference's loss, gradients and sums with every term on, and a plain
step's objective code waits on the device nowhere.

Legend: V vocabulary, D width.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from mmtrain.config import apply_override, from_dict
from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_NAMES
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.models.visual_next import next_targets, next_targets_reference, predicting_positions
from mmtrain.objectives.balance import build_balancer
from mmtrain.objectives.objective import Objective, StepSums
from mmtrain.objectives.terms import media_tokens, task_losses, weighted_total, z_loss
from mmtrain.objectives.token_weighting import TokenWeightingSums
from mmtrain.parallel.distributed import current_env
from mmtrain.run_config import RunConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(raw_for, tmp_path_factory):
    """(a config maker, a model in train mode, a train batch holding text and media tasks)."""
    raw = raw_for(tmp_path_factory.mktemp("objective"))

    def make(overrides=()):
        r = copy.deepcopy(raw)
        for item in ["model.vision.ssl_head=true", "model.visual_head=true", "train.log_every=1", *overrides]:
            apply_override(r, item)
        cfg = from_dict(RunConfig, r, source="objective-test")
        cfg.model.decoder.vocab_size = tokenizer.vocab_size
        return cfg

    tokenizer = load_tokenizer(raw["data"]["tokenizer"])
    cfg = make()
    torch.manual_seed(0)
    model = MultimodalModel(cfg.model).train()
    for batch, _ in zip(build_loader(cfg.data, tokenizer, "train", 0, 1), range(50)):
        if media_tokens(batch.labels_BS, batch.task_BS).any() and (batch.task_BS == 0).any():
            return make, model, batch
    pytest.fail("no train batch holds both text and media-task tokens")


def objective(make, model, overrides=()) -> Objective:
    cfg = make(overrides)
    balancer = build_balancer(cfg.loss.balancer, {t: getattr(cfg.loss, t) for t in TASK_NAMES})
    return Objective(cfg, model, balancer, env=current_env(), device=CPU)


def one_step(obj: Objective, batch) -> tuple[torch.Tensor, StepSums]:
    sums = obj.begin_step(0)
    loss = obj.micro_batch(batch, sums)
    obj.end_backward()
    return loss, sums.floats()  # the sums hold device tensors until the step reads them


def test_the_loss_is_the_sum_of_its_terms_and_the_sums_count_the_batch(setup):
    make, model, batch = setup
    obj = objective(make, model, ["loss.text=0.5", "loss.z_loss=0.01"])
    loss, sums = one_step(obj, batch)
    out = model(**batch.model_inputs())
    losses = task_losses(out.logits_BSV, batch.labels_BS, batch.task_BS)
    want = weighted_total(losses, obj.weights) + sum(out.aux_losses.values())
    want = want + 0.01 * z_loss(out.logits_BSV, batch.labels_BS)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    trained_BS = batch.labels_BS != IGNORE_INDEX
    for i, t in enumerate(TASK_NAMES):
        assert sums.task_tokens[t] == int((trained_BS & (batch.task_BS == i)).sum())
    assert sums.tokens == batch.num_tokens() and sums.media == batch.grid_thw_M3.shape[0]
    assert sums.reduce(current_env(), CPU) is sums  # one process: nothing to reduce
    stats = obj.end_step(sums, grad_norm=1.0, skipped=False, started=0.0)
    assert stats.task_loss == {t: sums.task_ce[t] / sums.task_tokens[t] for t in TASK_NAMES
                               if sums.task_tokens[t]}
    assert stats.terms == {"visual_ssl": None, "visual_next": None} and stats.figures == {}
    assert set(obj.attn_stats) and all(a["keys_per_token"] > 0 for a in obj.attn_stats.values())


def test_gradnorm_gets_the_autograd_norms_of_the_task_means_at_the_lm_head(setup):
    make, model, batch = setup
    obj = objective(make, model, ["loss.balancer.kind=gradnorm"])
    _, sums = one_step(obj, batch)
    obj.end_step(sums, grad_norm=1.0, skipped=False, started=0.0)
    head = model.decoder.lm_head if model.decoder.lm_head is not None else model.decoder.embed
    out = model(**batch.model_inputs())
    losses = task_losses(out.logits_BSV, batch.labels_BS, batch.task_BS)
    for t in TASK_NAMES:
        if int(losses.count[t]):
            (g_VD,) = torch.autograd.grad(losses.mean(t), head.weight, retain_graph=True)
            assert obj.balancer.grad_norm[t] == pytest.approx(float(g_VD.norm()), rel=1e-4), t
    skipped = objective(make, model, ["loss.balancer.kind=gradnorm"])
    _, sums = one_step(skipped, batch)
    skipped.end_step(sums, grad_norm=float("nan"), skipped=True, started=0.0)
    assert skipped.balancer.grad_norm == {}  # a skipped step is not observed


def test_token_weighting_moves_the_loss_not_the_logged_sums(setup):
    make, model, batch = setup
    plain_loss, plain = one_step(objective(make, model), batch)
    tw_loss, weighted = one_step(objective(make, model, ["loss.token_weighting.strength=1"]), batch)
    assert dataclasses.replace(weighted, token_weighting=TokenWeightingSums()) == plain
    assert not torch.equal(tw_loss, plain_loss)
    tw = weighted.token_weighting
    assert tw.tokens == int(media_tokens(batch.labels_BS, batch.task_BS).sum()) and tw.seconds > 0
    figures = tw.figures(world=1)
    assert figures["top_decile_weight"] > 1 and figures["mean_delta"] >= 0


def test_the_ssl_term_adds_its_weight_times_the_masked_patch_loss(setup):
    make, model, batch = setup
    half_loss, half = one_step(objective(make, model, ["loss.visual_ssl.weight=0.5"]), batch)
    full_loss, full = one_step(objective(make, model, ["loss.visual_ssl.weight=1.0"]), batch)
    assert half.visual_ssl == full.visual_ssl > 0  # the same mask: a function of seed, step, batch
    torch.testing.assert_close(full_loss - half_loss, torch.tensor(0.5 * full.visual_ssl),
                               rtol=1e-5, atol=1e-6)
    obj = objective(make, model, ["loss.visual_ssl.weight=0.5"])
    stats = obj.end_step(half, grad_norm=1.0, skipped=False, started=0.0)
    assert stats.terms == {"visual_ssl": half.visual_ssl, "visual_next": None}


def test_the_visual_next_term_adds_its_weight_times_the_pixel_loss(setup):
    make, model, batch = setup
    model.zero_grad(set_to_none=True)
    off_loss, off = one_step(objective(make, model), batch)
    zero_loss, zero = one_step(objective(make, model, ["loss.visual_next.weight=0"]), batch)
    assert torch.equal(zero_loss, off_loss) and zero == off and zero.visual_next == 0
    zero_loss.backward()
    assert model.visual_head.weight.grad is None  # weight 0: not computed, no gradient
    half_loss, half = one_step(objective(make, model, ["loss.visual_next.weight=0.5"]), batch)
    full_loss, full = one_step(objective(make, model, ["loss.visual_next.weight=1.0"]), batch)
    assert half.visual_next == full.visual_next > 0
    torch.testing.assert_close(full_loss - half_loss, torch.tensor(0.5 * full.visual_next),
                               rtol=1e-5, atol=1e-6)
    stats = objective(make, model, ["loss.visual_next.weight=0.5"]).end_step(
        half, grad_norm=1.0, skipped=False, started=0.0)
    assert stats.terms == {"visual_ssl": None, "visual_next": half.visual_next}
    model.zero_grad(set_to_none=True)


def test_visual_next_targets_follow_the_pipelines_media_ids(setup):
    """On a batch the data pipeline packed: the fast mapping equals the loop over its media_ids."""
    _, model, batch = setup
    merge = model.cfg.vision.merge
    ref = next_targets_reference(batch.media_ids_BS, batch.patches_NP, batch.grid_thw_M3, merge)
    b_K, s_K = predicting_positions(batch.modality_BS, batch.grid_thw_M3, merge)
    assert len(ref) > 0 and [(b, s) for b, s, _ in ref] == list(zip(b_K.tolist(), s_K.tolist()))
    target_KT = next_targets(batch.patches_NP, batch.grid_thw_M3, merge, normalize=False)
    assert torch.equal(torch.stack([t for _, _, t in ref]), target_KT)


ALL_TERMS = ["loss.z_loss=0.01", "loss.visual_ssl.weight=0.5", "loss.visual_next.weight=0.5",
             "loss.contrast.weight=1.0", "loss.token_weighting.strength=0.5", "loss.balancer.kind=gradnorm"]


def _step_with_grads(obj: Objective, model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss, sums = one_step(obj, batch)
    loss.backward()
    for moe in model.moe_layers().values():
        moe.load_E.zero_()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sums, grads


def test_the_chunked_head_gives_the_references_loss_gradients_and_sums(setup):
    make, model, batch = setup
    ref = objective(make, model, ALL_TERMS)
    chunked = objective(make, model, [*ALL_TERMS, "loss.ce_chunk=37"])
    loss0, sums0, grads0 = _step_with_grads(ref, model, batch)
    loss1, sums1, grads1 = _step_with_grads(chunked, model, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert grads1.keys() == grads0.keys() and "decoder.embed.weight" in grads1
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=1e-4, atol=1e-6, msg=n)
    for t in TASK_NAMES:  # the counts exactly, the sums to rounding
        assert sums1.task_tokens[t] == sums0.task_tokens[t] and sums1.task_correct[t] == sums0.task_correct[t]
        assert sums1.task_ce[t] == pytest.approx(sums0.task_ce[t], rel=1e-6)
    assert sums1.contrast.docs == sums0.contrast.docs > 0
    assert sums1.contrast.gap == pytest.approx(sums0.contrast.gap, abs=1e-5)
    assert sums1.token_weighting.delta == pytest.approx(sums0.token_weighting.delta, rel=1e-4)
    for t, g_VD in ref._head_g.items():  # GradNorm's closed-form head gradients
        torch.testing.assert_close(chunked._head_g[t], g_VD, rtol=1e-4, atol=1e-7)


SYNCS = {torch.Tensor: ["__float__", "__int__", "__bool__", "item", "tolist", "nonzero", "unique"],
         torch: ["nonzero", "unique", "bincount"]}
OBJECTIVES = str(Path(__file__).resolve().parents[2] / "mmtrain" / "objectives")


def _record_syncs(monkeypatch) -> list[str]:
    """Wraps the calls that make the host wait for the device (and boolean-mask indexing) so
    that each one made from objectives/ code is recorded -- in backward too, where torch function
    modes are off."""
    seen: list[str] = []

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(OBJECTIVES):
                seen.append(f"{name} at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
            return fn(*args, **kwargs)
        return wrapper

    for owner, names in SYNCS.items():
        for name in names:
            monkeypatch.setattr(owner, name, spy(name, getattr(owner, name)))
    getitem = torch.Tensor.__getitem__

    def masked(self, index):
        flat = index if isinstance(index, tuple) else (index,)
        frame = sys._getframe(1)
        if (any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat)
                and frame.f_code.co_filename.startswith(OBJECTIVES)):
            seen.append(f"bool index at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        return getitem(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", masked)
    return seen


@pytest.mark.parametrize("chunk", [0, 37])
def test_a_plain_micro_batch_waits_on_the_device_nowhere_in_the_objective(setup, chunk):
    """z-loss and the MoE terms, a step that is not a log step: forward and backward."""
    make, model, batch = setup
    obj = objective(make, model, ["loss.z_loss=0.01", f"loss.ce_chunk={chunk}", "train.log_every=2"])
    sums = obj.begin_step(0)
    with pytest.MonkeyPatch.context() as mp:
        seen = _record_syncs(mp)
        obj.micro_batch(batch, sums).backward()
        assert seen == []
        obj.end_step(sums, grad_norm=1.0, skipped=False, started=0.0)  # the step's one read
        assert [s.split(" at ")[0] for s in seen] == ["tolist"]
    for moe in model.moe_layers().values():
        moe.load_E.zero_()


def test_the_chunked_head_runs_in_the_forwards_autocast_dtype(setup):
    """Under bf16 autocast the reference's logits are bf16 products; the chunked head, called after
    the forward, must form them in the same dtype (not in fp32, which moves every token's CE)."""
    make, model, batch = setup
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    sums = {}
    for name, chunk in [("ref", 0), ("chunked", 37)]:
        obj = objective(make, model, [f"loss.ce_chunk={chunk}"])
        obj.autocast = bf16
        torch.manual_seed(0)
        sums[name] = one_step(obj, batch)[1].task_ce
        for moe in model.moe_layers().values():
            moe.load_E.zero_()
    for t in TASK_NAMES:  # (fp32 logits would move the sums by about 5e-6 here)
        assert sums["chunked"][t] == pytest.approx(sums["ref"][t], rel=2e-6, abs=0)
