"""Every shipped run config parses strictly, and its model builds (on the meta device)."""

from pathlib import Path

import pytest
import torch
import yaml

from mmtrain.config import load_config
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2] / "configs"
YAMLS = sorted(ROOT.rglob("*.yaml"))
EXPERIMENTS = [p for p in YAMLS if "arms" in (yaml.safe_load(p.read_text()) or {})]  # a base config + arms
CONFIGS = sorted(set(YAMLS) - set(EXPERIMENTS))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_builds(path):
    cfg = load_config(RunConfig, path)
    cfg.model.decoder.vocab_size = cfg.model.decoder.vocab_size or 32768
    with torch.device("meta"):
        model = MultimodalModel(cfg.model)
    counts = model.num_params()
    assert counts.total >= counts.active > 0


def test_sizes_match_their_descriptions():
    sizes = {}
    for name in ("small", "base"):
        cfg = load_config(RunConfig, ROOT / f"{name}.yaml")
        cfg.model.decoder.vocab_size = 32768
        with torch.device("meta"):
            sizes[name] = MultimodalModel(cfg.model).num_params()
    assert 250e6 < sizes["small"].total < 350e6
    assert 2.5e9 < sizes["base"].total < 3.3e9 and 0.5e9 < sizes["base"].active < 0.7e9


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_experiment_arms_resolve(path, tmp_path):
    from tools.experiments.collapse import load_experiment, plan_runs

    exp = load_experiment(path)
    runs = plan_runs(exp, tmp_path, list(exp.arms), exp.seeds, [])
    assert len(runs) == len(exp.arms) * len(exp.seeds) and len(exp.seeds) >= 2  # never one seed
