"""Checkpoints of the fused weights' older row layout (mmtrain/state/layout.py): read for inference
in this code's rows, refused for training."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from test_pipeline import _model

from mmtrain.errors import UserError
from mmtrain.models.self_attention import qkv_order
from mmtrain.state.layout import LAYOUT, check_trainable, upgrade


def _as_layout_1(state: dict, cfg) -> dict:
    """What the code before layout 2 held: wqkv [q | k | v], SwiGLU w_in [gate | up] (HF's blocks)."""
    dec, vis = cfg.decoder, cfg.vision
    out = {}
    for name, t in state.items():
        if name.endswith("attn.wqkv.weight"):
            heads = (dec.n_heads, dec.n_kv_heads, dec.head_dim) if name.startswith("decoder.") else \
                (vis.n_heads, vis.n_heads, vis.dim // vis.n_heads)
            t = t[qkv_order(*heads)]
        elif name.startswith("decoder.") and name.endswith(("ffn.w_in.weight", "shared.w_in.weight")):
            t = t[torch.arange(t.shape[0]).view(-1, 2).t().reshape(-1)]
        out[name] = t
    return out


def test_a_layout_1_state_reads_as_this_codes_rows():
    model = _model(4)  # a dense first layer, MoE layers with a shared expert, a vision encoder
    want = model.state_dict()
    old = _as_layout_1(want, model.cfg)
    moved = [k for k in want if not torch.equal(old[k], want[k])]
    assert any("attn.wqkv" in k for k in moved) and any("w_in" in k for k in moved)  # the test has teeth
    got = upgrade(old, asdict(model.cfg), 1)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert upgrade(want, asdict(model.cfg), LAYOUT) is want


def test_training_refuses_an_older_layout_in_one_line():
    with pytest.raises(UserError) as e:
        check_trainable(Path("run/step_4"), {"format": 3})  # written before the key existed
    assert "row layout 1" in str(e.value) and "\n" not in str(e.value)
    check_trainable(Path("run/step_4"), {"format": 3, "layout": LAYOUT})
