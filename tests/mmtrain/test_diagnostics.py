"""Collapse diagnostics on a tiny model and the small built-in corpus: training state untouched,
the reliance gap (zero when media cannot reach the text, positive after brief training), attention
statistics equal to the attention-map tool's, effective rank, alarms, the expert-load picture and
exact combination across (simulated) ranks.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from mmtrain.attention_maps.maps import batch_attention_stats
from mmtrain.data_pipelines.batch import IMAGE, TASK_NAMES, TEXT
from mmtrain.evaluation.diagnostics import effective_rank, run_diagnostics
from mmtrain.evaluation.diagnostics_report import DiagConfig, DiagResult
from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.terms import dummy_batch


def _trainer(make_config, run_dir, *overrides) -> Trainer:
    return Trainer(make_config(run_dir, ["train.ckpt_every=0", *overrides]), verbose=False)


def _diagnose(tr: Trainer, cfg: DiagConfig | None = None, step: int = 0, model: nn.Module | None = None,
              **kw) -> DiagResult:
    return run_diagnostics(model or tr.model, tr.val_batches(), tr.device, cfg or DiagConfig(), step,
                           raw_model=tr.raw_model, **kw)


class _Noisy(nn.Module):
    """A wrapper (like DDP) whose forward draws random numbers, as dropout would."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **inputs):
        torch.rand(3)
        return self.module(**inputs)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return {k: v.detach().clone() for k, v in named}


def test_diagnostics_leave_training_state_untouched(make_config, tmp_path):
    tr = _trainer(make_config, tmp_path / "run")
    model = tr.raw_model
    model.train()
    with torch.no_grad():  # a training-mode forward: the MoE layers hold some load
        model(**tr.val_batches()[0].model_inputs())
    model.vision.eval()  # mixed modes: every module gets its own back
    loads = {i: moe.load_E.clone() for i, moe in model.moe_layers().items()}
    assert loads and all(int(load.sum()) > 0 for load in loads.values())
    modes = {name: m.training for name, m in model.named_modules()}
    before, rng = _state(model), torch.get_rng_state()
    result = _diagnose(tr, model=_Noisy(model))
    assert result.batches == 2 and result.loss
    assert torch.equal(torch.get_rng_state(), rng)
    assert {name: m.training for name, m in model.named_modules()} == modes
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # load_E too: eval mode, no accumulation
    for i, moe in model.moe_layers().items():
        assert torch.equal(moe.load_E, loads[i])


def test_training_after_diagnostics_is_unchanged(make_config, tmp_path):
    a = _trainer(make_config, tmp_path / "a")
    _diagnose(a)
    step_a = a.train_step(iter(a.train_loader))
    b = _trainer(make_config, tmp_path / "b")
    step_b = b.train_step(iter(b.train_loader))
    assert step_a.loss == step_b.loss and step_a.task_loss == step_b.task_loss
    for (name, x), (_, y) in zip(a.raw_model.state_dict().items(), b.raw_model.state_dict().items()):
        assert torch.equal(x, y), name


def test_reliance_gap_is_zero_when_media_cannot_reach_the_text(make_config, tmp_path):
    tr = _trainer(make_config, tmp_path / "run")
    with torch.no_grad():  # visual tokens become 0 whatever the pixels: blanking changes nothing
        tr.raw_model.vision.projector.w_out.weight.zero_()
    result = _diagnose(tr)
    assert set(result.reliance_gap) == {"image_text", "video_text"}
    for gap in result.reliance_gap.values():
        assert abs(gap) < 1e-5


def test_briefly_trained_model_relies_on_its_media(make_config, tmp_path):
    """After 50 steps some medium's text reads its pixels: blanking it costs loss. Which one depends on
    the initial weights (seeded per block: models/multimodal.seeded_init): here video's gap is the
    positive one and image's is within noise of 0 (-0.0003); at 100 steps video's is 0.098."""
    tr = _trainer(make_config, tmp_path / "run", "train.steps=50", "optim.lr=0.01")
    batches = iter(tr.train_loader)
    for _ in range(50):
        tr.train_step(batches)
    result = _diagnose(tr, step=50)
    assert max(result.reliance_gap.values()) > 0, result.reliance_gap


