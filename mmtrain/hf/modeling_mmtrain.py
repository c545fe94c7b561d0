"""An exported mmtrain model for transformers (remote code): `AutoModelForCausalLM` and
`AutoModelForImageTextToText` load `MmtrainForConditionalGeneration`.

The vision tower (vision_mmtrain.py) encodes the media; its tokens replace the placeholder
embeddings (image_token_id / video_token_id, one per merged visual token); the decoder is pre-norm
RMSNorm blocks with GQA, QK-norm and M-RoPE (positions from the token layout, layout_mmtrain.py),
full or sparse attention per `layer_types` (attention_mmtrain.py), a dense SwiGLU or an MoE FFN
(moe_mmtrain.py), a final norm and the LM head. Decoding keeps transformers' `DynamicCache`
(built from the config, with mmtrain's cache layers: cache_mmtrain.py) and appends one token per
row; the prompt may be left-padded. Attention runs "eager" or "sdpa" with a materialised mask
(the reference; long contexts want a block-sparse kernel); any other implementation (flash,
flex, an inference server's own kernels) is refused, since it would drop the sparse layers' rule.

Legend: B rows, S new tokens, T cached + new tokens, D model dim, V vocab, H query heads, K kv heads,
E head dim, F rotary pairs, Q visual tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention_mmtrain import SparseRule, block_tables, prefill_mask, token_mask
from .cache_mmtrain import MmtrainFullCacheLayer, MmtrainSparseCacheLayer
from .configuration_mmtrain import SPARSE, MmtrainConfig
from .layout_mmtrain import TEXT, Layout, token_layout
from .moe_mmtrain import MmtrainMoE
from .ops_mmtrain import (
    ATTN_IMPLEMENTATIONS,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    attention,
    axial_angles,
    mrope_freqs,
)
from .vision_mmtrain import MmtrainVision

Tensor = torch.Tensor


class MmtrainAttention(nn.Module):
    def __init__(self, config: MmtrainConfig, layer: int) -> None:
        super().__init__()
        D, H, K, E = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.config, self.layer = config, layer
        self.sparse = config.layer_types[layer] == SPARSE
        self.q_proj = nn.Linear(D, H * E, bias=False)
        self.k_proj = nn.Linear(D, K * E, bias=False)
        self.v_proj = nn.Linear(D, K * E, bias=False)
        self.o_proj = nn.Linear(H * E, D, bias=False)
        self.q_norm = RMSNorm(E, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(E, config.rms_norm_eps) if config.qk_norm else None

    def project(self, x_BSD: Tensor, cos_B1SF: Tensor, sin_B1SF: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, S, _ = x_BSD.shape
        E = self.config.head_dim
        q_BHSE = self.q_proj(x_BSD).view(B, S, -1, E).transpose(1, 2)
        k_BKSE = self.k_proj(x_BSD).view(B, S, -1, E).transpose(1, 2)
        v_BKSE = self.v_proj(x_BSD).view(B, S, -1, E).transpose(1, 2)
        if self.q_norm is not None:
            q_BHSE, k_BKSE = self.q_norm(q_BHSE), self.k_norm(k_BKSE)
        return apply_rotary(q_BHSE, cos_B1SF, sin_B1SF), apply_rotary(k_BKSE, cos_B1SF, sin_B1SF), v_BKSE

    def forward(
        self,
        x_BSD: Tensor,
        cos_B1SF: Tensor,
        sin_B1SF: Tensor,
        lay: Layout,
        tok_B1SS: Tensor | None,
        cache: Cache | None,
    ) -> Tensor:
        q_BHSE, k_BKSE, v_BKSE = self.project(x_BSD, cos_B1SF, sin_B1SF)
        impl = self.config._attn_implementation
        rule = SparseRule.of(self.config)
        lc = cache.layers[self.layer] if cache is not None else None
        if tok_B1SS is not None:  # a whole prompt (cache empty, or none)
            mask_BhSS = tok_B1SS
            if self.sparse:
                tab = block_tables(q_BHSE, k_BKSE, lay, rule)
                mask_BhSS = prefill_mask(tab, lay, rule, tok_B1SS)
                mask_BhSS = mask_BhSS.repeat_interleave(q_BHSE.shape[1] // mask_BhSS.shape[1], 1)
            if lc is not None:
                lc.update(k_BKSE, v_BKSE)
                lc.set_rows(lay.real_BS, lay.real_BS.sum(1), lay.next_pos_B - lay.real_BS.sum(1))
                if self.sparse:
                    lc.fill(tab, rule)
            out_BHSE = attention(q_BHSE, k_BKSE, v_BKSE, mask_BhSS, impl)
        else:  # one new text token per row after the cached ones
            k_BKTE, v_BKTE = lc.update(k_BKSE, v_BKSE)
            lc.set_rows(torch.cat([lc.real_BT, lay.real_BS], 1), lc.len_B + 1, lc.rope_delta_B)
            if self.sparse:
                key_rank_BT = lc.real_BT.long().cumsum(1) - 1
                mask_BG1T = lc.decode_mask(q_BHSE, rule, key_rank_BT)
                mask_BhST = mask_BG1T.repeat_interleave(q_BHSE.shape[1] // mask_BG1T.shape[1], 1)
            else:
                mask_BhST = lc.real_BT[:, None, None, :]
            out_BHSE = attention(q_BHSE, k_BKTE, v_BKTE, mask_BhST, impl)
        B, H, S, E = out_BHSE.shape
        return self.o_proj(out_BHSE.transpose(1, 2).reshape(B, S, H * E))


class MmtrainDecoderLayer(nn.Module):
    def __init__(self, config: MmtrainConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MmtrainAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (
            MmtrainMoE(config)
            if config.is_moe(layer)
            else SwiGLU(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self,
        x_BSD: Tensor,
        cos_B1SF: Tensor,
        sin_B1SF: Tensor,
        lay: Layout,
        tok_B1SS: Tensor | None,
        cache: Cache | None,
    ) -> Tensor:
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), cos_B1SF, sin_B1SF, lay, tok_B1SS, cache)
        h_BSD = self.post_attention_layernorm(x_BSD)
        if isinstance(self.mlp, MmtrainMoE):
            return x_BSD + self.mlp(h_BSD, lay.modality_BS != TEXT, lay.real_BS)
        return x_BSD + self.mlp(h_BSD)


class MmtrainTextModel(nn.Module):
    def __init__(self, config: MmtrainConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MmtrainDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MmtrainPreTrainedModel(PreTrainedModel):
    config_class = MmtrainConfig
    config: MmtrainConfig
    base_model_prefix = "model"
    input_modalities = ("image", "video", "text")
    _no_split_modules = ["MmtrainDecoderLayer", "VisionBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # vLLM's Transformers backend (and similar servers) needs this to swap in its own attention,
    # which would run the sparse layers as plain causal attention: refused (docs/EXPORT.md).
    _supports_attention_backend = False
    _keep_in_fp32_modules_strict = ["gate"]  # routing is fp32 in mmtrain (the router and its bias)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the export; what is not in it is initialised as mmtrain's reset does."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class MmtrainModel(MmtrainPreTrainedModel):
    def __init__(self, config: MmtrainConfig) -> None:
        super().__init__(config)
        self.visual = MmtrainVision(config.vision, config.hidden_size)
        self.language_model = MmtrainTextModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.language_model.embed_tokens = value

    def _check_impl(self) -> None:
        impl = self.config._attn_implementation
        if impl not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation {impl!r}: mmtrain's sparse layers need their block rule; "
                f"use one of {ATTN_IMPLEMENTATIONS} (docs/EXPORT.md: serving needs a block-sparse "
                "kernel, e.g. a vLLM model plugin)"
            )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        pixel_values_videos: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        **kwargs,
    ) -> tuple[Tensor, Cache | None]:
        """-> (final-norm hidden states (B, S, D), the cache)."""
        self._check_impl()
        cfg = self.config
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds: not supported (the layout is read from input_ids)")
        real_BS = (
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones_like(input_ids, dtype=torch.bool)
        )
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=cfg)
        past = cache.get_seq_length() if cache is not None else 0
        real_BS = real_BS[:, -input_ids.shape[1] :]
        h_BSD = self.language_model.embed_tokens(input_ids)
        if past == 0:
            lay = token_layout(
                input_ids,
                real_BS,
                image_grid_thw,
                video_grid_thw,
                cfg.image_token_id,
                cfg.video_token_id,
                cfg.vision["spatial_merge_size"],
            )
            h_BSD = self._scatter_media(
                h_BSD, lay, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
            tok_B1SS = token_mask(lay)
        else:
            lay = self._decode_layout(input_ids, real_BS, cache)
            tok_B1SS = None
        cos_B1SF, sin_B1SF = self._rotary(lay.pos_3BS)
        for layer in self.language_model.layers:
            h_BSD = layer(h_BSD, cos_B1SF, sin_B1SF, lay, tok_B1SS, cache)
        return self.language_model.norm(h_BSD), cache

    def _rotary(self, pos_3BS: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.config
        angles_BSF = axial_angles(
            pos_3BS, mrope_freqs(cfg.head_dim, cfg.mrope_section, cfg.rope_theta, pos_3BS.device)
        )
        return angles_BSF.cos()[:, None], angles_BSF.sin()[:, None]

    def _decode_layout(self, ids_BS: Tensor, real_BS: Tensor, cache: Cache) -> Layout:
        """One new text token per row, right after the cached ones (rank = document length so far)."""
        for i, lc in enumerate(cache.layers):
            want = MmtrainSparseCacheLayer if self.config.layer_types[i] == SPARSE else MmtrainFullCacheLayer
            if not isinstance(lc, want):
                raise ValueError(
                    "cache: build it with DynamicCache(config=model.config) (mmtrain's cache layers)"
                )
        if ids_BS.shape[1] != 1 or not bool(real_BS.all()):
            raise ValueError("input_ids: after the prompt, decode one real token per row at a time")
        if bool((ids_BS == self.config.image_token_id).any() | (ids_BS == self.config.video_token_id).any()):
            raise ValueError("input_ids: media go in the prompt, not in a decode step")
        lc = cache.layers[0]
        rank_B1 = lc.len_B[:, None]
        pos_3B1 = (rank_B1 + lc.rope_delta_B[:, None])[None].expand(3, -1, -1)
        zeros_B1 = torch.zeros_like(rank_B1)
        return Layout(real_BS, rank_B1, zeros_B1, zeros_B1 - 1, pos_3B1)

    def _scatter_media(
        self, h_BSD: Tensor, lay: Layout, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
    ) -> Tensor:
        impl = self.config._attn_implementation
        for kind, pixels, grid in (
            (1, pixel_values, image_grid_thw),
            (2, pixel_values_videos, video_grid_thw),
        ):
            where_BS = lay.modality_BS == kind
            if not bool(where_BS.any()):
                continue
            if pixels is None:
                raise ValueError(
                    f"input_ids: {('image', 'video')[kind - 1]} placeholders without pixel values"
                )
            tokens_QD = self.visual(pixels.to(self.visual.patch_embed.proj.weight.dtype), grid, impl)
            h_BSD = h_BSD.masked_scatter(where_BS[..., None], tokens_QD.to(h_BSD.dtype))
        return h_BSD


class MmtrainForConditionalGeneration(MmtrainPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}

    def __init__(self, config: MmtrainConfig) -> None:
        super().__init__(config)
        self.model = MmtrainModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: Cache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        pixel_values_videos: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        hidden_BSD, cache = self.model(
            input_ids,
            attention_mask,
            cache,
            use_cache,
            pixel_values,
            image_grid_thw,
            pixel_values_videos,
            video_grid_thw,
            **kwargs,
        )
        logits_BSV = self.lm_head(hidden_BSD[:, -logits_to_keep:] if logits_to_keep else hidden_BSD)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits_BSV, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits_BSV, cache=cache)


__all__ = ["MmtrainForConditionalGeneration", "MmtrainModel", "MmtrainPreTrainedModel"]
