"""Prefill and one-token decode steps of `MultimodalModel` with a KV cache.

`prefill` runs the training forward's own code over the prompts (the same `attend`, the same
layers), keeping K/V and the sparse layers' selection state; `decode_step` appends one text token
per row and returns its logits. Both apply exactly the training rule, so prefill + decoding
reproduces the full forward's logits at every position (tests/models/test_decode.py).

Prompts: one document per row at positions [0, len_b), padding (document -1) after it, as
`assemble` / `models.testing.pack` lay them out. Generated tokens are text: modality text, M-RoPE
position t = h = w continuing after the prompt's largest position (after a medium the data
pipeline advances by max(t, h, w) of its merged grid, so that is exactly where training puts
the text that follows).

Prefill pads the prompts to a bucketed length (`prompt_bucket`: a power of two, whole blocks) with
padding documents, so compiled code (flex's kernel on CUDA) sees log2 of the prompt lengths'
range in shapes, not one per prompt; padding changes nothing computed (its own document, no
cache entry read: decoding starts at each row's length).

Legend: B rows, S prompt tokens, D model dim, V vocab, H query heads, K kv heads, G selection
heads, E head dim, C cache capacity, N = C / Bs blocks, Q visual tokens.
"""

from __future__ import annotations

import torch

from mmtrain.models.attention import AttnMeta, attend, build_meta
from mmtrain.models.attention.config import AttentionConfig
from mmtrain.models.decoder import scatter_visual

from .attend import full_decode, selection_heads, sparse_decode
from .cache import KVCache, LayerCache, new_layer, refresh_kmean, round_capacity

Tensor = torch.Tensor


