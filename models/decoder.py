"""The decoder: token embedding + scattered visual tokens, pre-norm blocks (QK-norm, GQA,
M-RoPE, full or sparse attention per layer), dense SwiGLU or MoE FFN, final norm, LM head.

Legend: B batch rows, S tokens, D model dim, V vocab, Q visual tokens in the batch,
F rotary pairs (head_dim / 2), L layers.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from mmtrain.checks import check

from .attention import AttentionConfig, build_meta
from .attention.api import measure
from .attention.context import ContextShard
from .chunked import over_tokens
from .ffn import SwiGLU
from .moe import MoE, MoEConfig
from .norms import RMSNorm
from .rope import axial_angles, mrope_freqs
from .self_attention import SelfAttention

Tensor = torch.Tensor


@dataclass
class DecoderConfig:
    vocab_size: int | None = None  # filled from the tokenizer by the trainer
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384  # dense SwiGLU hidden width
    rope_theta: float = 10000.0
    mrope_sections: tuple[int, int, int] = (4, 6, 6)  # (t, h, w) pairs; sum = head_dim / 2
    qk_norm: bool = True
    tie_embeddings: bool = False
    layer_layout: str = "FSSS"  # repeated over layers: F full attention, S sparse
    # FFN / MoE experts on chunks of this many tokens, each checkpointed (0: all at once). For
    # long context: bounds the FFN's share of a layer's recompute memory (models/chunked.py).
    ffn_chunk: int = 0
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig | None = None
    init_std: float = 0.02
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check(self, "vocab_size", ge=1, none_ok=True)
        check(self, "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", ge=1)
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"n_heads: must divide dim {self.dim} into even head dims (got {self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: must divide n_heads {self.n_heads} (got {self.n_kv_heads})")
        self.mrope_sections = tuple(self.mrope_sections)
        half = self.dim // self.n_heads // 2
        if len(self.mrope_sections) != 3 or sum(self.mrope_sections) != half or min(self.mrope_sections) < 0:
            raise ValueError(f"mrope_sections: need 3 non-negative ints summing to head_dim / 2 = {half} "
                             f"(got {list(self.mrope_sections)})")
        if not self.layer_layout or set(self.layer_layout) - {"F", "S"}:
            raise ValueError(f"layer_layout: a non-empty string of F and S (got {self.layer_layout!r})")
        check(self, "init_std", gt=0)
        check(self, "ffn_chunk", ge=0)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_sparse(self, layer: int) -> bool:
        return self.layer_layout[layer % len(self.layer_layout)] == "S"

    def layer_kinds(self) -> list[tuple[bool, bool]]:
        """(MoE, sparse) of each layer: layers of one kind cost alike and compile to one graph."""
        return [(self.is_moe(i), self.is_sparse(i)) for i in range(self.n_layers)]

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_dense_layers


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.sparse = cfg.is_sparse(layer)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = SelfAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.qk_norm, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_chunk = cfg.ffn_chunk
        self.ffn = (MoE(cfg.dim, cfg.moe, cfg.ffn_chunk) if cfg.is_moe(layer)
                    else SwiGLU(cfg.dim, cfg.ffn_dim))

    def forward(self, x_BSD: Tensor, cos_B1SF: Tensor, sin_B1SF: Tensor, meta, attn_cfg: AttentionConfig,
                modality_BS: Tensor, measured: bool = False, context: ContextShard | None = None
                ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """-> (x, aux, qk); aux is {} for a dense FFN, else the MoE's losses and load (a pytree);
        qk is {"q", "k"} (detached) when `measured`, else {}: captures and attention counts are
        computed from them outside the layer, so a compiled layer (under FSDP too) returns them as
        outputs, one graph per flag value. With `context`, x and modality are this rank's chunk of
        every row, meta the whole rows'."""
        out = self.attn(self.attn_norm(x_BSD), cos_B1SF, sin_B1SF, meta, attn_cfg, sparse=self.sparse,
                        context=context, return_qk=measured)
        a_BSD, qk = (out[0], {"q": out[1], "k": out[2]}) if measured else (out, {})
        x_BSD = x_BSD + a_BSD
        if context is None:
            return *self.feed_forward(x_BSD, modality_BS, meta.real_BS), qk
        return *self.feed_forward(x_BSD, modality_BS, context.local(meta.real_BS), context.comm.sum), qk

    def feed_forward(self, x_BSD: Tensor, modality_BS: Tensor, real_BS: Tensor,
                     row_sum=None) -> tuple[Tensor, dict]:
        """The FFN half of the block (also the KV-cache decode step's): -> (x, aux). `row_sum`
        completes the MoE's per-row balance statistics over a row split across ranks."""
        h_BSD = self.ffn_norm(x_BSD)
        if isinstance(self.ffn, MoE):
            y_BSD, aux = self.ffn(h_BSD, modality_BS, real_BS, row_sum)
            return x_BSD + y_BSD, aux
        y_TD = over_tokens(self.ffn, self.ffn_chunk, h_BSD.flatten(0, 1))
        return x_BSD + y_TD.view_as(x_BSD), {}


