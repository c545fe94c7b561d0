"""Every shipped run config parses strictly, and its model builds (on the meta device)."""

from pathlib import Path

import pytest
import torch

from mmtrain.config import load_config
from mmtrain.run_config import RunConfig
from models.multimodal import MultimodalModel

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))


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
        cfg = load_config(RunConfig, Path(CONFIGS[0]).parent / f"{name}.yaml")
        cfg.model.decoder.vocab_size = 32768
        with torch.device("meta"):
            sizes[name] = MultimodalModel(cfg.model).num_params()
    assert 250e6 < sizes["small"].total < 350e6
    assert 2.5e9 < sizes["base"].total < 3.3e9 and 0.5e9 < sizes["base"].active < 0.7e9