def prompt_bucket(S: int, block_size: int) -> int:
    """The padded prompt length: the next power of two >= S (at least 16), in whole blocks."""
    P = max(16, 1 << (S - 1).bit_length())
    return -(-P // block_size) * block_size


def pad_prompts(P: int, tokens_BS: Tensor, pos_ids_3BS: Tensor, doc_ids_BS: Tensor, span_ids_BS: Tensor,
                modality_BS: Tensor) -> tuple[Tensor, ...]:
    """The prompt tensors padded to P positions: padding documents (-1), text, position 0."""
    extra = P - tokens_BS.shape[1]
    pad = torch.nn.functional.pad
    return (pad(tokens_BS, (0, extra)), pad(pos_ids_3BS, (0, extra)), pad(doc_ids_BS, (0, extra), value=-1),
            pad(span_ids_BS, (0, extra), value=-1), pad(modality_BS, (0, extra)))


def prompt_lengths(doc_ids_BS: Tensor) -> Tensor:
    """Tokens per row; checks the layout (document 0 from position 0, then padding -1 only)."""
    len_B = (doc_ids_BS >= 0).sum(1)
    pos_S = torch.arange(doc_ids_BS.shape[1], device=doc_ids_BS.device)
    want_BS = torch.where(pos_S < len_B[:, None], 0, -1)
    if not bool((doc_ids_BS == want_BS).all()) or not bool((len_B > 0).all()):
        raise ValueError("doc_ids: a prompt row is one document (id 0) from position 0, then padding (-1)")
    return len_B


@torch.no_grad()
def encode_media(model, patches_NP: Tensor, grid_thw_M3: Tensor) -> Tensor | None:
    """The merged visual tokens of the prompts' media (run once per prompt batch), None without media."""
    return model.vision(patches_NP, grid_thw_M3) if grid_thw_M3.shape[0] else None


@torch.no_grad()
def prefill(model, tokens_BS: Tensor, pos_ids_3BS: Tensor, doc_ids_BS: Tensor, span_ids_BS: Tensor,
            modality_BS: Tensor, patches_NP: Tensor, grid_thw_M3: Tensor, capacity: int,
            visual_QD: Tensor | None = None) -> tuple[Tensor, KVCache]:
    """-> (final-norm hidden states (B, S, D) of the prompts, the cache for `capacity` positions).

    `visual_QD`: the media's merged tokens when already encoded (`encode_media`)."""
    dec = model.decoder
    cfg: AttentionConfig = dec.cfg.attention
    len_B = prompt_lengths(doc_ids_BS)
    if visual_QD is None:
        visual_QD = encode_media(model, patches_NP, grid_thw_M3)
    S = tokens_BS.shape[1]
    P = prompt_bucket(S, cfg.block_size)
    tokens_BS, pos_ids_3BS, doc_ids_BS, span_ids_BS, modality_BS = pad_prompts(
        P, tokens_BS, pos_ids_3BS, doc_ids_BS, span_ids_BS, modality_BS)
    h_BSD = dec.embed(tokens_BS)
    if visual_QD is not None:
        h_BSD = scatter_visual(h_BSD, modality_BS, visual_QD)
    cos_B1SF, sin_B1SF = dec.rotary(pos_ids_3BS)
    meta = build_meta(doc_ids_BS, span_ids_BS, cfg.block_size)
    C = round_capacity(max(capacity, S + 1, P), cfg.block_size)  # room for one more, and the padding
    cache = new_cache(model, tokens_BS.shape[0], C, h_BSD.dtype, h_BSD.device)
    for layer, lc in zip(dec.layers, cache.layers):
        q_BHSE, k_BKSE, v_BKSE = layer.attn.project(layer.attn_norm(h_BSD), cos_B1SF, sin_B1SF)
        h_BSD = h_BSD + layer.attn.output(attend(q_BHSE, k_BKSE, v_BKSE, meta, cfg, layer.sparse))
        h_BSD, _ = layer.feed_forward(h_BSD, modality_BS, meta.real_BS)
        _fill(lc, cfg, meta, q_BHSE, k_BKSE, v_BKSE, len_B)
    real_3BS = (doc_ids_BS >= 0)[None].expand_as(pos_ids_3BS)
    cache.len_B = len_B
    cache.pos_B = torch.where(real_3BS, pos_ids_3BS, -1).amax(dim=(0, 2)) + 1
    return dec.norm(h_BSD[:, :S]), cache


@torch.no_grad()
def decode_step(model, cache: KVCache, tokens_B: Tensor) -> Tensor:
    """Append one text token per row (at position len_b) -> its logits (B, V)."""
    dec = model.decoder
    cfg: AttentionConfig = dec.cfg.attention
    p_B, B = cache.len_B, cache.batch
    if int(p_B.max()) >= cache.capacity:
        raise ValueError(f"capacity: the cache holds {cache.capacity} positions; a row is full")
    h_B1D = dec.embed(tokens_B.view(B, 1))
    cos_B11F, sin_B11F = dec.rotary(cache.pos_B.view(1, B, 1).expand(3, B, 1))
    text_B1 = torch.zeros(B, 1, dtype=torch.int8, device=p_B.device)
    real_B1 = torch.ones(B, 1, dtype=torch.bool, device=p_B.device)
    for layer, lc in zip(dec.layers, cache.layers):
        q_BH1E, k_BK1E, v_BK1E = layer.attn.project(layer.attn_norm(h_B1D), cos_B11F, sin_B11F)
        _write(lc, k_BK1E, v_BK1E, p_B)
        if lc.sparse:
            refresh_kmean(lc, p_B // cfg.block_size, cfg.block_size)
            o_BH1E = sparse_decode(q_BH1E, lc, p_B, cfg)
        else:
            o_BH1E = full_decode(q_BH1E, lc, p_B)
        h_B1D = h_B1D + layer.attn.output(o_BH1E)
        h_B1D, _ = layer.feed_forward(h_B1D, text_B1, real_B1)
    cache.len_B = p_B + 1
    cache.pos_B = cache.pos_B + 1
    return dec.logits(dec.norm(h_B1D))[:, 0]


def new_cache(model, B: int, C: int, dtype: torch.dtype, device: torch.device | None = None) -> KVCache:
    """An empty cache of B rows and C positions (prefill fills it; benchmarks may fill it directly), on
    `device` (default: the embedding's; a streamed model's weights are on the device only in use)."""
    dcfg = model.decoder.cfg
    acfg, K, E = dcfg.attention, dcfg.n_kv_heads, dcfg.head_dim
    G = selection_heads(acfg, dcfg.n_heads, K)
    dev = device if device is not None else model.decoder.embed.weight.device
    layers = [new_layer(B, K, C, E, dtype, dev, layer.sparse, G, acfg.block_size, acfg.select == "block")
              for layer in model.decoder.layers]
    zeros_B = torch.zeros(B, dtype=torch.long, device=dev)
    return KVCache(layers, zeros_B, zeros_B.clone(), acfg.block_size)


def _write(lc: LayerCache, k_BK1E: Tensor, v_BK1E: Tensor, p_B: Tensor) -> None:
    B, K, _, E = k_BK1E.shape
    idx_BK1E = p_B.view(B, 1, 1, 1).expand(B, K, 1, E)
    lc.k_BKCE.scatter_(2, idx_BK1E, k_BK1E.to(lc.k_BKCE.dtype))
    lc.v_BKCE.scatter_(2, idx_BK1E, v_BK1E.to(lc.v_BKCE.dtype))


def _fill(lc: LayerCache, cfg: AttentionConfig, meta: AttnMeta, q_BHSE: Tensor, k_BKSE: Tensor,
          v_BKSE: Tensor, len_B: Tensor) -> None:
    """Store the prompts' K/V (zeros past each row's length) and the sparse selection state."""
    B, H, S, E = q_BHSE.shape
    K, C, Bs = k_BKSE.shape[1], lc.k_BKCE.shape[2], cfg.block_size
    real_B11S = meta.real_BS.view(B, 1, S, 1)
    lc.k_BKCE[:, :, :S] = k_BKSE * real_B11S
    lc.v_BKCE[:, :, :S] = v_BKSE * real_B11S
    if not lc.sparse:
        return
    N = C // Bs
    lc.kmean_BKNE.copy_(lc.k_BKCE.float().view(B, K, N, Bs, E).sum(-2) / Bs)
    vis_BC = torch.zeros(B, C, dtype=torch.bool, device=q_BHSE.device)
    vis_BC[:, :S] = meta.vis_BS & meta.real_BS
    lc.vis_BN.copy_(vis_BC.view(B, N, Bs).any(-1))
    if lc.qprev_BGE is None:
        return
    G = lc.qprev_BGE.shape[1]
    qsel_BGSE = q_BHSE.float().view(B, G, H // G, S, E).mean(2) * meta.real_BS.view(B, 1, S, 1)
    qsel_BGCE = torch.zeros(B, G, C, E, device=q_BHSE.device)
    qsel_BGCE[:, :, :S] = qsel_BGSE
    blocks_BGNbE = qsel_BGCE.view(B, G, N, Bs, E)
    nq_B = len_B // Bs
    b_B = torch.arange(B, device=len_B.device)
    lc.qcur_BGbE.copy_(blocks_BGNbE[b_B, :, nq_B])
    prev_BGE = blocks_BGNbE[b_B, :, (nq_B - 1).clamp_min(0)].sum(-2) / Bs
    lc.qprev_BGE.copy_(torch.where((nq_B > 0).view(B, 1, 1), prev_BGE, 0.0))
    lc.kept = None
