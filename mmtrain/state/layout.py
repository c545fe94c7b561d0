"""The row layout of the fused weights a checkpoint was written in.

    LAYOUT 2 (saved as "layout": 2): wqkv's rows grouped by KV head (a group's query heads, its k head,
             its v head), SwiGLU's w_in interleaving gate and up per hidden unit, so that a
             contiguous row block (tensor parallelism's Shard(0)) is whole groups / whole units
    LAYOUT 1 (no key: checkpoints and exports written before it): wqkv [q | k | v], w_in [gate | up]

The names and shapes are the same, so a layout-1 checkpoint would load without an error and with
its heads scrambled. Training refuses it in one line (its optimizer moments are in the old rows as
well, sharded by DCP); consumers of the whole model state (attention maps, generation, export)
get it reordered (`upgrade`), as the HF converter reorders rows (mmtrain/hf/convert.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mmtrain.errors import UserError

LAYOUT = 2
_QKV = re.compile(r"(decoder\.layers|vision\.blocks)\.\d+\.attn\.wqkv\.(weight|bias)")
_GATE_UP = re.compile(r"decoder\.layers\.\d+\.ffn\.(shared\.)?w_in\.(weight|bias)")


def check_trainable(path: Path, saved: dict) -> None:
    """Refuse to resume training from a checkpoint whose fused weights are in an older layout."""
    layout = saved.get("layout", 1)
    if layout != LAYOUT:
        raise UserError(f"{path}: its fused weights are in row layout {layout} (wqkv [q | k | v], w_in "
                        f"[gate | up]) and this code trains layout {LAYOUT} (grouped by KV head / "
                        f"interleaved); resume it with the code that wrote it, or read it for inference "
                        f"(mmtrain-attn, generate, export reorder it)")


def upgrade(state: dict[str, torch.Tensor], model_cfg: dict, layout: int) -> dict[str, torch.Tensor]:
    """A whole-model state dict of `layout` in LAYOUT's rows (the same dict when it already is)."""
    if layout == LAYOUT:
        return state
    if layout != 1:
        raise UserError(f"checkpoint: row layout {layout} is newer than this code reads ({LAYOUT})")
    from mmtrain.config import from_dict
    from mmtrain.models.multimodal import ModelConfig
    from mmtrain.models.self_attention import qkv_order

    cfg = from_dict(ModelConfig, model_cfg, source="checkpoint config")
    dec, vis = cfg.decoder, cfg.vision
    out = {}
    for name, t in state.items():
        if _QKV.fullmatch(name):
            heads = (dec.n_heads, dec.n_kv_heads, dec.head_dim) if name.startswith("decoder.") else \
                (vis.n_heads, vis.n_heads, vis.dim // vis.n_heads)
            t = t[qkv_order(*heads).argsort()]  # [q | k | v] -> grouped
        elif _GATE_UP.fullmatch(name):
            t = t[torch.arange(t.shape[0]).view(2, -1).t().reshape(-1)]  # gate | up -> interleaved
        out[name] = t
    return out