@dataclass
class DecoderOutput:
    hidden_BSD: Tensor  # after the final norm
    aux_losses: dict[str, Tensor]  # weighted, summed over layers
    expert_load: dict[int, Tensor] | None  # layer -> (3, E) int64 counts (text, image, video)
    router_entropy: dict[int, Tensor] | None  # layer -> (3,) mean routing entropy per modality
    captures: dict[int, dict]
    attn_stats: dict[int, dict[str, Tensor]]  # layer -> what attention visited (attention/counts.py)


def scatter_visual(h_BSD: Tensor, modality_BS: Tensor, visual_QD: Tensor) -> Tensor:
    """Visual tokens, in order, into the placeholder positions (modality != text), row-major."""
    Q = visual_QD.shape[0]
    visual_BS = modality_BS != 0
    # the count is known (the encoder's tokens): a static nonzero, no host read; the device checks it
    torch._assert_async(visual_BS.sum() == Q, "modality: the visual placeholders are not as many as "
                        "the vision encoder's tokens")
    b_Q, s_Q = torch.nonzero_static(visual_BS, size=Q).unbind(1)
    return h_BSD.index_put((b_Q, s_Q), visual_QD.to(h_BSD.dtype))


def local_visual(modality_BS: Tensor, visual_QD: Tensor, lo: int, hi: int) -> Tensor:
    """The visual tokens whose placeholders lie in positions [lo, hi) of their rows (row-major)."""
    _, s_Q = torch.nonzero(modality_BS != 0, as_tuple=True)
    if s_Q.numel() != visual_QD.shape[0]:
        raise ValueError(f"modality: {s_Q.numel()} visual placeholders but the vision encoder "
                         f"returned {visual_QD.shape[0]} tokens")
    return visual_QD[(s_Q >= lo) & (s_Q < hi)]


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("vocab_size: must be set before building the model (got None)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(init_std); residual-branch outputs scaled by 1 / sqrt(2 L) (GPT-2/Megatron). The
        parts in order from the global RNG; MultimodalModel.init_weights seeds each part itself."""
        self.reset_embed()
        for layer in self.layers:
            self.reset_layer(layer)
        self.reset_head()

    def reset_embed(self) -> None:
        nn.init.normal_(self.embed.weight, std=self.cfg.init_std)

    def reset_layer(self, layer: DecoderLayer) -> None:
        std = self.cfg.init_std
        out_std = std / (2 * self.cfg.n_layers) ** 0.5
        layer.attn.reset_parameters(std, out_std)
        layer.attn_norm.reset_parameters()
        layer.ffn_norm.reset_parameters()
        if isinstance(layer.ffn, MoE):
            layer.ffn.reset_parameters(std, out_std)
        else:
            nn.init.normal_(layer.ffn.w_in.weight, std=std)
            nn.init.normal_(layer.ffn.w_out.weight, std=out_std)

    def reset_head(self) -> None:
        """The final norm and the LM head (untied)."""
        self.norm.reset_parameters()
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=self.cfg.init_std)

    def numbered_layers(self) -> list[tuple[int, DecoderLayer]]:
        """(index, layer) of the layers this decoder holds: all of them, or a pipeline stage's
        (a ModuleDict keyed by the full model's indices)."""
        if isinstance(self.layers, nn.ModuleDict):
            return [(int(k), layer) for k, layer in self.layers.items()]
        return list(enumerate(self.layers))

    def moe_layers(self) -> dict[int, MoE]:
        return {i: layer.ffn for i, layer in self.numbered_layers() if isinstance(layer.ffn, MoE)}

    def rotary(self, pos_ids_3BS: Tensor) -> tuple[Tensor, Tensor]:
        freqs = mrope_freqs(self.cfg.head_dim, self.cfg.mrope_sections, self.cfg.rope_theta,
                            pos_ids_3BS.device)
        angles_BSF = axial_angles(pos_ids_3BS, freqs)
        return angles_BSF.cos()[:, None], angles_BSF.sin()[:, None]  # (B, 1, S, F): broadcast heads

    def forward(self, tokens_BS: Tensor, pos_ids_3BS: Tensor, doc_ids_BS: Tensor, span_ids_BS: Tensor,
                modality_BS: Tensor, visual_QD: Tensor | None = None,
                capture_layers: Collection[int] | None = None, attn_stats: bool = False,
                context: ContextShard | None = None, knockout_BS: Tensor | None = None) -> DecoderOutput:
        """doc_ids < 0 mark padding (not routed by MoE, not counted); `attn_stats` asks every layer
        for the counts of what its attention visited (keys, kept and reachable blocks). With
        `context` (context parallelism) the inputs are whole rows and the outputs this rank's chunk.
        `knockout_BS` (bool): tokens made invisible to every other token (attention/knockout.py)."""
        meta = build_meta(doc_ids_BS, span_ids_BS, self.cfg.attention.block_size,  # once, all layers
                          knockout_BS=knockout_BS)
        if context is not None and (capture_layers or attn_stats):
            raise ValueError("attend: capture and stats need whole rows (run without context parallelism)")
        if context is not None:
            tokens_BS, modality_BS, pos_ids_3BS, visual_QD = self.shard_inputs(
                context, tokens_BS, modality_BS, pos_ids_3BS, visual_QD)
        h_BSD = self.embed_tokens(tokens_BS, modality_BS, visual_QD)
        captures = {i: {} for i in (capture_layers or ())}
        stats = {i: {} for i in range(len(self.layers))} if attn_stats else {}
        h_BSD, aux_losses, load, entropy = self.run_layers(h_BSD, pos_ids_3BS, meta, modality_BS, context,
                                                           captures, stats)
        return DecoderOutput(self.norm(h_BSD), aux_losses, load or None, entropy or None, captures, stats)

    def shard_inputs(self, context: ContextShard, tokens_BS: Tensor | None, modality_BS: Tensor,
                     pos_ids_3BS: Tensor, visual_QD: Tensor | None) -> tuple:
        """Whole rows -> this rank's chunk (context / sequence parallelism): its tokens (None stays
        None: a later pipeline stage, whose input is the chunk already), modality and visual tokens,
        and the positions whose rotary tables its attention projects."""
        if visual_QD is not None:
            visual_QD = local_visual(modality_BS, visual_QD, context.lo, context.hi)
        tokens_BS = None if tokens_BS is None else context.local(tokens_BS)
        return tokens_BS, context.local(modality_BS), context.rotary_local(pos_ids_3BS), visual_QD

    def embed_tokens(self, tokens_BS: Tensor, modality_BS: Tensor, visual_QD: Tensor | None) -> Tensor:
        """The token embedding with the visual tokens scattered into their placeholders."""
        h_BSD = self.embed(tokens_BS)
        return h_BSD if visual_QD is None else scatter_visual(h_BSD, modality_BS, visual_QD)

    def run_layers(self, h_BSD: Tensor, pos_ids_3BS: Tensor, meta, modality_BS: Tensor,
                   context: ContextShard | None, captures: dict, stats: dict) -> tuple:
        """The layers this decoder holds (all, or a pipeline stage's: `numbered_layers`) on h_BSD ->
        (h_BSD before the final norm, {aux loss: sum over them}, {layer: load_3E},
        {layer: router_entropy_3}); fills `captures` / `stats` for the layers keyed there."""
        cos_B1SF, sin_B1SF = self.rotary(pos_ids_3BS)
        aux_losses: dict[str, Tensor] = {}
        load, entropy = {}, {}
        for i, layer in self.numbered_layers():  # the layer as wrapped (compiled, FSDP): its hooks run
            h_BSD, aux, qk = layer(h_BSD, cos_B1SF, sin_B1SF, meta, self.cfg.attention, modality_BS,
                                   i in captures or i in stats, context)
            if qk:  # eager, outside the compiled layer (the selection reads the host)
                measure(qk["q"], qk["k"], meta, self.cfg.attention, self.cfg.is_sparse(i), captures.get(i),
                        stats.get(i))
            if aux:
                for name in ("moe_seq_balance", "router_z"):
                    aux_losses[name] = aux_losses.get(name, 0.0) + aux[name]
                load[i], entropy[i] = aux["load_3E"], aux["router_entropy_3"]
                if self.training:  # here, not in the layer: activation checkpointing replays layers
                    layer.ffn.accumulate_load(aux["load_3E"])
        return h_BSD, aux_losses, load, entropy

    def logits(self, hidden_BSD: Tensor) -> Tensor:
        if self.lm_head is not None:  # the module's call (its hooks run: pipeline_replica.Streamed)
            return self.lm_head(hidden_BSD)
        return nn.functional.linear(hidden_BSD, self.embed.weight)
