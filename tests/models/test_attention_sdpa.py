"""The `sdpa` backend (fused SDPA per document, sdpa.py) against the dense eager reference, on
outputs and gradients: packed documents, padding, images and videos crossing tiles, GQA, every
kind of segment (causal with span patches, one-span documents, grouped short documents), rows
whose documents are not contiguous, and the compiled custom op. Fresh random inputs every run.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Bs block size.
"""

from __future__ import annotations

import random

import pytest
import torch

from mmtrain.models.attention import AttentionConfig, attend, build_meta
from mmtrain.models.attention.opaque import config_json
from mmtrain.models.attention.sdpa import plan, sdpa_full_op
from mmtrain.models.attention.testing import pack_row, random_batch, random_doc_spans, random_qkv, rel_err


def run(q, k, v, meta, cfg, w):
    out = attend(q, k, v, meta, cfg, False)
    return (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))


def check(doc_BS, span_BS, H, K, group, seed, D=16):
    B, S = doc_BS.shape
    meta = build_meta(doc_BS, span_BS, 8)
    q, k, v = random_qkv(B, H, K, S, D)
    w = torch.randn(B, H, S, D)
    ref = run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=8), w)
    got = run(q, k, v, meta, AttentionConfig(backend="sdpa", block_size=8, sdpa_group=group), w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-4, f"seed={seed} group={group} {name} {rel_err(a, b):.2e}"
    return meta


@pytest.mark.parametrize("H,K", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("group", [0, 8, 64, 256])
def test_sdpa_matches_dense(seed, H, K, group):
    B, S = random.randint(1, 3), random.randint(20, 400)
    doc_BS, span_BS = random_batch(B, S, random.choice([4, 16]), visual=random.random() < 0.8)
    meta = check(doc_BS, span_BS, H, K, group, seed)
    kinds = {seg.kind for row in plan(meta.doc_BS, meta.skey_BS, meta.span_last_BS, group) for seg in row}
    assert kinds <= {"causal", "full", "mask", "batch"}  # batch: equal one-span documents in a run


def test_sdpa_every_segment_kind(seed):
    """A long document with images and a video (span patches), media of equal length (one batched
    call), one that is a single span (no mask, no causality), and short documents grouped together,
    then padding."""
    long_doc = random_doc_spans(random.randint(100, 200), 8)
    media = [torch.zeros(random.randint(5, 15), dtype=torch.int32)] * random.randint(2, 4)  # equal spans
    one_span = torch.zeros(random.randint(20, 40), dtype=torch.int32)
    short = [random_doc_spans(random.randint(1, 12), 4) for _ in range(random.randint(2, 5))]
    docs = [long_doc, *media, one_span] + short
    doc_S, span_S = pack_row(docs, sum(len(d) for d in docs) + random.randint(0, 7))
    meta = check(doc_S[None], span_S[None], 4, 2, 16, seed)
    segs = plan(meta.doc_BS, meta.skey_BS, meta.span_last_BS, 16)[0]
    assert {s.kind for s in segs} == {"causal", "batch", "full", "mask"}, segs
    if (long_doc >= 0).any():
        assert any(s.patches for s in segs if s.kind == "causal"), segs


def test_sdpa_documents_not_contiguous_fall_back(seed):
    S = random.randint(20, 60)
    doc_S = torch.randint(0, 3, (1, S), dtype=torch.int32)  # documents interleaved token by token
    span_S = torch.full((1, S), -1, dtype=torch.int32)
    meta = check(doc_S, span_S, 4, 2, 4, seed)
    assert plan(meta.doc_BS, meta.skey_BS, meta.span_last_BS, 4) is None


@pytest.mark.parametrize("layout", ["random", "every kind"])
def test_sdpa_custom_op_matches_dense(seed, layout):
    """The opaque op that torch.compile sees (its backward runs from the saved lse): any row layout,
    and a row with every kind of segment (causal with span patches, batched media, one span,
    grouped, padding)."""
    if layout == "random":
        B, S = 2, random.randint(30, 200)
        doc_BS, span_BS = random_batch(B, S, 8)
        if random.random() < 0.5:
            doc_BS[0] = torch.randint(0, 3, (S,), dtype=torch.int32)
            span_BS[0] = -1
    else:
        one_span = torch.zeros(random.randint(20, 40), dtype=torch.int32)
        media = [torch.zeros(random.randint(5, 15), dtype=torch.int32)] * 3  # equal spans: one batch
        docs = [random_doc_spans(random.randint(100, 200), 8), *media, one_span,
                *[random_doc_spans(random.randint(1, 12), 4) for _ in range(3)]]
        doc_S, span_S = pack_row(docs, sum(len(d) for d in docs) + random.randint(0, 7))
        doc_BS, span_BS = doc_S[None], span_S[None]
        B, S = doc_BS.shape
    meta = build_meta(doc_BS, span_BS, 8)
    q, k, v = random_qkv(B, 4, 2, S, 16)
    w = torch.randn(B, 4, S, 16)
    ref = run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=8), w)
    if layout == "every kind":
        kinds = {s.kind for s in plan(meta.doc_BS, meta.skey_BS, meta.span_last_BS, 16)[0]}
        assert kinds == {"causal", "batch", "full", "mask"}, kinds
    cfg = AttentionConfig(backend="sdpa", block_size=8, sdpa_group=16)
    out, lse = sdpa_full_op(q, k, v, meta.doc_BS, meta.skey_BS, meta.vis_BS, config_json(cfg))
    assert lse.shape == (B, 4, S) and torch.isfinite(lse).all()
    got = (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-4, f"seed={seed} {name} {rel_err(a, b):.2e}"


def test_auto_is_sdpa_for_full_layers_on_cpu():
    from mmtrain.models.attention import resolve_backend

    meta = build_meta(torch.zeros(1, 8, dtype=torch.int32), torch.full((1, 8), -1), 4)
    q = torch.zeros(1, 2, 8, 4)
    assert resolve_backend(AttentionConfig(), q, meta, sparse=False) == "sdpa"
    assert resolve_backend(AttentionConfig(backend="sdpa"), q, meta, sparse=True) == "gather"


def test_recompute_grads_inside_a_custom_op(seed):
    """The generic backward of the opaque ops (sdpa's on CUDA, the sparse op's everywhere):
    autograd re-enabled inside a custom op gives SDPA's own gradients."""
    from mmtrain.models.attention.opaque import recompute_grads

    @torch.library.custom_op("mmtrain_test::recompute", mutates_args=())
    def grads_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return recompute_grads(lambda *x: torch.nn.functional.scaled_dot_product_attention(
            *x, is_causal=True, enable_gqa=True), grad, q, k, v)

    q, k, v = random_qkv(1, 4, 2, 24, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    w = torch.randn_like(out)
    ref = torch.autograd.grad((out * w).sum(), (q, k, v))
    for a, b in zip(grads_op(w, q.detach(), k.detach(), v.detach()), ref):
        assert rel_err(a, b) < 1e-5
