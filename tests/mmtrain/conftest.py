"""A small built-in corpus and a scaled-down tiny config, shared by the trainer tests; dist_runs.py
(launching runs) importable by them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from mmtrain.config import apply_override, from_dict
from mmtrain.data_pipelines.synth.config import SynthConfig
from mmtrain.data_pipelines.synth.writer import write_corpus
from mmtrain.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tests" / "mmtrain") not in sys.path:  # dist_runs.py, under --import-mode=importlib
    sys.path.insert(0, str(REPO / "tests" / "mmtrain"))
KINDS = ("image", "video", "interleaved", "text")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shapes")
    write_corpus(out, SynthConfig.small())
    return out


def tiny_raw(corpus: Path, run_dir: Path) -> dict:
    """configs/tiny.yaml pointed at `corpus`, with a smaller model and short schedule."""
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    raw["run_dir"] = str(run_dir)
    data = raw["data"]
    data["tokenizer"] = str(corpus / "tokenizer.json")
    for split in ("train", "val"):
        for src in data[split]:
            src["shards"] = [str(corpus / split / f"{src['name']}-*.tar")]
    for item in [
        "data.num_workers=0", "data.batch_size=2", "data.seq_len=192", "data.shuffle_buffer=8",
        "data.media.max_pixels=2304",
        "model.vision.dim=32", "model.vision.depth=1", "model.vision.n_heads=2",
        "model.decoder.dim=32", "model.decoder.n_layers=2", "model.decoder.n_heads=2",
        "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64", "model.decoder.mrope_sections=[2, 3, 3]",
        "model.decoder.moe.n_routed=4", "model.decoder.moe.expert_dim=32",
        "train.steps=8", "train.eval_every=0", "train.ckpt_every=4", "train.log_every=2",
        "train.eval_batches=2", "optim.warmup_steps=2", "train.threads=0",
        "loss.balancer.kind=static", "diagnostics.every=0", "captions.images=0", "captions.videos=0",
        # the visual next-token term is tested where it is asked for (test_objective, the cp parity)
        "model.visual_head=false", "loss.visual_next.weight=0",
    ]:
        apply_override(raw, item)
    return raw


def tiny_config(corpus: Path, run_dir: Path, overrides: list[str] = ()) -> RunConfig:
    raw = tiny_raw(corpus, run_dir)
    for item in overrides:
        apply_override(raw, item)
    return from_dict(RunConfig, raw, source="tiny-test")


@pytest.fixture
def make_config(corpus):
    return lambda run_dir, overrides=(): tiny_config(corpus, run_dir, overrides)


@pytest.fixture
def make_raw(corpus):
    return lambda run_dir: tiny_raw(corpus, run_dir)


@pytest.fixture(scope="session")
def raw_for(corpus):
    """make_raw for module- and session-scoped fixtures."""
    return lambda run_dir: tiny_raw(corpus, run_dir)
