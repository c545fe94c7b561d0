"""The held-out eval's mismatch gap (evaluate.evaluate, dist_eval): the verdict on reading the pixels.

Exactly zero when the pixels cannot reach the text, positive for a model whose predictions come from
its own document's pixels, the same as the diagnostics' on the same batch, additive over batches (what
the ranks' all-reduce relies on), and over 2 gloo ranks (uneven counts, padded) the one-process value.
Run as a script under torchrun, the file is that 2-rank worker: `... test_eval_mismatch.py IN OUT`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from torch import nn

from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    IMAGE,
    MEDIA_TASKS,
    TASK_NAMES,
    TEXT,
    VIDEO,
    PackedBatch,
)
from mmtrain.evaluation.diagnostics import DiagConfig, run_diagnostics
from mmtrain.evaluation.dist_eval import evaluate_ranks
from mmtrain.evaluation.evaluate import EvalResult, evaluate
from mmtrain.evaluation.report import summary_table
from mmtrain.objectives.terms import dummy_batch

V = 8  # classes of the pixel reader = patch dim
SEQ = 32
TAIL = 3  # trained text tokens after a document's medium


class PixelReader(nn.Module):
    """Every token's logits: the one patch of its document's medium (zeros in documents without one).
    For _batch's layout: a medium is one patch and two consecutive placeholder tokens."""

    def forward(self, doc_ids_BS, modality_BS, patches_NP, **_):
        B, S = doc_ids_BS.shape
        span = S + 1
        key_BS = torch.arange(B)[:, None] * span + doc_ids_BS.long() + 1  # padding: 0 of its row
        visual_BS = modality_BS != TEXT
        medium_of_key = torch.full((B * span,), -1, dtype=torch.long)
        medium_of_key[key_BS[visual_BS]] = torch.arange(int(visual_BS.sum())) // 2
        padded_NP = torch.cat([torch.zeros(1, patches_NP.shape[1]), patches_NP])
        return SimpleNamespace(logits_BSV=padded_NP[medium_of_key[key_BS] + 1])


def _batch(kinds_per_row: list[list[int | None]]) -> PackedBatch:
    """Rows of documents, each IMAGE or VIDEO with one medium (grid 1x1x1) or None (text only): a text
    token, 2 placeholders, TAIL trained tokens labelled with the document's class; its patch is
    6 x one-hot(class). Classes are random and differ between the documents of one kind."""
    B, S = len(kinds_per_row), SEQ
    t = {name: torch.full((B, S), -1, dtype=dtype) for name, dtype in
         (("doc", torch.int32), ("task", torch.int8), ("labels", torch.long))}
    modality = torch.zeros(B, S, dtype=torch.int8)
    classes = {kind: iter(torch.randperm(V).tolist()) for kind in (IMAGE, VIDEO, None)}
    kinds, patches = [], []
    for r, docs in enumerate(kinds_per_row):
        for d, kind in enumerate(docs):
            s, c = d * (3 + TAIL), next(classes[kind])
            t["doc"][r, s:s + 3 + TAIL] = d
            t["task"][r, s:s + 3 + TAIL] = TASK_NAMES.index({IMAGE: "image_text", VIDEO: "video_text",
                                                            None: "text"}[kind])
            t["labels"][r, s + 3:s + 3 + TAIL] = c
            if kind is not None:
                modality[r, s + 1:s + 3] = kind
                kinds.append(kind)
                patches.append(6.0 * torch.nn.functional.one_hot(torch.tensor(c), V).float())
    media_ids = torch.full((B, S), -1, dtype=torch.int32)
    media_ids[modality != TEXT] = torch.arange(len(kinds)).repeat_interleave(2).int()
    return PackedBatch(
        tokens_BS=torch.zeros(B, S, dtype=torch.long), labels_BS=t["labels"].masked_fill(t["labels"] < 0,
                                                                                       IGNORE_INDEX),
        doc_ids_BS=t["doc"], span_ids_BS=torch.full((B, S), -1, dtype=torch.int32), modality_BS=modality,
        task_BS=t["task"], pos_ids_3BS=torch.arange(S).expand(3, B, S).contiguous(), media_ids_BS=media_ids,
        patches_NP=torch.stack(patches), grid_thw_M3=torch.ones(len(kinds), 3, dtype=torch.long),
        media_kind_M=torch.tensor(kinds, dtype=torch.int8))


def _batches() -> list[PackedBatch]:
    return [_batch([[IMAGE, VIDEO, None, IMAGE], [VIDEO, IMAGE]]), _batch([[IMAGE, IMAGE], [VIDEO, VIDEO]]),
            _batch([[VIDEO, None, IMAGE, VIDEO, IMAGE]])]


def _same(a: EvalResult, b: EvalResult, rel: float) -> None:
    for name in ("loss", "accuracy", "blank_loss", "mismatch_loss", "mismatch_real_loss", "mismatch_gap"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], rel=rel, abs=1e-12) for k in x), name
    assert a.tokens == b.tokens and a.mismatch_tokens == b.mismatch_tokens


# ---- a model that reads its own document's pixels ---------------------------------------------------


