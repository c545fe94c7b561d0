"""Configuration of an exported mmtrain model (transformers `PreTrainedConfig`, remote code).

Flat text fields under transformers' usual names; the vision tower's fields in the `vision` dict
(mmtrain's VisionConfig names); the sparse layers' rule in `sparse_*`; the MoE in the
DeepSeek-style names. `layer_types` says per layer "mmtrain_full" or "mmtrain_sparse": it picks the
cache layer class (cache_mmtrain.py) that `DynamicCache(config=...)` builds for each layer.
`mmtrain export --hf` writes it; it is self-contained (no mmtrain import).
"""

from __future__ import annotations

from transformers import PreTrainedConfig

FULL, SPARSE = "mmtrain_full", "mmtrain_sparse"
VISION_DEFAULTS = {
    "patch_size": 8,
    "temporal_patch": 2,
    "in_channels": 3,
    "hidden_size": 96,
    "depth": 2,
    "num_heads": 4,
    "intermediate_size": 384,
    "spatial_merge_size": 2,
    "rope_theta": 10000.0,
    "qk_norm": True,
    "rms_norm_eps": 1e-6,
    "abs_pos_grid": 0,
    "out_norm": False,  # RMSNorm on the merger's output (mmtrain's vision.out_norm); absent in older exports
}
SPECIAL = ("pad", "bos", "eos", "image_start", "image_end", "image", "video_start", "video_end", "video")


class MmtrainConfig(PreTrainedConfig):
    model_type = "mmtrain"

    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384  # dense SwiGLU layers
    rope_theta: float = 10000.0
    mrope_section: list[int] | None = None  # (t, h, w) rotary pairs, contiguous; sum = head_dim / 2
    qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048  # the context mmtrain trained (data.seq_len)
    layer_types: list[str] | None = None
    # sparse layers (mmtrain's AttentionConfig)
    sparse_block_size: int = 64
    sparse_window: int = 256
    sparse_top_k: int = 4
    sparse_sink: bool = True
    sparse_visual_always: bool = True
    sparse_select: str = "block"  # "block": previous block's mean query; "token": the token's own q
    sparse_select_per: str = "kv_group"  # "kv_group" or "head"
    # MoE (0 routed experts: every layer dense)
    n_routed_experts: int = 0
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 256
    scoring_func: str = "sigmoid"  # or "softmax"
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    modality_groups: bool = False
    n_text_experts: int = 0
    vision: dict | None = None
    # special-token ids (the mmtrain tokenizer's SPECIAL_TOKENS), *_token_id
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    image_token_id: int | None = None
    video_start_token_id: int | None = None
    video_end_token_id: int | None = None
    video_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        half = self.hidden_size // self.num_attention_heads // 2
        if self.mrope_section is None:
            self.mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.vision = {**VISION_DEFAULTS, **(self.vision or {})}
        checks = [
            (sum(self.mrope_section) == half, f"mrope_section: must sum to head_dim / 2 = {half}"),
            (
                len(self.layer_types) == self.num_hidden_layers and set(self.layer_types) <= {FULL, SPARSE},
                f"layer_types: {self.num_hidden_layers} entries of {FULL!r} / {SPARSE!r}",
            ),
            (self.sparse_select in ("block", "token"), "sparse_select: 'block' or 'token'"),
            (self.sparse_select_per in ("kv_group", "head"), "sparse_select_per: 'kv_group' or 'head'"),
            (self.scoring_func in ("sigmoid", "softmax"), "scoring_func: 'sigmoid' or 'softmax'"),
        ]
        for ok, what in checks:
            if not ok:
                raise ValueError(what)
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace


__all__ = ["MmtrainConfig"]
