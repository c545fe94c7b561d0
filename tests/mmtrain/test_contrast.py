"""The mismatch contrast (`loss.contrast`): the swapped-media copies ride in the training forward
without moving the batch's own rows, the per-document gaps equal a slow reference, the term equals
the hinge of two separate forwards, and its gradient is exactly what depends on the pixels.

Legend: B rows, S sequence, R copied rows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from objective_steps import make_trainer, one_step

from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.contrast import ContrastRows, ContrastSums, document_gaps, extend
from mmtrain.objectives.mismatch import mismatch_media
from mmtrain.objectives.terms import blank_media, media_tokens, take_rows, task_losses, token_losses

MARGIN = 0.2


def _trainer(raw_for, tmp_path_factory, overrides=()) -> Trainer:
    return make_trainer(raw_for, tmp_path_factory, "contrast", overrides)


@pytest.fixture(scope="module")
def contrasted(raw_for, tmp_path_factory) -> Trainer:
    return _trainer(raw_for, tmp_path_factory, ["loss.contrast.weight=1.0", f"loss.contrast.margin={MARGIN}"])


@pytest.fixture(scope="module")
def batch(contrasted):
    """A train batch with rows without media-task tokens and >= 2 contrasted documents."""
    for batch, _ in zip(contrasted.train_loader, range(80)):
        rows = media_tokens(batch.labels_BS, batch.task_BS).any(1)
        _, extra = extend(batch)
        if extra is not None and int(rows.sum()) < len(rows) and _docs(extra) >= 2:
            return batch.to(contrasted.device)
    pytest.fail("no train batch has two contrasted documents and a row without media")


def _docs(extra: ContrastRows) -> int:
    """Documents (row, doc id) with a selected token."""
    r_T, s_T = extra.selected_RS.nonzero(as_tuple=True)
    return len(set(zip(r_T.tolist(), extra.doc_ids_RS[r_T, s_T].tolist())))


def _eval_logits(model, batch):
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**batch.model_inputs()).logits_BSV
    finally:
        model.train(was)


def test_the_copies_leave_the_batch_rows_unchanged_and_equal_a_swapped_forward(contrasted, batch):
    extended, extra = extend(batch)
    B = batch.labels_BS.shape[0]
    assert extended.labels_BS.shape[0] == B + len(extra.own_R) and len(extra.own_R) > 0
    both_BSV = _eval_logits(contrasted.raw_model, extended)
    torch.testing.assert_close(both_BSV[:B], _eval_logits(contrasted.raw_model, batch), rtol=1e-5, atol=1e-5)
    swapped, _ = mismatch_media(take_rows(batch, extra.own_R))  # copies of these rows, media swapped
    alone_RSV = _eval_logits(contrasted.raw_model, swapped)
    torch.testing.assert_close(both_BSV[B:], alone_RSV, rtol=1e-5, atol=1e-5)
    assert not torch.equal(swapped.patches_NP, take_rows(batch, extra.own_R).patches_NP)


def test_document_gaps_equal_a_loop_over_documents():
    gen = torch.Generator().manual_seed(3)
    R, S = 3, 30
    doc_ids_RS = torch.sort(torch.randint(0, 4, (R, S), generator=gen), dim=1).values.int()
    selected_RS = torch.rand(R, S, generator=gen) < 0.5
    ce_real_RS, ce_swap_RS = torch.rand(R, S, generator=gen) * 3, torch.rand(R, S, generator=gen) * 3
    rows = ContrastRows(R, torch.arange(R), selected_RS, doc_ids_RS)
    expect = []
    for r in range(R):  # documents in (row, doc id) order, as torch.unique sorts their keys
        for d in sorted(set(doc_ids_RS[r][selected_RS[r]].tolist())):
            sel_S = selected_RS[r] & (doc_ids_RS[r] == d)
            expect.append(float((ce_swap_RS[r] - ce_real_RS[r])[sel_S].mean()))
    torch.testing.assert_close(document_gaps(ce_real_RS, ce_swap_RS, rows), torch.tensor(expect))


def test_the_term_is_the_hinge_of_separate_forwards_and_logged_losses_stay(raw_for, tmp_path_factory,
                                                                         contrasted, batch):
    plain = _trainer(raw_for, tmp_path_factory)
    loss0, grads0, sums0 = one_step(plain, batch)
    loss1, grads1, sums1 = one_step(contrasted, batch)
    assert sums1.task_ce == sums0.task_ce and sums1.task_tokens == sums0.task_tokens  # same own rows
    # the reference: own and swapped forwards apart, a loop over the contrasted documents
    _, extra = extend(batch)
    swapped, _ = mismatch_media(take_rows(batch, extra.own_R))
    with torch.no_grad():
        ce_own_BS = task_losses(contrasted.model(**batch.model_inputs()).logits_BSV, batch.labels_BS,
                                batch.task_BS).ce_BS
        ce_swap_RS = token_losses(contrasted.model(**swapped.model_inputs()).logits_BSV, swapped.labels_BS)
    gaps_D = document_gaps(ce_own_BS[extra.own_R], ce_swap_RS, extra)
    hinge = float((MARGIN - gaps_D).clamp(min=0).mean())
    c = sums1.contrast
    assert c.docs == len(gaps_D) >= 2 and c.term == pytest.approx(hinge, abs=1e-5)
    assert c.gap == pytest.approx(float(gaps_D.sum()), abs=1e-4)
    assert float(loss1 - loss0) == pytest.approx(c.term, abs=1e-4)  # weight 1, one process
    assert sums0.contrast == ContrastSums()
    assert any(not torch.allclose(grads1[n], g) for n, g in grads0.items())


def test_with_identical_media_the_gradient_is_unchanged(raw_for, tmp_path_factory, contrasted, batch):
    """Every medium a flat grey: own and swapped media are the same pixels, the gap is 0, the term
    is the margin, and its gradient -- own-media minus swapped-media over the same text -- cancels:
    what the contrast trains is only what depends on the pixels (up to fp32 summation order)."""
    grey = blank_media(batch)
    no_aux = ["model.decoder.moe.seq_aux_weight=0", "model.decoder.moe.router_z_weight=0"]  # both are
    plain = _trainer(raw_for, tmp_path_factory, no_aux)  # means over every row, the copies' too
    loss0, grads0, _ = one_step(plain, grey)
    on = _trainer(raw_for, tmp_path_factory, [*no_aux, "loss.contrast.weight=1.0",
                                              f"loss.contrast.margin={MARGIN}"])
    loss1, grads1, sums1 = one_step(on, grey)
    assert sums1.contrast.docs >= 2 and sums1.contrast.gap == pytest.approx(0.0, abs=1e-5)
    assert float(loss1 - loss0) == pytest.approx(MARGIN, abs=1e-5)
    assert grads1.keys() == grads0.keys()
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=0, atol=1e-3 * float(g.abs().max()), msg=name)


def test_off_is_bit_identical(raw_for, tmp_path_factory, batch):
    plain = _trainer(raw_for, tmp_path_factory)
    off = _trainer(raw_for, tmp_path_factory, ["loss.contrast.weight=0", "loss.contrast.margin=0.5"])
    loss0, grads0, sums0 = one_step(plain, batch)
    loss1, grads1, sums1 = one_step(off, batch)
    assert torch.equal(loss1, loss0) and sums1 == sums0
    assert all(torch.equal(grads1[n], g) for n, g in grads0.items())


def test_a_tiny_run_with_the_contrast_trains_and_logs_it(raw_for, tmp_path_factory):
    trainer = _trainer(raw_for, tmp_path_factory, ["train.steps=4", "train.log_every=1",
                                                   "loss.contrast.weight=1.0", "data.batch_size=4"])
    trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "eval" not in r]
    assert steps and all(math.isfinite(r["loss"]) for r in steps)
    stats = [(r["contrast"], r["contrast_stats"]) for r in steps if "contrast_stats" in r]
    assert stats and all(s["docs"] >= 1 and 0 <= s["active"] <= 1 and term >= 0 for term, s in stats)
    for term, s in stats:  # every document still below the margin: the mean hinge is margin - mean gap
        if s["active"] == 1:
            assert term == pytest.approx(0.2 - s["train_gap"], abs=1e-5)  # the default margin
    assert trainer.step == 4 and trainer.state.skipped_steps == 0
