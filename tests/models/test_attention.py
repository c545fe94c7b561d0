"""models.attention on CPU: gather / flex / recompute vs the dense eager reference, and the
sparse selection vs a naive re-statement of its definition. Fresh random inputs every run; the
seed is printed (shown on failure).

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Q query blocks, N key blocks,
G selection heads, R query rows, Bs block size.
"""

from __future__ import annotations

import math
import os
import random
import warnings

import pytest
import torch

from models.attention import AttentionConfig, attend, build_meta, recompute_probs, select_blocks
from models.attention.dense import dense_mask, dense_probs, expand_blocks
from models.attention.flex import attend_flex
from models.attention.testing import random_batch, random_qkv, rel_err


@pytest.fixture
def seed():
    s = random.SystemRandom().randrange(2**31)
    random.seed(s)  # the packing generator draws from `random`, tensors from torch
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


def run(q, k, v, meta, cfg, sparse, w):
    out = attend(q, k, v, meta, cfg, sparse)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return (out, *grads)


def naive_selection(q_BHSD, k_BKSD, doc_BS, span_BS, cfg: AttentionConfig):
    """The sparse selection re-stated from its definition (token-level, loops over blocks)."""
    B, H, S, _ = q_BHSD.shape
    K, Bs = k_BKSD.shape[1], cfg.block_size
    Q, G = math.ceil(S / Bs), (H if cfg.select_per == "head" else K)
    doc, span, pos = doc_BS.long(), span_BS.long(), torch.arange(S)
    out = torch.zeros(B, G, Q, Q, dtype=torch.bool)
    for b in range(B):
        allow_SS = (doc[b, :, None] == doc[b, None]) & (
            (pos[None] <= pos[:, None]) | ((span[b, :, None] == span[b, None]) & (span[b, :, None] >= 0)))
        blk = [slice(n * Bs, min(S, (n + 1) * Bs)) for n in range(Q)]
        first = {int(d): int((doc[b] == d).nonzero()[0]) for d in doc[b].unique()}
        for qb in range(Q):
            qs = blk[qb]
            docs_q = set(doc[b, qs].tolist())
            spans_q = {(int(d), int(s)) for d, s in zip(doc[b, qs], span[b, qs]) if s >= 0}
            base, reach = set(), set()
            for n in range(Q):
                ks = blk[n]
                if not allow_SS[qs, ks].any():
                    continue
                reach.add(n)
                pairs = set(zip(doc[b, ks].tolist(), span[b, ks].tolist()))
                if n == qb or 0 < qb - n <= math.ceil(cfg.window / Bs) or pairs & spans_q:
                    base.add(n)
                if cfg.sink and any(first[d] // Bs == n for d in docs_q):
                    base.add(n)
                if cfg.visual_always and any(s >= 0 and d in docs_q for d, s in pairs):
                    base.add(n)
            cand = [n for n in sorted(reach) if n < qb and n not in base]
            for g in range(G):
                heads = [g] if G == H else list(range(g * H // K, (g + 1) * H // K))
                score = {}
                for n in cand:
                    km = k_BKSD[b, heads[0] * K // H, blk[n]].double().mean(0)
                    score[n] = sum(float(q_BHSD[b, h, qs].double().mean(0) @ km) for h in heads)
                top = sorted(cand, key=lambda n: -score[n])[: cfg.top_k]
                out[b, g, qb, sorted(base | set(top))] = True
    return out


@pytest.mark.parametrize("select_per", ["head", "kv_group"])
def test_selection_matches_definition(seed, select_per):
    Bs = random.choice([4, 8])
    S = random.randint(6 * Bs, 14 * Bs)
    doc, span = random_batch(2, S, Bs)
    q, k, _ = random_qkv(2, 4, 2, S, 8, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=random.randint(0, 3 * Bs), top_k=random.randint(0, 4),
                          sink=random.random() < 0.5, visual_always=random.random() < 0.5,
                          select_per=select_per)
    got = select_blocks(q, k, build_meta(doc, span, Bs), cfg)
    want = naive_selection(q, k, doc, span, cfg)
    assert torch.equal(got, want), f"seed={seed} cfg={cfg}"


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("select_per,H,K", [("kv_group", 4, 2), ("head", 4, 2), ("kv_group", 3, 1),
                                            ("head", 2, 2)])
def test_gather_matches_dense(seed, sparse, select_per, H, K):
    B, Bs, D = 2, random.choice([8, 16]), 16
    S = random.randint(5 * Bs, 20 * Bs)
    meta = build_meta(*random_batch(B, S, Bs), Bs)
    common = dict(block_size=Bs, window=random.randint(0, 3 * Bs), top_k=random.choice([1, 2, 50]),
                  sink=random.random() < 0.7, visual_always=random.random() < 0.7, select_per=select_per)
    q, k, v = random_qkv(B, H, K, S, D)
    w = torch.randn(B, H, S, D)
    ref = run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", **common), sparse, w)
    gcfg = AttentionConfig(backend="gather", gather_chunk=random.randint(1, 6),
                           gather_checkpoint=random.random() < 0.5, **common)
    for name, a, b in zip(("out", "dq", "dk", "dv"), run(q, k, v, meta, gcfg, sparse, w), ref):
        assert rel_err(a, b) < 1e-4, f"seed={seed} {name} rel err {rel_err(a, b):.2e} cfg={gcfg}"


def test_full_layer_paths_match_dense(seed):
    Bs, S = 8, random.randint(40, 160)
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, 4, 2, S, 16)
    w = torch.randn(2, 4, S, 16)
    ref = run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs), False, w)
    for backend in ("dense", "gather", "auto", "flash"):  # dense = SDPA; flash falls back on CPU
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = run(q, k, v, meta, AttentionConfig(backend=backend, block_size=Bs), False, w)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert rel_err(a, b) < 1e-4, f"seed={seed} {backend} {name} {rel_err(a, b):.2e}"


def test_sparse_covering_everything_equals_full(seed):
    Bs, S = 8, random.randint(40, 200)
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, 4, 2, S, 16, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=S, top_k=S, sink=False, visual_always=False)
    sel = select_blocks(q, k, meta, cfg)
    assert torch.equal(dense_mask(meta, sel, 4), dense_mask(meta, None, 4).expand(-1, 4, -1, -1)), seed
    cfg = AttentionConfig(block_size=Bs, window=0, top_k=S)  # top-k alone also covers everything
    full = attend(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs), False)
    for backend in ("dense", "gather"):
        got = attend(q, k, v, meta, AttentionConfig(backend=backend, block_size=Bs, window=0, top_k=S), True)
        assert rel_err(got, full) < 1e-5, f"seed={seed} {backend}"