def _text_BS(batch, task: str) -> torch.Tensor:
    return (batch.modality_BS == TEXT) & batch.loss_mask_BS & (batch.task_BS == TASK_NAMES.index(task))


def test_attention_stats_match_the_attention_map_tool(make_config, tmp_path):
    tr = _trainer(make_config, tmp_path / "run")
    batch = tr.val_batches()[0]
    result = run_diagnostics(tr.model, [batch], tr.device, DiagConfig(batches=1, max_rows=10_000), 0,
                             raw_model=tr.raw_model)
    assert result.attention, "test setup: the batch needs a media document"
    n_layers = tr.raw_model.cfg.decoder.n_layers
    model = tr.raw_model.eval()
    for task, per_stat in result.attention.items():
        stats = batch_attention_stats(model, batch.model_inputs(), _text_BS(batch, task), range(n_layers))
        assert result.attention_rows[task] == int(stats[0]["rows"]) > 0
        for stat, values in per_stat.items():
            assert len(values) == n_layers and all(math.isfinite(v) for v in values)
            for layer, value in enumerate(values):
                assert value == pytest.approx(float(stats[layer][stat].mean()), abs=1e-5), (task, stat, layer)
        assert all(0 <= v <= 1 for v in per_stat["mass"] + per_stat["sink"])
        assert all(v >= 0 for v in per_stat["entropy"])
    bounded = run_diagnostics(tr.model, [batch], tr.device, DiagConfig(batches=1, max_rows=7), 0,
                              raw_model=tr.raw_model)
    assert sum(bounded.attention_rows.values()) == 7


def test_effective_rank():
    torch.manual_seed(0)
    x_MD = torch.randn(10, 1) * torch.randn(1, 16)  # rank 1
    assert effective_rank(x_MD.T @ x_MD) == pytest.approx(1.0, abs=1e-3)
    q_DD = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64)).Q
    for k in (2, 5, 16):
        x_KD = 3.0 * q_DD[:k]  # k orthogonal embeddings of equal norm
        assert effective_rank(x_KD.T @ x_KD) == pytest.approx(k, abs=1e-6)


def test_effective_rank_of_pooled_embeddings(make_config, tmp_path):
    """The Gram-matrix route (summable across ranks) equals the SVD of the pooled embeddings."""
    tr = _trainer(make_config, tmp_path / "run")
    batch = tr.val_batches()[0]
    result = run_diagnostics(tr.model, [batch], tr.device, DiagConfig(batches=1), 0, raw_model=tr.raw_model)
    with torch.no_grad():
        visual_QD = tr.raw_model.eval()(**batch.model_inputs()).visual_embeds_ND.double()
    medium_Q = batch.media_ids_BS[batch.modality_BS != TEXT].long()
    M = batch.media_kind_M.shape[0]
    pooled_MD = torch.zeros(M, visual_QD.shape[1], dtype=torch.float64).index_add_(0, medium_Q, visual_QD)
    x_KD = (pooled_MD / torch.bincount(medium_Q, minlength=M)[:, None])[batch.media_kind_M == IMAGE]
    assert result.media["image"] == x_KD.shape[0] >= 2
    for centre, ranks in ((False, result.effective_rank), (True, result.effective_rank_centered)):
        s = torch.linalg.svdvals(x_KD - x_KD.mean(0) if centre else x_KD)
        p = s / s.sum()
        assert ranks["image"] == pytest.approx(float(torch.exp(-(p * p.log()).sum())), rel=1e-4)
    assert 1 <= result.effective_rank["image"] <= result.media["image"]
    # the visual tokens' mean norm per kind, from the same forward
    image_Q = batch.media_kind_M[medium_Q] == IMAGE
    want = float(visual_QD[image_Q].norm(dim=-1).mean())
    assert result.visual_norm["image"] == pytest.approx(want, rel=1e-6)
    assert result.scalars()["diag/visual_norm_image"] == result.visual_norm["image"]


