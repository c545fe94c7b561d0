"""Parameter and FLOP counts (for MFU and for sizing configs).

Active parameters count a token's path: shared experts fully, routed experts top_k of n_routed.
Training FLOPs per decoder token = 6 x active matmul parameters (the embedding lookup is not a
matmul; a tied embedding is counted once, as the LM head) + attention 12 x H x head_dim x keys
per layer (QK^T and AV, forward + backward = 3 x forward), where keys is what the layer really
attends per query: measured on the batch when given (`attn_keys`, from the layers' counts in
models/attention/counts.py: documents, visual_always and span closures included), else the
estimate ~S/2 for a full causal layer, (own + window + sink + top_k) blocks for a sparse one.
Visual tokens add the vision tower's cost for their merge^2 patches, scaled by the visual
fraction. Documents shorter than S make full layers cheaper than counted (an upper bound).
Norms (the vision `out_norm` on the projector's output included) are parameters, not matmuls:
counted in the totals, their FLOPs left out as negligible.
The optional visual self-supervised pass (vision `ssl_head`: a second tower pass over the
masked media) is not counted; its mask token and head count as vision parameters. Nor is the
training-only visual head (`ModelConfig.visual_head`, outside `decoder`: it reads only the visual
positions); it counts in the totals.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .moe import MoE


@dataclass
class ParamCount:
    total: int
    active: int  # per token: routed experts at top_k / n_routed
    vision: int  # the vision encoder (projector and its out_norm included)
    embedding: int  # the token embedding table (also the LM head when tied)

    def __str__(self) -> str:
        return (f"total {self.total / 1e6:.2f}M, active {self.active / 1e6:.2f}M "
                f"(vision {self.vision / 1e6:.2f}M, embedding {self.embedding / 1e6:.2f}M)")


def _inactive_routed(decoder: nn.Module) -> int:
    """Routed-expert parameters a token does not use, summed over MoE layers."""
    n = 0
    for moe in decoder.moe_layers().values():
        assert isinstance(moe, MoE)
        per_expert = (moe.experts.w_in_EDF2.numel() + moe.experts.w_out_EFD.numel()) // moe.cfg.n_routed
        n += per_expert * (moe.cfg.n_routed - moe.cfg.top_k)
    return n


def count_params(model: nn.Module) -> ParamCount:
    total = sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights
    active = total - _inactive_routed(model.decoder)
    vision = sum(p.numel() for p in model.vision.parameters())
    return ParamCount(total, active, vision, model.decoder.embed.weight.numel())


def _matmul_params(module: nn.Module, skip: tuple[nn.Parameter, ...] = ()) -> int:
    skip_ids = {id(p) for p in skip}
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2 and id(p) not in skip_ids)


def _vision_not_per_patch(vision: nn.Module) -> tuple[nn.Parameter, ...]:
    """2-D vision parameters off the per-patch matmul path of the main pass: the position-embedding
    lookups (indexed, not multiplied) and the SSL head (only in the uncounted masked pass)."""
    ssl = (vision.ssl_head.weight,) if vision.ssl_head is not None else ()
    return tuple(p for p in (vision.row_embed, vision.col_embed) if p is not None) + ssl


def attention_keys(model: nn.Module, layer: int, seq_len: int) -> float:
    """Estimated keys per query in a decoder layer (mean over positions, whole-row documents)."""
    dec = model.cfg.decoder
    full = seq_len / 2
    if not dec.is_sparse(layer):
        return full
    a = dec.attention
    blocks = 1 + a.window / a.block_size + int(a.sink) + a.top_k
    return min(full, blocks * a.block_size)


def flops_per_token(model: nn.Module, seq_len: int, visual_fraction: float = 0.0,
                    patches_per_medium: int = 256, attn_keys: dict[int, float] | None = None) -> float:
    """Training FLOPs per decoder token (see the module docstring); attn_keys: measured keys per
    query token of each layer (missing layers are estimated)."""
    dec, vis = model.cfg.decoder, model.cfg.vision
    decoder = model.decoder
    skip = (decoder.embed.weight,) if decoder.lm_head is not None else ()
    dense = 6 * (_matmul_params(decoder, skip) - _inactive_routed(decoder))
    keys = attn_keys or {}
    attn = sum(12 * dec.n_heads * dec.head_dim * keys.get(i, attention_keys(model, i, seq_len))
               for i in range(dec.n_layers))
    projector = _matmul_params(model.vision.projector)  # runs once per merged token
    tower = _matmul_params(model.vision, _vision_not_per_patch(model.vision)) - projector
    per_patch = 6 * tower + 12 * vis.dim * patches_per_medium * vis.depth
    per_visual_token = vis.merge ** 2 * per_patch + 6 * projector
    return dense + attn + visual_fraction * per_visual_token