def test_a_model_that_reads_the_pixels_has_a_positive_mismatch_gap():
    batches = _batches()
    result = evaluate(PixelReader(), batches, torch.device("cpu"))
    assert set(result.mismatch_gap) == set(MEDIA_TASKS)
    assert all(gap > 4.0 for gap in result.mismatch_gap.values()), result.mismatch_gap
    assert all(result.mismatch_real_loss[t] < 0.1 for t in MEDIA_TASKS)  # own pixels: the right class
    # every media document has a partner of its kind: the swapped tokens are all media tokens
    assert result.mismatch_tokens == {t: result.tokens[t] for t in MEDIA_TASKS}
    assert result.mismatch_real_loss == pytest.approx({t: result.loss[t] for t in MEDIA_TASKS})
    assert "text" in result.loss and "text" not in result.mismatch_gap


def test_records_and_scalars_carry_both_gaps():
    result = evaluate(PixelReader(), _batches(), torch.device("cpu"))
    scalars = result.scalars()
    for task in MEDIA_TASKS:
        assert scalars[f"val/mismatch_gap_{task}"] == result.mismatch_gap[task]
        assert scalars[f"val/reliance_gap_{task}"] == result.reliance_gap[task]
    record = json.loads(json.dumps(result.to_dict()))
    assert record["mismatch_gap"] == result.mismatch_gap and record["reliance_gap"] == result.reliance_gap
    assert record["mismatch_tokens"] == result.mismatch_tokens
    _same(EvalResult.from_sums(result.sums_TC()), result, rel=1e-12)


def test_sums_add_over_batches():
    """What the ranks' all-reduce relies on: the sums of evaluations of parts = one of the whole."""
    batches = _batches()
    whole = evaluate(PixelReader(), batches, torch.device("cpu"))
    parts = sum(evaluate(PixelReader(), [b], torch.device("cpu")).sums_TC() for b in batches)
    _same(EvalResult.from_sums(parts), whole, rel=1e-9)


def test_the_final_table_shows_the_mismatch_gap_as_the_verdict():
    end = evaluate(PixelReader(), _batches(), torch.device("cpu")).to_dict()
    start = {k: v for k, v in end.items() if not k.startswith("mismatch")}  # a record from before it
    table = summary_table({"run_dir": "r", "start": {"step": 0, **start}, "end": {"step": 9, **end}})
    console = Console(width=250, record=True)
    console.print(table)
    text = console.export_text()
    assert "reads pixels start" in text and "blanked gap end" in text and "the verdict" in table.caption
    row = next(line for line in text.splitlines() if "image_text" in line)
    gaps = [f"{g:+.3f}" for g in (end["mismatch_gap"]["image_text"], end["reliance_gap"]["image_text"])]
    assert [c.strip() for c in row.split("│")[5:9]] == ["-", gaps[0], gaps[1], gaps[1]], row


# ---- the tiny model -----------------------------------------------------------------------------------


@pytest.fixture
def tiny(make_config, tmp_path):
    from mmtrain.loop.trainer import Trainer

    return Trainer(make_config(tmp_path / "run", ["train.ckpt_every=0"]), verbose=False)


def test_pixel_blind_model_has_mismatch_gap_exactly_zero(tiny):
    with torch.no_grad():  # visual tokens become 0 whatever the pixels
        tiny.raw_model.vision.projector.w_out.weight.zero_()
    result = evaluate(tiny.model, tiny.val_batches(), tiny.device)
    assert set(result.mismatch_gap) == set(MEDIA_TASKS)
    assert all(0 < result.mismatch_tokens[t] <= result.tokens[t] for t in MEDIA_TASKS)
    assert result.mismatch_gap == dict.fromkeys(MEDIA_TASKS, 0.0), result.mismatch_gap
    assert result.reliance_gap == dict.fromkeys(MEDIA_TASKS, 0.0), result.reliance_gap


def test_one_batch_gives_the_diagnostics_gaps(tiny):
    for batch in tiny.val_batches():
        ours = evaluate(tiny.model, [batch], tiny.device)
        diag = run_diagnostics(tiny.model, [batch], tiny.device, DiagConfig(batches=1), 0,
                               raw_model=tiny.raw_model)
        assert ours.mismatch_tokens == diag.mismatch_tokens and diag.mismatch_tokens
        for name in ("mismatch_loss", "mismatch_real_loss", "mismatch_gap", "blank_loss", "reliance_gap"):
            assert getattr(ours, name) == pytest.approx(getattr(diag, name), rel=1e-6), name
        assert {t: ours.loss[t] for t in diag.loss} == pytest.approx(diag.loss, rel=1e-6)


# ---- two gloo ranks -----------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_ranks_match_one_process(tmp_path):
    """Rank 0 holds two batches, rank 1 one (padded with a dummy batch): the one-process result."""
    from dist_runs import launch

    batches = _batches()
    torch.save(batches, tmp_path / "batches.pt")
    launch([str(Path(__file__).resolve()), str(tmp_path / "batches.pt"), str(tmp_path / "out.pt")], nproc=2)
    two = EvalResult.from_sums(torch.load(tmp_path / "out.pt"))
    _same(two, evaluate(PixelReader(), batches, torch.device("cpu")), rel=1e-9)


def _rank_worker(batches_path: str, out: str) -> None:
    from mmtrain.parallel.distributed import DistEnv, env_from_torchrun

    torch.distributed.init_process_group("gloo")
    env: DistEnv = env_from_torchrun()
    batches = torch.load(batches_path, weights_only=False)
    mine = batches[:2] if env.rank == 0 else batches[2:]
    result = evaluate_ranks(PixelReader(), mine, torch.device("cpu"), env, pad=lambda: dummy_batch(SEQ, V))
    if env.is_main:
        torch.save(result.sums_TC(), out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank_worker(*sys.argv[1:3])
