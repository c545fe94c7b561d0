"""The ViT's linear probe (mmtrain/evaluation/probe.py): features that are the pixel reference's own
reach it exactly and read colour from the corpus; constant features score chance exactly, noise about
chance; the same result twice; in the diagnostics it moves nothing else (signals, RNG), and off
(probe_media=0) it is absent.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mmtrain.config import from_dict
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.evaluation.diagnostics import run_diagnostics
from mmtrain.evaluation.diagnostics_report import DiagConfig
from mmtrain.evaluation.probe import (
    ATTRIBUTES,
    heldout_accuracy,
    pixel_features,
    probe_media,
    probe_scores,
    score_features,
)
from mmtrain.loop.trainer import Trainer
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.run_config import RunConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, raw_for):
    """60 val images with boxes (~90 objects), a random tiny model."""
    root = tmp_path_factory.mktemp("probe")
    corpus = root / "shapes"
    write_corpus(corpus, SynthConfig.small(n_image=4, n_video=2, n_interleaved=2, n_text=4, n_val=60,
                                           shard_size=64), log=None)
    raw = raw_for(root / "run")
    raw["data"]["tokenizer"] = str(corpus / "tokenizer.json")
    for src in raw["data"]["val"]:
        src["shards"] = [str(corpus / "val" / f"{src['name']}-*.tar")]
    cfg = from_dict(RunConfig, raw, source="probe-test")
    tok = load_tokenizer(cfg.data.tokenizer)
    cfg.model.decoder.vocab_size = tok.vocab_size
    media = probe_media(cfg.data, tok, 60)
    assert len(media) == 60
    return {"cfg": cfg, "media": media, "model": MultimodalModel(cfg.model).eval()}


class _PixelVision(nn.Module):
    """A vision encoder whose tokens are the pixel reference's features: the identity of the pixels."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.projector = nn.Identity()

    def forward(self, patches_NP: torch.Tensor, grid_thw_M3: torch.Tensor) -> torch.Tensor:
        v = self.cfg.vision
        return self.projector(pixel_features(patches_NP, grid_thw_M3, v.merge, v.in_channels))


class _PixelViT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = _PixelVision(cfg)

    def forward(self, patches_NP: torch.Tensor, grid_thw_M3: torch.Tensor, **_) -> None:
        self.vision(patches_NP, grid_thw_M3)


def test_the_identity_of_the_pixels_reaches_the_pixel_reference(setup):
    fake = _PixelViT(setup["cfg"].model)
    result = probe_scores(fake, setup["media"], CPU, fake)
    assert set(result) == set(ATTRIBUTES)
    for r in result.values():
        assert r["vit"] == r["vit_pre"] == r["pixels"]
        assert r["n"] > r["held_out"] >= 20
    colour = result["colour"]
    assert colour["pixels"] > colour["chance"] + 0.3  # the box pooling lands on the objects


def test_constant_features_score_chance_and_noise_about_chance(setup):
    media = setup["media"]
    Q = sum(h * w for h, w in (m.grid_hw for m in media))
    constant_QF = torch.randn(1, 8).expand(Q, 8)
    result = score_features({"vit": constant_QF}, media)
    assert all(r["vit"] == r["chance"] for r in result.values())
    # many objects, 4 balanced classes: noise ~0.25, a feature that carries the class ~1
    labels_O = torch.arange(600) % 4
    train_O = torch.arange(600) % 3 < 2
    names = [str(y) for y in labels_O.tolist()]
    assert heldout_accuracy(torch.randn(600, 16), names, train_O) < 0.45
    signal_OF = torch.nn.functional.one_hot(labels_O, 4).double() + 0.2 * torch.randn(600, 4)
    assert heldout_accuracy(torch.cat([signal_OF, torch.randn(600, 12)], 1), names, train_O) > 0.9


def test_probe_is_deterministic(setup):
    first = probe_scores(setup["model"], setup["media"], CPU, setup["model"])
    assert first == probe_scores(setup["model"], setup["media"], CPU, setup["model"])
    for r in first.values():
        assert all(0 <= r[k] <= 1 for k in ("vit", "vit_pre", "pixels", "chance"))


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def test_diagnostics_with_the_probe_move_nothing_else(make_config, tmp_path):
    tr = Trainer(make_config(tmp_path / "run", ["train.ckpt_every=0"]), verbose=False)
    media = probe_media(tr.cfg.data, tr.tokenizer, 6)
    assert media and probe_media(tr.cfg.data, tr.tokenizer, 0) == []
    rng = torch.get_rng_state()
    off = run_diagnostics(tr.model, tr.val_batches(), tr.device, DiagConfig(), 0, raw_model=tr.raw_model)
    on = run_diagnostics(tr.model, tr.val_batches(), tr.device, DiagConfig(probe_media=6), 0,
                         raw_model=tr.raw_model, probe=media)
    assert torch.equal(torch.get_rng_state(), rng)
    assert off.probe == {} and "probe" not in off.seconds and on.seconds["probe"] > 0
    assert set(on.probe) == set(ATTRIBUTES)
    a, b = (json.loads(json.dumps(r.to_dict())) for r in (off, on))
    assert _without(a, "seconds", "config", "probe") == _without(b, "seconds", "config", "probe")
    assert a["probe"] == {} and b["probe"] == on.probe
    assert not [k for k in off.scalars() if "probe" in k]
    assert on.scalars()["diag/probe_colour_vit"] == on.probe["colour"]["vit"]


def test_a_run_logs_the_probe_only_when_asked(make_config, tmp_path):
    for n in (0, 3):
        run = tmp_path / f"run{n}"
        Trainer(make_config(run, ["train.steps=1", "train.ckpt_every=0", "diagnostics.every=1",
                                  "diagnostics.batches=1", "diagnostics.pointing_media=0",
                                  f"diagnostics.probe_media={n}"]), verbose=False).fit()
        diags = [json.loads(x) for x in (run / "diagnostics.jsonl").read_text().splitlines()]
        assert [sorted(d["probe"]) for d in diags] == [sorted(ATTRIBUTES) if n else []] * 2
