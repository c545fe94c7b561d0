"""Token reliance weighting (`loss.token_weighting`): the weights' math, the row subset the blank
forward runs on, and the trainer's use of both (off = bit-identical, no training state touched).

Legend: B rows, S sequence, V vocabulary, R rows taken.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from objective_steps import make_trainer, one_step

from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_IMAGE_TEXT, TASK_TEXT, TASK_VIDEO_TEXT
from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.terms import (
    blank_media,
    media_tokens,
    reliance_weights,
    reweighted,
    take_rows,
    task_losses,
)
from mmtrain.objectives.token_weighting import TokenWeightingSums


# ----- the weights --------------------------------------------------------------------------------
def _tokens(seed: int = 0, B: int = 3, S: int = 40, V: int = 11):
    """Random logits, labels (some ignored) and tasks: row 0 text, row 1 image_text, row 2 mixed."""
    gen = torch.Generator().manual_seed(seed)
    logits_BSV = torch.randn(B, S, V, generator=gen)
    labels_BS = torch.randint(0, V, (B, S), generator=gen)
    labels_BS[torch.rand(B, S, generator=gen) < 0.2] = IGNORE_INDEX
    task_BS = torch.full((B, S), TASK_TEXT, dtype=torch.int8)
    task_BS[1] = TASK_IMAGE_TEXT
    task_BS[2, : S // 2] = TASK_VIDEO_TEXT
    task_BS[2, S // 2:] = TASK_IMAGE_TEXT
    ce_blank_BS = torch.rand(B, S, generator=gen) * 3
    return logits_BSV, labels_BS, task_BS, ce_blank_BS


@pytest.mark.parametrize("strength", [0.3, 1.0])
def test_weights_average_one_per_media_task_and_text_tokens_keep_one(strength):
    logits_BSV, labels_BS, task_BS, ce_blank_BS = _tokens()
    ce_real_BS = task_losses(logits_BSV, labels_BS, task_BS).ce_BS
    w_BS = reliance_weights(ce_real_BS, ce_blank_BS, labels_BS, task_BS, strength, floor=0.05)
    trained_BS = labels_BS != IGNORE_INDEX
    for task in (TASK_IMAGE_TEXT, TASK_VIDEO_TEXT):
        sel_BS = trained_BS & (task_BS == task)
        assert w_BS[sel_BS].mean().item() == pytest.approx(1.0, abs=1e-6)
        assert w_BS[sel_BS].std() > 0.05 and w_BS[sel_BS].min() >= 1 - strength
    assert (w_BS[~media_tokens(labels_BS, task_BS)] == 1).all()


def test_a_larger_delta_gets_a_larger_weight():
    _, labels_BS, task_BS, _ = _tokens()
    sel_BS = media_tokens(labels_BS, task_BS) & (task_BS == TASK_IMAGE_TEXT)
    ce_real_BS = torch.full(labels_BS.shape, 2.0)
    delta_BS = torch.zeros(labels_BS.shape)
    delta_BS[sel_BS] = torch.linspace(-1.0, 2.0, int(sel_BS.sum()))  # increasing, some below 0
    w_BS = reliance_weights(ce_real_BS, ce_real_BS + delta_BS, labels_BS, task_BS, 0.5, floor=0.05)
    w_T, delta_T = w_BS[sel_BS], delta_BS[sel_BS]
    assert (w_T[delta_T > 0].diff() > 0).all()  # strictly increasing with a positive delta
    assert (w_T[delta_T <= 0] == w_T[0]).all() and w_T[0] < w_T[-1]  # a negative delta counts as 0


@pytest.mark.parametrize("delta", [0.7, -0.3])
def test_equal_deltas_leave_the_loss_unchanged(delta):
    logits_BSV, labels_BS, task_BS, _ = _tokens(seed=1)
    losses = task_losses(logits_BSV, labels_BS, task_BS)
    ce_real_BS = losses.ce_BS.detach()
    w_BS = reliance_weights(ce_real_BS, ce_real_BS + delta, labels_BS, task_BS, 0.8, floor=0.05)
    weighted = reweighted(losses, w_BS, labels_BS, task_BS)
    for task, total in losses.loss_sum.items():
        torch.testing.assert_close(weighted.loss_sum[task], total)
        assert weighted.count[task] is losses.count[task]


def test_strength_zero_weights_are_exactly_one():
    logits_BSV, labels_BS, task_BS, ce_blank_BS = _tokens(seed=2)
    ce_real_BS = task_losses(logits_BSV, labels_BS, task_BS).ce_BS
    assert (reliance_weights(ce_real_BS, ce_blank_BS, labels_BS, task_BS, 0.0, floor=0.05) == 1).all()


# ----- the trainer --------------------------------------------------------------------------------
def _trainer(raw_for, tmp_path_factory, overrides=()) -> Trainer:
    return make_trainer(raw_for, tmp_path_factory, "token-weighting", overrides)


@pytest.fixture(scope="module")
def weighted(raw_for, tmp_path_factory) -> Trainer:
    return _trainer(raw_for, tmp_path_factory, ["loss.token_weighting.strength=0.5"])


@pytest.fixture(scope="module")
def batch(weighted):
    """A train batch whose media-task rows are some, not all, of its rows and not only the first:
    taking them renumbers media."""
    for batch, _ in zip(weighted.train_loader, range(50)):
        rows = media_tokens(batch.labels_BS, batch.task_BS).any(1)
        if 0 < int(rows.sum()) < len(rows) and rows[1:].any() and batch.grid_thw_M3.shape[0] > 1:
            return batch.to(weighted.device)
    pytest.fail("no train batch mixes rows with and without media-task tokens")


def _rows(batch) -> torch.Tensor:
    return media_tokens(batch.labels_BS, batch.task_BS).any(1).nonzero().squeeze(1)


def test_take_rows_keeps_the_rows_logits_and_renumbers_their_media(weighted, batch):
    model, rows_R = weighted.raw_model, _rows(batch)
    sub = take_rows(batch, rows_R)
    ids = sub.media_ids_BS[sub.media_ids_BS >= 0]
    assert ids.unique().tolist() == list(range(sub.grid_thw_M3.shape[0]))
    assert (ids.diff() >= 0).all()  # row-major order kept
    assert sub.patches_NP.shape[0] == int(sub.grid_thw_M3.prod(-1).sum())
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            full_RSV = model(**batch.model_inputs()).logits_BSV[rows_R]
            part_RSV = model(**sub.model_inputs()).logits_BSV
    finally:
        model.train(was)
    torch.testing.assert_close(part_RSV, full_RSV, rtol=1e-5, atol=1e-5)


def test_take_rows_of_a_batch_without_media():
    """A pipeline's row part of a media-free batch (the hang fuzz's): the rows, no media, no error."""
    from mmtrain.objectives.terms import cat_rows, dummy_batch

    batch = cat_rows(dummy_batch(16, 12), dummy_batch(16, 12))
    part = take_rows(batch, torch.tensor([1]))
    assert part.tokens_BS.shape == (1, 16) and (part.media_ids_BS == -1).all()
    assert part.grid_thw_M3.shape == (0, 3) and part.patches_NP.shape == (0, 12)


def _snapshot(trainer: Trainer) -> dict:
    named = [*trainer.raw_model.named_parameters(), *trainer.raw_model.named_buffers()]
    return {"tensors": {k: v.detach().clone() for k, v in named},
            "rng": torch.get_rng_state(), "flags": [m.training for m in trainer.model.modules()]}


def test_the_blank_forward_leaves_training_state_alone(weighted, batch):
    weighted.model.train()
    moe = next(iter(weighted.raw_model.moe_layers().values()))
    before, sums = _snapshot(weighted), TokenWeightingSums()
    ce_blank_BS = weighted.objective.token_weighting.blank_ce(batch, None, sums)
    after = _snapshot(weighted)
    assert after["flags"] == before["flags"] and all(before["flags"])
    assert torch.equal(after["rng"], before["rng"])
    for name, t in before["tensors"].items():
        assert torch.equal(after["tensors"][name], t), name  # params, MoE load_E and expert_bias_E
    assert sums.seconds > 0
    # it is the blanked batch's CE on the media rows (0 elsewhere) ...
    rows_R = _rows(batch)
    with torch.no_grad():
        weighted.model.eval()
        logits_BSV = weighted.model(**blank_media(batch).model_inputs()).logits_BSV
        weighted.model.train()
    ce_BS = task_losses(logits_BSV, batch.labels_BS, batch.task_BS).ce_BS
    torch.testing.assert_close(ce_blank_BS[rows_R], ce_BS[rows_R], rtol=1e-5, atol=1e-5)
    assert (ce_blank_BS[[r for r in range(len(ce_BS)) if r not in rows_R.tolist()]] == 0).all()
    # ... and the check above would have seen a training forward's load statistics
    load_E = moe.load_E.clone()
    with torch.no_grad():
        weighted.model(**batch.model_inputs())
    assert not torch.equal(moe.load_E, load_E)
    moe.load_E.zero_()


def test_off_is_bit_identical_and_on_keeps_the_logged_losses(raw_for, tmp_path_factory, weighted, batch):
    plain = _trainer(raw_for, tmp_path_factory)  # no token_weighting in the config
    off = _trainer(raw_for, tmp_path_factory, ["loss.token_weighting.strength=0",
                                              "loss.token_weighting.floor=0.5"])
    loss0, grads0, acc0 = one_step(plain, batch)
    loss1, grads1, acc1 = one_step(off, batch)
    assert torch.equal(loss1, loss0) and grads1.keys() == grads0.keys()
    assert all(torch.equal(grads1[n], g) for n, g in grads0.items())
    assert acc1 == acc0 and acc1.token_weighting.seconds == 0
    # on: the same forward (logged, balanced task losses unchanged), another objective and gradient
    loss2, grads2, acc2 = one_step(weighted, batch)
    assert dataclasses.replace(acc2, token_weighting=TokenWeightingSums()) == acc0
    assert not torch.equal(loss2, loss0)
    assert any(not torch.equal(grads2[n], g) for n, g in grads0.items())
    n = int(media_tokens(batch.labels_BS, batch.task_BS).sum())
    tw = acc2.token_weighting
    assert tw.tokens == n and tw.seconds > 0 and tw.delta >= 0
    assert tw.top_n == math.ceil(n / 10) and tw.top / tw.top_n > 1


def test_a_tiny_run_with_token_weighting_trains(raw_for, tmp_path_factory):
    trainer = _trainer(raw_for, tmp_path_factory, ["train.steps=3", "loss.token_weighting.strength=0.5",
                                                   "data.batch_size=2"])
    trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "eval" not in r]
    assert len(losses) >= 1 and all(math.isfinite(v) for v in losses)
    assert trainer.step == 3 and trainer.state.skipped_steps == 0
