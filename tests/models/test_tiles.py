"""The sparse layers' CPU tile kernel (models/attention/tiles.py; gather_kernel "tiles", which
"sdpa" picks for blocks of >= 32 tokens) against the dense eager reference: every kind of call it
makes (sliding window views, gathered visible blocks, the causal own block, masked rests with
spans and picks), strided inputs, what it saves for backward. Fresh random inputs every run (the
seed is printed on failure); test_attention.py runs it too, on random packed batches.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Bs block size.
"""

from __future__ import annotations

import random

import torch

from mmtrain.models.attention import AttentionConfig, attend, build_meta, select_blocks
from mmtrain.models.attention.blocks import sparse_lists
from mmtrain.models.attention.testing import random_batch, random_qkv, rel_err, saved_bytes
from mmtrain.models.attention.tiles import plan_chunks

Tensor = torch.Tensor


def _grads(q, k, v, meta, cfg, w):
    out = attend(q, k, v, meta, cfg, sparse=True)
    return (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))


def _long_docs(B: int, S: int, Bs: int, image: bool) -> tuple[Tensor, Tensor]:
    """Long documents (several per row, at other offsets in each row), optionally an image span."""
    doc_BS = torch.empty(B, S, dtype=torch.int32)
    span_BS = torch.full((B, S), -1, dtype=torch.int32)
    for b in range(B):
        cut = random.randint(S // 3, 2 * S // 3)
        doc_BS[b, :cut], doc_BS[b, cut:] = 0, 1
        if image:
            start = random.randint(Bs, cut - 3 * Bs)
            span_BS[b, start:start + random.randint(Bs, 3 * Bs)] = 0
    return doc_BS, span_BS


def _kinds(meta, cfg, q, k) -> set[str]:
    """The calls the kernel plans for these inputs."""
    sel = select_blocks(q, k, meta, cfg)
    lists_BGAT = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
    kinds = set()
    for plan in plan_chunks(meta, cfg, sel, lists_BGAT, 0, meta.aligned().aligned_blocks, q.shape[-1]):
        for p in plan.parts:
            kinds.add("causal" if p.causal else "masked" if p.mask_nCbJ is not None
                      else "window+own" if p.bias_bJ is not None
                      else "sliding" if p.first_n is not None else "gathered")
    return kinds


def _kinds_match_dense(seed: int, image: bool, window_blocks: int) -> set[str]:
    """Random long documents through the tile kernel against the dense eager reference (outputs and
    gradients); -> the call kinds the kernel planned."""
    B, H, K, D, Bs = 2, 4, 2, 16, 8
    S = random.randint(40, 70) * Bs
    meta = build_meta(*_long_docs(B, S, Bs, image), Bs)
    q, k, v = random_qkv(B, H, K, S, D, dtype=torch.float64)
    w = torch.randn(B, H, S, D, dtype=torch.float64)
    common = dict(block_size=Bs, window=window_blocks * Bs, top_k=random.choice([1, 3]),
                  sink=random.random() < 0.7, select_per=random.choice(["kv_group", "head"]))
    cfg = AttentionConfig(backend="gather", gather_kernel="tiles", gather_chunk=random.randint(2, 9),
                          **common)
    kinds = _kinds(meta, cfg, q, k)
    ref = _grads(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", **common), w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), _grads(q, k, v, meta, cfg, w), ref):
        assert rel_err(a, b) < 1e-10, f"seed={seed} {name} {rel_err(a, b):.2e} {kinds}"
    return kinds


def test_long_documents_take_every_call_kind_and_match_dense(seed):
    """Text: the own causal block rides with the window ("window+own"); an image's span blocks keep
    the window a plain sliding call beside the masked one."""
    image = random.random() < 0.5
    kinds = _kinds_match_dense(seed, image, random.choice([2, 4]))
    assert "masked" in kinds and ("sliding" if image else "window+own") in kinds, kinds


def test_without_a_window_the_own_text_block_is_a_causal_call_and_matches_dense(seed):
    kinds = _kinds_match_dense(seed, image=False, window_blocks=0)
    assert "causal" in kinds and "window+own" not in kinds, kinds


def test_strided_inputs_give_the_same_result(seed):
    """q, k, v as the projections give them (B, S, H, D in memory): read through views, not copied."""
    B, H, K, D, Bs = 2, 4, 2, 16, 8
    S = random.randint(10, 30) * Bs
    meta = build_meta(*random_batch(B, S, Bs), Bs)
    cfg = AttentionConfig(backend="gather", gather_kernel="tiles", block_size=Bs, window=2 * Bs, top_k=2)
    q, k, v = random_qkv(B, H, K, S, D)
    w = torch.randn(B, H, S, D)
    strided = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    for a, b in zip(_grads(*strided, meta, cfg, w), _grads(q, k, v, meta, cfg, w)):
        assert torch.allclose(a, b, atol=1e-6)


def test_saves_no_gathered_tiles(seed):
    """For backward the kernel keeps q, k, v, the output and one log-sum-exp per row: nothing that
    grows with the blocks a tile visits (the eager kernel without checkpointing keeps its tiles)."""
    B, H, K, D, Bs = 1, 4, 2, 16, 8
    S = random.randint(40, 60) * Bs
    meta = build_meta(torch.zeros(B, S, dtype=torch.int32), torch.full((B, S), -1, dtype=torch.int32), Bs)
    q, k, v = random_qkv(B, H, K, S, D)
    saved = {}
    for kernel in ("tiles", "eager"):
        cfg = AttentionConfig(backend="gather", block_size=Bs, window=4 * Bs, top_k=4, gather_kernel=kernel,
                              gather_checkpoint=False)
        saved[kernel] = saved_bytes(lambda cfg=cfg: attend(q, k, v, meta, cfg, sparse=True))[0]
    inputs_and_out = 2 * q.numel() * 4 + 2 * k.numel() * 4  # q, out, k, v
    assert saved["tiles"] <= 3 * inputs_and_out < saved["eager"], (saved, inputs_and_out)
