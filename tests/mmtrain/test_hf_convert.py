"""mmtrain state dict <-> the HF classes' names (mmtrain/hf/convert.py), torch only (runs where
transformers is not installed): the round trip is bit-exact with the vision out_norm on and off,
its gain sits under the merger, a checkpoint config older than the flag exports as off, and a
config that disagrees with the weights about out_norm is refused, naming the tensor."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml

from mmtrain.config import apply_override, from_dict
from mmtrain.hf.convert import from_hf, to_hf
from mmtrain.inference.export_hf import SPECIAL_KEYS, hf_config
from mmtrain.inference.hf_card import model_card
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]
GAIN = "model.visual.merger.out_norm.weight"
SPECIAL = {k: i for i, k in enumerate(SPECIAL_KEYS)}


def _tiny(out_norm: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """(resolved run config as a dict, state dict) of a random tiny model, every norm's gain moved off 1."""
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    for item in [
        "model.vision.dim=32", "model.vision.depth=1", "model.vision.n_heads=2",
        "model.decoder.dim=32", "model.decoder.n_layers=2", "model.decoder.n_heads=2",
        "model.decoder.n_kv_heads=1", "model.decoder.ffn_dim=64", "model.decoder.mrope_sections=[2, 3, 3]",
        "model.decoder.vocab_size=64", "model.decoder.moe.n_routed=4", "model.decoder.moe.expert_dim=32",
        f"model.vision.out_norm={str(out_norm).lower()}",
    ]:
        apply_override(raw, item)
    cfg = from_dict(RunConfig, raw, source="convert-test")
    state = MultimodalModel(cfg.model).state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if name.endswith("norm.weight"):
                t.add_(torch.randn_like(t) * 0.2)
    return asdict(cfg), state


@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "out_norm"])
def test_round_trip_bit_exact_with_the_gain_under_the_merger(out_norm):
    cfg, state = _tiny(out_norm)
    hfc = hf_config(cfg, 64, SPECIAL)
    assert hfc["vision"]["out_norm"] is out_norm
    hf = to_hf(state, hfc)
    assert (GAIN in hf) is out_norm
    if out_norm:
        assert hf[GAIN] is state["vision.out_norm.weight"]
    back = from_hf(hf, hfc, state.keys())
    exported = {k: v for k, v in state.items() if not k.startswith("visual_head.")}  # a training-only head
    assert len(exported) < len(state) and back.keys() == exported.keys()
    for k, v in exported.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    card = model_card(hfc, hf, "src", None)
    assert (f"`{GAIN}`" in card) is out_norm and ("then an RMSNorm" in card) is out_norm


def test_a_checkpoint_config_older_than_the_flag_exports_without_it():
    cfg, state = _tiny(False)
    del cfg["model"]["vision"]["out_norm"]
    hfc = hf_config(cfg, 64, SPECIAL)
    assert hfc["vision"]["out_norm"] is False and GAIN not in to_hf(state, hfc)


def test_a_config_that_disagrees_with_the_weights_is_refused():
    cfg, state = _tiny(True)
    off = hf_config(cfg, 64, SPECIAL)
    off["vision"]["out_norm"] = False
    with pytest.raises(ValueError, match=r"vision\.out_norm\.weight: present .* is false"):
        to_hf(state, off)
    del state["vision.out_norm.weight"]
    with pytest.raises(ValueError, match=r"vision\.out_norm\.weight: missing .* is true"):
        to_hf(state, hf_config(cfg, 64, SPECIAL))