def _healthy(**changes) -> DiagResult:
    result = DiagResult(
        step=500, loss={"image_text": 2.0}, blank_loss={"image_text": 2.5}, tokens={"image_text": 100},
        attention={"image_text": {"mass": [0.3, 0.2], "entropy": [2.0, 2.1], "sink": [0.1, 0.2]}},
        attention_rows={"image_text": 50},
        expert_load={1: torch.tensor([[0.25] * 4, [0.3, 0.2, 0.3, 0.2], [0.0] * 4], dtype=torch.float64)},
        expert_load_max_ratio={1: [1.0, 1.2, None]}, expert_mean_load={1: [100.0, 100.0, 0.0]},
        router_entropy={1: [1.3, 1.2, None]}, effective_rank={"image": 5.0},
        effective_rank_centered={"image": 4.0}, media={"image": 8}, batches=2)
    for key, value in changes.items():
        setattr(result, key, value)
    return result


def test_alarms_fire_past_thresholds_and_not_before_warmup():
    assert _healthy().alarms() == []
    low_mass = {"mass": [0.01, 0.02], "entropy": [2.0, 2.1], "sink": [0.1, 0.2]}
    sick = _healthy(blank_loss={"image_text": 2.004}, attention={"image_text": low_mass},
                    expert_load_max_ratio={1: [1.0, 4.5, None]}, router_entropy={1: [0.05, 1.2, None]},
                    effective_rank_centered={"image": 1.2})
    alarms = sick.alarms()
    assert len(alarms) == 5, alarms
    assert alarms[0] == ("reliance gap image_text +0.0040 < 0.02 (blanked media, out of distribution; "
                         "no mismatch gap): text ignores the pixels")
    for words in ("attention mass image_text 0.0150", "effective rank image 1.20", "expert load image L1",
                  "router entropy text L1"):
        assert any(a.startswith(words) for a in alarms), (words, alarms)
    assert sick.scalars()["diag/alarms"] == 5.0
    assert sick.alarms(step=99) == [] and sick.alarms(DiagConfig(warmup_steps=1000)) == []
    assert sick.alarms(DiagConfig(warmup_steps=0), step=0) == alarms
    relaxed = DiagConfig(min_reliance_gap=-1, min_attention_mass=0, min_effective_rank=1,
                         max_expert_load_ratio=5, min_router_entropy=0)
    assert sick.alarms(relaxed) == []
    # Too few tokens per expert (sampling noise) or too few media to reach the threshold: no alarm.
    assert _healthy(expert_load_max_ratio={1: [1.0, 9.0, None]}, expert_mean_load={1: [100.0, 3.0, 0.0]}
                    ).alarms() == []
    assert _healthy(effective_rank_centered={"image": 1.5}, media={"image": 3}).alarms() == []


def test_reading_is_judged_by_the_mismatch_gap_where_it_was_measured():
    """A high blanked gap does not hide a low mismatch gap, nor a low blanked gap a high one; the
    blanked gap judges only a task without a mismatch gap (mismatch off, or nothing swapped)."""
    swapped = {"mismatch_real_loss": {"image_text": 2.0}, "mismatch_tokens": {"image_text": 40}}
    grey_spike = _healthy(blank_loss={"image_text": 3.0}, mismatch_loss={"image_text": 2.01}, **swapped)
    assert grey_spike.alarms() == ["mismatch gap image_text +0.0100 < 0.02: text ignores the pixels "
                                   "(other documents' media do as well as its own)"]
    assert grey_spike.alarms(DiagConfig(min_mismatch_gap=0.005)) == []
    reads = _healthy(blank_loss={"image_text": 2.001}, mismatch_loss={"image_text": 2.3}, **swapped)
    assert reads.alarms() == []
    video_unswapped = _healthy(loss={"image_text": 2.0, "video_text": 2.0}, mismatch_loss={"image_text": 2.3},
                               blank_loss={"image_text": 2.001, "video_text": 2.001}, **swapped)
    assert [a.split(" (")[0] for a in video_unswapped.alarms()] == ["reliance gap video_text +0.0010 < 0.02"]
    assert "out of distribution" in video_unswapped.alarms()[0]


