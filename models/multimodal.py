"""The whole model: vision encoder -> visual tokens scattered into the decoder's placeholders.

Architecture only: no parallelism, no optimizer, no losses other than the MoE's router terms.
The per-block ModuleLists (`vision.blocks`, `decoder.layers`) are where FSDP2 /
activation checkpointing / compile are applied from outside.

Legend: B batch rows, S tokens, V vocab, D decoder dim, P patch dim, M media, E routed experts,
N patches at the input, merged visual tokens (patches / merge^2) at the output (visual_embeds_ND).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .attention.context import ContextShard
from .counting import ParamCount, count_params, flops_per_token
from .decoder import Decoder, DecoderConfig
from .moe import MoE
from .vision import VisionConfig, VisionEncoder
from .visual_next import chunk_pairs, predicting_positions

Tensor = torch.Tensor


@dataclass
class ModelConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    # A training-only linear head from the decoder's final hidden states to the next merged visual
    # token's pixels (models/visual_next.py; loss.visual_next). Off: no parameters (state dicts as before).
    visual_head: bool = False


@dataclass
class ModelOutput:
    logits_BSV: Tensor | None  # None when forward(compute_logits=False)
    hidden_BSD: Tensor  # final-norm hidden states (the LM head's input)
    aux_losses: dict[str, Tensor]  # "moe_seq_balance", "router_z": weighted, summed over layers
    expert_load: dict[int, Tensor] | None  # MoE layer -> (3, E) int64 token counts (text, image, video)
    router_entropy: dict[int, Tensor] | None  # MoE layer -> (3,) mean routing entropy per modality
    captures: dict[int, dict]  # layer -> what `attend` recorded (q, k after RoPE, block selection)
    visual_embeds_ND: Tensor  # merged visual tokens before the scatter (patches / merge^2, D)
    visual_ssl: Tensor | None = None  # masked-patch reconstruction loss when forward got ssl_mask_N
    visual_next_KT: Tensor | None = None  # forward(visual_next=True): next_pairs' predicted pixels
    attn_stats: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # forward(attn_stats=True)


class MultimodalModel(nn.Module):
    """`init_seed`: the seed every block's initial weights are drawn from (`init_weights`); None draws
    it from the global RNG, the one draw building the model takes from it (on the meta device too)."""

    def __init__(self, cfg: ModelConfig, init_seed: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.init_seed = draw_init_seed() if init_seed is None else init_seed
        with torch.random.fork_rng(devices=[]):  # the constructors' own inits, overwritten below
            self.vision = VisionEncoder(cfg.vision, cfg.decoder.dim, cfg.decoder.attention)
            self.decoder = Decoder(cfg.decoder)
            out = cfg.vision.merge ** 2 * cfg.vision.patch_dim
            self.visual_head = nn.Linear(cfg.decoder.dim, out) if cfg.visual_head else None
        self.init_weights()  # a no-op on the meta device
        # (vision, patches_NP, grid_thw_M3, modality_BS) -> visual_ND, training forwards; None: self.vision.
        # The trainer side may install one spreading it over ranks (mmtrain/parallel/vision_balance.py).
        self.encode_media: Callable[[VisionEncoder, Tensor, Tensor, Tensor], Tensor] | None = None

    def forward(self, tokens_BS: Tensor, pos_ids_3BS: Tensor, doc_ids_BS: Tensor, span_ids_BS: Tensor,
                modality_BS: Tensor, patches_NP: Tensor, grid_thw_M3: Tensor,
                capture_layers: Collection[int] | None = None, compute_logits: bool = True,
                ssl_mask_N: Tensor | None = None, attn_stats: bool = False,
                context: ContextShard | None = None, visual_next: bool = False) -> ModelOutput:
        """`ssl_mask_N` (bool, one per patch; see `vision.make_ssl_mask`) adds the vision encoder's
        masked-patch loss, computed here so that FSDP/DDP forward hooks cover its second pass.
        The decoder always sees the real, unmasked patches. With `context` (context parallelism:
        attention/context.py) the inputs are whole rows, the vision tower encodes every medium of
        them and the outputs (logits, hidden states) are this rank's chunk of each row.
        `visual_next` adds the visual head's predictions (`visual_next_KT`), here for the same reason.
        """
        encode = self.encode_media if self.training and self.encode_media is not None else None
        visual_ND = (self.vision(patches_NP, grid_thw_M3) if encode is None  # N: patches in, merged out
                     else encode(self.vision, patches_NP, grid_thw_M3, modality_BS))
        visual_ssl = (None if ssl_mask_N is None
                      else self.vision.masked_patch_loss(patches_NP, grid_thw_M3, ssl_mask_N))
        out = self.decoder(tokens_BS, pos_ids_3BS, doc_ids_BS, span_ids_BS, modality_BS, visual_ND,
                           capture_layers, attn_stats, context)
        logits_BSV = self.decoder.logits(out.hidden_BSD) if compute_logits else None
        pred_KT = (self.visual_next_pred(out.hidden_BSD, modality_BS, grid_thw_M3, context)
                   if visual_next else None)
        return ModelOutput(logits_BSV, out.hidden_BSD, out.aux_losses, out.expert_load, out.router_entropy,
                           out.captures, visual_ND, visual_ssl, pred_KT, out.attn_stats)

    def visual_next_pred(self, hidden_BSD: Tensor, modality_BS: Tensor, grid_thw_M3: Tensor,
                         context: ContextShard | None = None) -> Tensor:
        """(K, merge^2 * P) the head's pixels of each visual token's next token in its medium, in
        `visual_next.next_pairs` order (K = 0 without media: still tied to the head, for DDP); with
        `context`, only those whose position is in this rank's chunk (`visual_next.chunk_pairs`)."""
        if self.visual_head is None:
            raise ValueError("visual_head: visual_next needs ModelConfig(visual_head=True)")
        merge = self.cfg.vision.merge
        if context is None:
            b_K, s_K = predicting_positions(modality_BS, grid_thw_M3, merge)
        else:  # whole rows in, this rank's chunk of hidden states: its own positions
            b_K, s_K, _ = chunk_pairs(modality_BS, grid_thw_M3, merge, context.lo, context.hi)
        return self.visual_head(hidden_BSD[b_K, s_K])

    def logits(self, hidden_BSD: Tensor) -> Tensor:
        """The LM head alone (for chunked cross-entropy over `hidden_BSD`)."""
        return self.decoder.logits(hidden_BSD)

    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer, e.g. after `to_empty` from the meta device:
        each block from its own seed (`seeded_init`), so a pipeline stage initialises its blocks alone
        and gets the whole model's values."""
        seeded_init(self, self.init_seed)

    def moe_layers(self) -> dict[int, MoE]:
        return self.decoder.moe_layers()

    @torch.no_grad()
    def update_moe_bias(self, reduce_fn: Callable[[Tensor], None] | None = None) -> None:
        """Aux-loss-free balancing step for every MoE layer; call after the optimizer step.

        `reduce_fn` sums the stacked (L_moe, E) load in place across data-parallel ranks (e.g.
        `torch.distributed.all_reduce`) so that all ranks apply the same update.
        """
        moes = list(self.moe_layers().values())
        if not moes:
            return
        load_LE = torch.stack([m.load_E for m in moes])
        if reduce_fn is not None:
            reduce_fn(load_LE)
        for moe, load_E in zip(moes, load_LE):
            moe.update_bias(load_E)

    def num_params(self) -> ParamCount:
        return count_params(self)

    def flops_per_token(self, seq_len: int, visual_fraction: float = 0.0,
                        patches_per_medium: int = 256, attn_keys: dict[int, float] | None = None) -> float:
        return flops_per_token(self, seq_len, visual_fraction, patches_per_medium, attn_keys)