def test_span_closure_keeps_spans_bidirectional(seed):
    Bs, S = 4, random.randint(60, 150)
    doc, span = random_batch(2, S, Bs)
    meta = build_meta(doc, span, Bs)
    q, k, _ = random_qkv(2, 2, 2, S, 8, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=0, top_k=0, sink=False, visual_always=False)
    mask_BHSS = dense_mask(meta, select_blocks(q, k, meta, cfg), 2)
    same_span_BSS = (doc[:, :, None] == doc[:, None]) & (span[:, :, None] == span[:, None]) & (
        span[:, :, None] >= 0)
    assert mask_BHSS[same_span_BSS[:, None].expand_as(mask_BHSS)].all(), f"seed={seed}"
    # Queries in blocks without visual tokens keep only their own block here.
    vis_BQ = torch.nn.functional.pad(span >= 0, (0, meta.padded_len - S)).view(2, -1, Bs).any(-1)
    text_BSS = (~vis_BQ).repeat_interleave(Bs, 1)[:, :S, None].expand(-1, -1, S)
    own_SS = expand_blocks(torch.eye(meta.num_blocks, dtype=torch.bool)[None, None], 1, Bs, S)[0, 0]
    assert not (mask_BHSS & text_BSS[:, None] & ~own_SS).any(), f"seed={seed}"


def test_padding_and_tiny_docs_no_nan(seed):
    Bs, S = 8, 64
    doc = torch.tensor([[0, 1, 2] + [3] * 20 + [4] * (S - 23), list(range(S))], dtype=torch.int32)
    span = torch.full((2, S), -1, dtype=torch.int32)
    span[0, 5:15] = 0
    meta = build_meta(doc, span, Bs)
    for sparse in (True, False):
        for backend in ("dense", "gather"):
            q, k, v = random_qkv(2, 4, 2, S, 8)
            cfg = AttentionConfig(backend=backend, block_size=Bs, window=0, top_k=1)
            out = attend(q, k, v, meta, cfg, sparse)
            out.square().sum().backward()
            assert all(t.isfinite().all() for t in (out, q.grad, k.grad, v.grad)), (backend, sparse)
            assert torch.allclose(out[1], v[1].repeat_interleave(2, 0)), "one-token docs see only themselves"


