"""The mismatch gap: media swapped across documents (mismatch.mismatch_media) and its diagnostics signal.

mismatch_media on hand-built batches (groups by kind and grid, interleaved documents, a lone medium)
and on the tiny corpus's val batches: every new block is an original block of the same kind and grid
from another document, a permutation of the group's blocks whenever one exists, and the mask is
exactly the tokens of the documents that got a foreign medium. In the diagnostics: zero when the pixels
cannot reach the text, measured on the same tokens as the real loss, no entry without swapped tokens,
and switching it off changes no other signal.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest
import torch

from mmtrain.data_pipelines.batch import IGNORE_INDEX, IMAGE, MEDIA_TASKS, TASK_NAMES, VIDEO, PackedBatch
from mmtrain.evaluation.diagnostics import DiagConfig, DiagResult, run_diagnostics
from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.mismatch import mismatch_media
from mmtrain.objectives.terms import task_losses

PATCH_DIM = 5


def _batch(rows: list[list[list[tuple[int, tuple[int, int, int]]]]], seq_len: int = 24) -> PackedBatch:
    """rows -> documents -> media (kind, grid). Each document: a text token, two placeholder tokens
    per medium, a text token; padding (document -1) fills the row. Pixels: distinct random blocks."""
    B, S = len(rows), seq_len
    tokens = torch.zeros(B, S, dtype=torch.long)
    doc = torch.full((B, S), -1, dtype=torch.int32)
    modality = torch.zeros(B, S, dtype=torch.int8)
    task = torch.full((B, S), -1, dtype=torch.int8)
    media_ids = torch.full((B, S), -1, dtype=torch.int32)
    grids, kinds = [], []
    for r, docs in enumerate(rows):
        s = 0
        for d, media in enumerate(docs):
            start = s
            s += 1
            for kind, grid in media:
                media_ids[r, s:s + 2], modality[r, s:s + 2] = len(grids), kind
                grids.append(grid)
                kinds.append(kind)
                s += 2
            s += 1
            doc[r, start:s] = d
            task[r, start:s] = 1 if all(k == IMAGE for k, _ in media) else 2
        assert s <= S
    labels = torch.where(doc >= 0, torch.arange(S).expand(B, S), IGNORE_INDEX)
    grid_M3 = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    torch.manual_seed(0)
    return PackedBatch(
        tokens_BS=tokens, labels_BS=labels, doc_ids_BS=doc,
        span_ids_BS=torch.full((B, S), -1, dtype=torch.int32),
        modality_BS=modality, task_BS=task, pos_ids_3BS=torch.arange(S).expand(3, B, S).contiguous(),
        media_ids_BS=media_ids, patches_NP=torch.randn(int(grid_M3.prod(1).sum()), PATCH_DIM),
        grid_thw_M3=grid_M3, media_kind_M=torch.tensor(kinds, dtype=torch.int8))


def _blocks(batch: PackedBatch, patches_NP: torch.Tensor | None = None) -> list[torch.Tensor]:
    patches_NP = batch.patches_NP if patches_NP is None else patches_NP
    return list(patches_NP.split(batch.grid_thw_M3.prod(1).tolist()))


def _doc_of_media(batch: PackedBatch) -> list[tuple[int, int]]:
    out = []
    for m in range(batch.media_kind_M.shape[0]):
        r, s = (batch.media_ids_BS == m).nonzero()[0].tolist()
        out.append((r, int(batch.doc_ids_BS[r, s])))
    return out


def _check_mismatch(batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor, set[tuple[int, int]]]:
    """The properties of every mismatched batch; -> it, the mask, the documents given a foreign medium."""
    new, swapped_BS = mismatch_media(batch)
    for f in fields(batch):  # the token layout is unchanged: only the pixels move
        if f.name != "patches_NP":
            assert torch.equal(getattr(new, f.name), getattr(batch, f.name)), f.name
    old_blocks, new_blocks, docs = _blocks(batch), _blocks(batch, new.patches_NP), _doc_of_media(batch)
    kinds, grids = batch.media_kind_M.tolist(), batch.grid_thw_M3.tolist()
    foreign = set()
    for m, block in enumerate(new_blocks):
        sources = [s for s, old in enumerate(old_blocks)
                   if kinds[s] == kinds[m] and grids[s] == grids[m] and torch.equal(old, block)]
        assert sources, f"medium {m}: not an original block of its kind and grid"
        moved = not torch.equal(block, old_blocks[m])
        if moved:
            assert all(docs[s] != docs[m] for s in sources), f"medium {m} got a block of its own document"
            foreign.add(docs[m])
        # A medium is swapped exactly when its (kind, grid) group spans several documents.
        group_docs = {docs[s] for s in range(len(kinds)) if kinds[s] == kinds[m] and grids[s] == grids[m]}
        assert moved == (len(group_docs) > 1), m
    rows_BS = torch.arange(batch.doc_ids_BS.shape[0])[:, None].expand_as(batch.doc_ids_BS)
    expected_BS = torch.zeros_like(swapped_BS)
    for r, d in foreign:
        expected_BS |= (rows_BS == r) & (batch.doc_ids_BS == d)
    assert swapped_BS.dtype == torch.bool and torch.equal(swapped_BS, expected_BS)
    return new, swapped_BS, foreign


def _same_blocks(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """a and b hold the same blocks, counted with multiplicity."""
    return sorted(x.flatten().tolist() for x in a) == sorted(x.flatten().tolist() for x in b)


IMG_A, IMG_B, IMG_C = (IMAGE, (1, 2, 2)), (IMAGE, (1, 4, 2)), (IMAGE, (1, 2, 4))
VID_A, VID_B = (VIDEO, (1, 2, 2)), (VIDEO, (2, 2, 2))


def test_mismatch_media_swaps_across_documents_within_kind_and_grid():
    batch = _batch([
        [[IMG_A, IMG_A], [IMG_A]],  # an interleaved document with two images of grid A, then one
        [[IMG_A], [IMG_B, IMG_B, IMG_B]],  # ... and a document holding 3 of the 4 media of grid B
        [[IMG_B], [IMG_C], [VID_A]],  # grid C and the video of grid A's shape: alone, kept
        [[VID_B], [VID_B]],
    ])
    new, swapped_BS, foreign = _check_mismatch(batch)
    assert foreign == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1)}
    assert swapped_BS[2, 4:].sum() == 0 and swapped_BS[2, :4].all()  # (2, 1) and (2, 2) keep their media
    old_blocks, new_blocks = _blocks(batch), _blocks(batch, new.patches_NP)
    groups = {}
    for m, (kind, grid) in enumerate(zip(batch.media_kind_M.tolist(), batch.grid_thw_M3.tolist())):
        groups.setdefault((kind, *grid), []).append(m)
    # No document holds more than half of image grid A or of the videos: a permutation of their blocks.
    for key in ((IMAGE, 1, 2, 2), (VIDEO, 2, 2, 2)):
        assert _same_blocks([new_blocks[m] for m in groups[key]], [old_blocks[m] for m in groups[key]])
    # Grid B: one document holds 3 of 4, so its media all get the other document's single one.
    b_media = groups[(IMAGE, 1, 4, 2)]
    lone = b_media[-1]
    assert all(torch.equal(new_blocks[m], old_blocks[lone]) for m in b_media[:-1])
    assert mismatch_media(batch)[0].patches_NP.equal(new.patches_NP)  # deterministic


@pytest.mark.parametrize("rows", [
    [[[IMG_A]]],  # one medium
    [[[IMG_A, IMG_A, IMG_B]], [[]]],  # every medium in one document
    [[[IMG_A], [VID_A], [IMG_B]]],  # several documents, but no two share kind and grid
    [[[]]],  # no media
])
def test_mismatch_media_swaps_nothing_without_a_partner(rows):
    batch = _batch(rows)
    new, swapped_BS, foreign = _check_mismatch(batch)
    assert not foreign and not swapped_BS.any() and torch.equal(new.patches_NP, batch.patches_NP)


def test_a_medium_without_tokens_is_left_alone():
    batch = _batch([[[IMG_A], [IMG_A], [IMG_A]]])
    batch.media_ids_BS[batch.media_ids_BS == 1] = -1  # medium 1 lost its placeholders
    new, swapped_BS = mismatch_media(batch)
    old_blocks, new_blocks = _blocks(batch), _blocks(batch, new.patches_NP)
    assert torch.equal(new_blocks[1], old_blocks[1])
    assert torch.equal(new_blocks[0], old_blocks[2]) and torch.equal(new_blocks[2], old_blocks[0])
    doc_S = batch.doc_ids_BS[0]
    assert swapped_BS[0, doc_S == 1].sum() == 0 and swapped_BS[0, doc_S == 0].all()


# ---- on the tiny corpus and model -------------------------------------------------------------------


def _trainer(make_config, run_dir, *overrides) -> Trainer:
    return Trainer(make_config(run_dir, ["train.ckpt_every=0", *overrides]), verbose=False)


def _row(batch: PackedBatch, r: int) -> PackedBatch:
    """Row r alone, its media renumbered from 0."""
    ids = batch.media_ids_BS[r][batch.media_ids_BS[r] >= 0]
    lo, hi = (int(ids.min()), int(ids.max()) + 1) if ids.numel() else (0, 0)
    sizes = batch.grid_thw_M3.prod(1).tolist()
    n0, n1 = sum(sizes[:lo]), sum(sizes[:hi])
    one = {f.name: getattr(batch, f.name)[r:r + 1] for f in fields(batch) if f.name.endswith("_BS")}
    one["media_ids_BS"] = torch.where(one["media_ids_BS"] >= 0, one["media_ids_BS"] - lo, -1)
    return PackedBatch(**one, pos_ids_3BS=batch.pos_ids_3BS[:, r:r + 1],
                       patches_NP=batch.patches_NP[n0:n1], grid_thw_M3=batch.grid_thw_M3[lo:hi],
                       media_kind_M=batch.media_kind_M[lo:hi])


@pytest.fixture
def tiny(make_config, tmp_path) -> Trainer:
    return _trainer(make_config, tmp_path / "run")


def test_mismatch_media_on_val_batches(tiny):
    swapped_tasks = set()
    for batch in tiny.val_batches():
        _, swapped_BS, foreign = _check_mismatch(batch)
        assert foreign
        swapped_tasks |= {TASK_NAMES[t] for t in batch.task_BS[swapped_BS].unique().tolist()}
        for r in range(batch.doc_ids_BS.shape[0]):
            _check_mismatch(_row(batch, r))
    assert swapped_tasks == set(MEDIA_TASKS), "test setup: both media tasks need swapped documents"


def _diagnose(tr: Trainer, data: list[PackedBatch] | None = None, **cfg) -> DiagResult:
    return run_diagnostics(tr.model, tr.val_batches() if data is None else data, tr.device,
                           DiagConfig(warmup_steps=0, **cfg), 0, raw_model=tr.raw_model)


def test_mismatch_gap_is_zero_when_media_cannot_reach_the_text(tiny):
    with torch.no_grad():  # visual tokens become 0 whatever the pixels
        tiny.raw_model.vision.projector.w_out.weight.zero_()
    result = _diagnose(tiny)
    assert set(result.mismatch_gap) == set(MEDIA_TASKS)
    assert all(n > 0 for n in result.mismatch_tokens.values())
    assert result.mismatch_gap == dict.fromkeys(MEDIA_TASKS, 0.0), result.mismatch_gap


def test_mismatch_gap_is_measured_on_the_swapped_tokens(tiny):
    """The two losses of the gap, recomputed directly: the same tokens with own and with swapped media."""
    result = _diagnose(tiny)
    model = tiny.raw_model.eval()
    sums = {t: [0.0, 0.0, 0] for t in MEDIA_TASKS}
    with torch.no_grad():
        for batch in tiny.val_batches()[:2]:
            mismatched, swapped_BS = mismatch_media(batch)
            labels_BS = batch.labels_BS.masked_fill(~swapped_BS, IGNORE_INDEX)
            real = task_losses(model(**batch.model_inputs()).logits_BSV, labels_BS, batch.task_BS)
            swap = task_losses(model(**mismatched.model_inputs()).logits_BSV, labels_BS, batch.task_BS)
            for t in MEDIA_TASKS:
                sums[t][0] += float(real.loss_sum[t])
                sums[t][1] += float(swap.loss_sum[t])
                sums[t][2] += int(real.count[t])
    assert result.mismatch_tokens == {t: n for t, (_, _, n) in sums.items() if n}
    assert all(result.mismatch_tokens[t] <= result.tokens[t] for t in result.mismatch_tokens)
    for t, (real_sum, swap_sum, n) in sums.items():
        assert result.mismatch_real_loss[t] == pytest.approx(real_sum / n, rel=1e-5)
        assert result.mismatch_loss[t] == pytest.approx(swap_sum / n, rel=1e-5)
        assert result.mismatch_gap[t] != 0.0  # an untrained model still reads the pixels


def test_nothing_swapped_gives_no_mismatch_entry(tiny):
    lone = [_row(b, r) for b in tiny.val_batches() for r in range(b.doc_ids_BS.shape[0])]
    lone = [b for b in lone if b.media_kind_M.numel() and not mismatch_media(b)[1].any()]
    assert lone, "test setup: a val row whose media have no partner"
    result = _diagnose(tiny, lone[:1], batches=1)
    assert result.loss and result.mismatch_gap == {} and result.mismatch_tokens == {}
    assert not any(k.startswith("diag/mismatch") for k in result.scalars())
    assert all(math.isfinite(v) for v in result.scalars().values())


def test_switching_mismatch_off_changes_no_other_signal(tiny):
    on, off = _diagnose(tiny), _diagnose(tiny, mismatch=False)
    assert off.mismatch_gap == {} and "mismatch" not in off.seconds and on.seconds["mismatch"] > 0
    a, b = on.to_dict(), off.to_dict()
    for key in ("mismatch_gap", "mismatch_loss", "mismatch_real_loss", "mismatch_tokens", "seconds",
                "config", "alarms"):  # alarms: reading is judged by the mismatch gap when there is one
        a.pop(key), b.pop(key)
    assert a == b
    assert not any(alarm.startswith("reliance gap") for alarm in on.alarms())
    assert not any(alarm.startswith("mismatch gap") for alarm in off.alarms())


def test_history_and_scalars_carry_the_mismatch_gap(tiny):
    result = _diagnose(tiny)
    scalars = result.scalars()
    for task in MEDIA_TASKS:
        for key in (f"diag/mismatch_gap_{task}", f"diag/mismatch_loss_{task}"):
            assert math.isfinite(scalars[key]), key
    history = json.loads(json.dumps(result.to_dict()))
    assert history["mismatch_gap"] == result.mismatch_gap
    assert history["mismatch_tokens"] == result.mismatch_tokens
    assert history["reliance_gap"] == result.reliance_gap and history["config"]["mismatch"] is True
    assert set(history["seconds"]) >= {"real", "stats", "blank", "mismatch", "total"}
    passes = sum(v for k, v in history["seconds"].items() if k != "total")
    assert all(v > 0 for v in history["seconds"].values()) and passes <= history["seconds"]["total"]


def test_mismatch_switch_from_the_config(make_config, tmp_path):
    assert make_config(tmp_path / "a").diagnostics.mismatch is True
    assert make_config(tmp_path / "b", ["diagnostics.mismatch=false"]).diagnostics.mismatch is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="^mismatch: must be true or false"):
            DiagConfig(mismatch=bad)