def draw_init_seed() -> int:
    """One draw from the global CPU RNG (under a meta device context too): the model's init seed."""
    return int(torch.randint(0, 2**62, (1,), device="cpu"))


def block_seed(seed: int, name: str) -> int:
    """The seed of one block's weights: the model's seed and the block's name, nothing else."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int) -> None:
    """Initialise the blocks `model` holds, each from `block_seed(seed, its name)`: `vision`,
    `decoder.embed`, `decoder.layers.<i>`, `decoder.head` (final norm + LM head), `visual_head`.
    `model` is a MultimodalModel or a pipeline stage of one (blocks it lacks are None, its layers a
    ModuleDict keyed by index): either way a block's values depend on the seed and its name alone,
    never on which other blocks were built first. Draws on the CPU generator, forked (the global
    RNG is left as it was); parameters on another device draw from that device's generator."""
    dec = model.decoder
    blocks = []
    if model.vision is not None:
        blocks.append(("vision", model.vision.reset_parameters))
    if dec.embed is not None:
        blocks.append(("decoder.embed", dec.reset_embed))
    blocks += [(f"decoder.layers.{i}", partial(dec.reset_layer, layer)) for i, layer in dec.numbered_layers()]
    if dec.norm is not None:
        blocks.append(("decoder.head", dec.reset_head))
    if getattr(model, "visual_head", None) is not None:
        blocks.append(("visual_head", partial(_reset_linear, model.visual_head, dec.cfg.init_std)))
    for name, reset in blocks:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(block_seed(seed, name))
            reset()


def _reset_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, std=std)
    nn.init.zeros_(linear.bias)