@pytest.mark.parametrize("sparse", [True, False])
def test_recompute_probs_matches_dense(seed, sparse):
    Bs, S, H, K = 8, random.randint(40, 160), 4, 2
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, H, K, S, 16, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=Bs, top_k=1, select_per=random.choice(["head", "kv_group"]))
    capture: dict = {}
    attend(q, k, v, meta, cfg, sparse, capture=capture)
    assert capture["q"].shape == q.shape and capture["k"].shape == k.shape
    sel = capture.get("kv_blocks")
    assert (sel is not None) == sparse
    if sparse:
        assert sel.dtype == torch.bool and sel.shape == (2, H if cfg.select_per == "head" else K,
                                                         meta.num_blocks, meta.num_blocks)
    mask_BHSS = dense_mask(meta, sel, H).expand(-1, H, -1, -1)
    ref_BHSS = dense_probs(q, k, mask_BHSS)
    rows_R2 = torch.stack([torch.randint(0, 2, (13,)), torch.randint(0, S, (13,))], 1)
    got_HRS = recompute_probs(capture, meta, cfg, sparse, rows_R2, chunk=3)
    want_HRS = ref_BHSS[rows_R2[:, 0], :, rows_R2[:, 1]].transpose(0, 1)
    assert rel_err(got_HRS, want_HRS) < 1e-5, f"seed={seed}"
    outside_HRS = ~mask_BHSS[rows_R2[:, 0], :, rows_R2[:, 1]].transpose(0, 1)
    assert (got_HRS[outside_HRS] == 0).all(), "probability outside the layer's mask / selection"
    got_HR1 = recompute_probs(capture, meta, cfg, sparse, rows_R2[:, 1], batch=1)
    assert rel_err(got_HR1, ref_BHSS[1][:, rows_R2[:, 1]]) < 1e-5


@pytest.mark.parametrize("sparse", [True, False])
def test_flex_forward_cpu_eager(seed, sparse):
    """The BlockMask + mask_mod (unfused eager flex on CPU; the compiled kernel runs on CUDA)."""
    Bs, S = 8, random.randint(40, 160)
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, 4, 2, S, 16, grad=False)
    cfg = AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs, window=Bs, top_k=1)
    sel = select_blocks(q, k, meta, cfg) if sparse else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = attend_flex(q, k, v, meta, sel, compiled=False)
    assert rel_err(got, attend(q, k, v, meta, cfg, sparse)) < 1e-5, f"seed={seed}"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MMTRAIN_SLOW_TESTS"), reason="compiles flex on CPU (~25 s)")
def test_flex_forward_cpu_compiled(seed):
    Bs, S = 16, 96
    meta = build_meta(*random_batch(1, S, Bs), Bs)
    q, k, v = random_qkv(1, 4, 2, S, 16, grad=False)
    cfg = AttentionConfig(backend="flex", block_size=Bs, window=Bs, top_k=1)
    with torch.no_grad():
        got = attend(q, k, v, meta, cfg, True)
    ref = attend(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs,
                                                window=Bs, top_k=1), True)
    assert rel_err(got, ref) < 1e-4, f"seed={seed}"


def test_flex_refuses_cpu_backward():
    meta = build_meta(torch.zeros(1, 16, dtype=torch.int32), torch.full((1, 16), -1), 8)
    q, k, v = random_qkv(1, 2, 2, 16, 8)
    with pytest.raises(RuntimeError, match="flex"):
        attend(q, k, v, meta, AttentionConfig(backend="flex", block_size=8), True)


def test_config_and_shape_errors():
    with pytest.raises(ValueError, match="block_size"):
        AttentionConfig(block_size=0)
    with pytest.raises(ValueError, match="backend"):
        AttentionConfig(backend="triton")  # type: ignore[arg-type]
    meta = build_meta(torch.zeros(1, 16, dtype=torch.int32), torch.full((1, 16), -1), 8)
    q, k, v = random_qkv(1, 3, 2, 16, 8, grad=False)
    with pytest.raises(ValueError, match="GQA"):
        attend(q, k, v, meta, AttentionConfig(block_size=8), False)
    q, k, v = random_qkv(1, 2, 2, 16, 8, grad=False)
    with pytest.raises(ValueError, match="block_size"):
        attend(q, k, v, meta, AttentionConfig(block_size=4), True)
