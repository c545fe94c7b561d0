"""Model sizes proposed for the run configs (configs/*.yaml hold the authoritative copies).

Each preset is a plain nested dict (what the YAML `model:` section holds) and `build_config`
turns such a dict into a validated ModelConfig. Counts (from `num_params()` on the meta device,
vocab 32768 unless noted) are in docs and the report; re-check them with
`python -m tools.bench.bench_model --size NAME --count-only`.
"""

from __future__ import annotations

import copy
from typing import Any

from .attention import AttentionConfig
from .decoder import DecoderConfig
from .moe import MoEConfig
from .multimodal import ModelConfig
from .vision import VisionConfig


def _tiny() -> dict[str, Any]:
    return {
        "vision": dict(patch_size=8, dim=96, depth=2, n_heads=4, mlp_ratio=4.0, merge=2),
        "decoder": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, mrope_sections=[4, 6, 6],
                        tie_embeddings=True, layer_layout="FS",
                        attention=dict(block_size=32, window=64, top_k=2),
                        moe=dict(n_routed=8, top_k=2, n_shared=1, expert_dim=128, first_dense_layers=1)),
    }


def _small() -> dict[str, Any]:
    return {
        "vision": dict(patch_size=14, dim=512, depth=8, n_heads=8, mlp_ratio=4.0, merge=2),
        "decoder": dict(dim=1024, n_layers=12, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                        mrope_sections=[8, 12, 12], tie_embeddings=True, layer_layout="FSSS",
                        rope_theta=500000.0, attention=dict(block_size=64, window=512, top_k=4),
                        moe=dict(n_routed=16, top_k=2, n_shared=1, expert_dim=352, first_dense_layers=1)),
    }


def _base() -> dict[str, Any]:
    return {
        "vision": dict(patch_size=14, dim=768, depth=12, n_heads=12, mlp_ratio=4.0, merge=2),
        "decoder": dict(dim=1536, n_layers=16, n_heads=12, n_kv_heads=4, ffn_dim=4096,
                        mrope_sections=[16, 24, 24], tie_embeddings=False, layer_layout="FSSS",
                        rope_theta=1000000.0, attention=dict(block_size=128, window=1024, top_k=8),
                        moe=dict(n_routed=64, top_k=6, n_shared=1, expert_dim=576, first_dense_layers=1)),
    }


def _long() -> dict[str, Any]:
    cfg = _base()  # the base model, one full layer in eight, a longer-reaching sparse pattern
    cfg["decoder"].update(layer_layout="FSSSSSSS", rope_theta=10000000.0,
                          attention=dict(block_size=128, window=2048, top_k=16))
    return cfg


PRESET_NAMES = ("tiny", "small", "base", "long")


def preset(name: str) -> dict[str, Any]:
    """A fresh nested dict for the named size."""
    builders = {"tiny": _tiny, "small": _small, "base": _base, "long": _long}
    if name not in builders:
        raise ValueError(f"size: must be one of {PRESET_NAMES} (got {name!r})")
    return builders[name]()


def build_config(d: dict[str, Any], vocab_size: int | None = None) -> ModelConfig:
    d = copy.deepcopy(d)
    dec = d["decoder"]
    dec["attention"] = AttentionConfig(**dec.get("attention", {}))
    dec["moe"] = MoEConfig(**dec["moe"]) if dec.get("moe") else None
    if vocab_size is not None:
        dec["vocab_size"] = vocab_size
    return ModelConfig(VisionConfig(**d["vision"]), DecoderConfig(**dec))