def test_scalars_and_history_of_a_real_run(make_config, tmp_path):
    tr = _trainer(make_config, tmp_path / "run")
    result = _diagnose(tr, DiagConfig(warmup_steps=0))
    scalars = result.scalars()
    for key in ("diag/reliance_gap_image_text", "diag/loss_image_text", "diag/attn_mass_image_text_L1",
                "diag/attn_mass_image_text", "diag/attn_entropy_video_text", "diag/sink_image_text_L0",
                "diag/router_entropy_text_L1", "diag/expert_load_max_ratio_image_L1",
                "diag/effective_rank_image", "diag/alarms"):
        assert key in scalars and math.isfinite(scalars[key]), key
    history = json.loads(json.dumps(result.to_dict()))
    assert history["alarms"] == result.alarms() and history["reliance_gap"] == result.reliance_gap
    share_3E = np.array(history["expert_load"]["1"])
    assert share_3E.shape == (3, 4) and np.allclose(share_3E.sum(1), 1.0)


def test_expert_load_image():
    image_HW3 = _healthy().expert_load_image()
    assert image_HW3.dtype == np.uint8 and image_HW3.ndim == 3 and image_HW3.shape[2] == 3
    assert image_HW3.shape[0] > 20 and image_HW3.shape[1] > 20 and image_HW3.std() > 0
    assert _healthy(expert_load={}).expert_load_image() is None


def test_reduce_over_identical_ranks_gives_the_same_means(make_config, tmp_path):
    tr = _trainer(make_config, tmp_path / "run")
    calls = []

    def two_ranks(t: torch.Tensor) -> None:
        calls.append((t.dtype, t.dim()))
        t.mul_(2)

    one, two = _diagnose(tr), _diagnose(tr, reduce_fn=two_ranks)
    assert calls == [(torch.float64, 1)]
    assert two.tokens == {k: 2 * v for k, v in one.tokens.items()}
    assert two.media == {k: 2 * v for k, v in one.media.items()}
    for field in ("loss", "blank_loss", "attention", "expert_load_max_ratio", "router_entropy",
                  "effective_rank", "effective_rank_centered"):
        assert _close(getattr(two, field), getattr(one, field)), field
    for layer, share_3E in one.expert_load.items():
        assert torch.allclose(two.expert_load[layer], share_3E)


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9))


@pytest.mark.parametrize("field, value", [
    ("every", -1), ("batches", 0), ("max_rows", 0), ("warmup_steps", -5), ("every", 1.5),
    ("min_attention_mass", 1.5), ("max_expert_load_ratio", 0.5), ("min_router_entropy", -0.1),
    ("min_effective_rank", float("nan")), ("min_reliance_gap", "high"), ("min_mismatch_gap", float("inf")),
])
def test_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        DiagConfig(**{field: value})


def test_padding_only_batches_add_nothing(make_config, tmp_path):
    """A rank short of val batches pads with dummy batches (terms.dummy_batch): no task, no medium."""
    tr = _trainer(make_config, tmp_path / "run")
    media = tr.cfg.data.media
    pad = dummy_batch(tr.cfg.data.seq_len, 3 * media.temporal_patch * media.patch_size ** 2)
    empty = run_diagnostics(tr.model, [pad], tr.device, DiagConfig(warmup_steps=0), 0, raw_model=tr.raw_model)
    assert empty.loss == {} and empty.attention == {} and empty.media == {} and empty.effective_rank == {}
    assert empty.alarms() == [] and math.isfinite(empty.scalars()["diag/alarms"])
    real = run_diagnostics(tr.model, tr.val_batches()[:1], tr.device, DiagConfig(batches=1), 0,
                           raw_model=tr.raw_model)
    padded = run_diagnostics(tr.model, tr.val_batches()[:1] + [pad], tr.device, DiagConfig(), 0,
                             raw_model=tr.raw_model)
    assert padded.loss == real.loss and padded.attention == real.attention
    assert padded.effective_rank == real.effective_rank
