"""models.attention on CPU: gather / flex / recompute vs the dense eager reference on outputs and
gradients, the flex BlockMask against its mask_mod, span closure and padding, and the counts of
what a layer visits. Fresh random inputs every run; the seed is printed (shown on failure).
The properties every backend must have (causality, isolation, packing invariance) are in
test_attention_properties.py.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Q query blocks, N key blocks,
G selection heads, R query rows, Bs block size.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from mmtrain.models.attention import AttentionConfig, attend, build_meta, recompute_probs, select_blocks
from mmtrain.models.attention.counts import full_counts, sparse_counts
from mmtrain.models.attention.dense import dense_mask, dense_probs
from mmtrain.models.attention.flex import attend_flex, full_block_mask, sparse_block_mask
from mmtrain.models.attention.registry import backend_choices, resolve
from mmtrain.models.attention.testing import backends_on, random_batch, random_qkv, rel_err, saved_bytes


def run(q, k, v, meta, cfg, sparse, w):
    out = attend(q, k, v, meta, cfg, sparse)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return (out, *grads)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("select_per,H,K", [("kv_group", 4, 2), ("head", 4, 2), ("kv_group", 3, 1),
                                            ("head", 2, 2)])
def test_gather_matches_dense(seed, sparse, select_per, H, K):
    B, Bs, D = 2, random.choice([8, 16]), 16
    S = random.randint(5 * Bs, 20 * Bs)
    meta = build_meta(*random_batch(B, S, Bs), Bs)
    common = dict(block_size=Bs, window=random.randint(0, 3 * Bs), top_k=random.choice([0, 1, 2, 50]),
                  sink=random.random() < 0.7, visual_always=random.random() < 0.7, select_per=select_per,
                  select=random.choice(["token", "block"]))
    q, k, v = random_qkv(B, H, K, S, D)
    w = torch.randn(B, H, S, D)
    ref = run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", **common), sparse, w)
    gcfg = AttentionConfig(backend="gather", gather_chunk=random.randint(1, 6),
                           full_tile=random.choice([3, 8, 64]),
                           gather_kernel=random.choice(["sdpa", "tiles", "batched", "eager"]),
                           gather_checkpoint=random.random() < 0.5,
                           gather_checkpoint_mib=random.choice([0.0, 1024.0]), **common)
    for name, a, b in zip(("out", "dq", "dk", "dv"), run(q, k, v, meta, gcfg, sparse, w), ref):
        assert rel_err(a, b) < 1e-4, f"seed={seed} {name} rel err {rel_err(a, b):.2e} cfg={gcfg}"



@pytest.mark.parametrize("sparse", [True, False])
def test_gather_checkpoint_threshold_trades_saved_bytes_not_results(seed, sparse):
    """Above `gather_checkpoint_mib` a gather layer saves only its inputs (the chunks recompute);
    below it the gathered tiles are kept. Same output and gradients either way. (The sparse
    layers' CPU tile kernel saves no tiles at all: the eager kernel shows the threshold there.)"""
    Bs, S = 8, random.randint(150, 300)
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, 4, 2, S, 16)
    w = torch.randn(2, 4, S, 16)
    saved, results = {}, {}
    kernel = "eager" if sparse else "sdpa"
    for mib in (0.0, 1024.0):
        cfg = AttentionConfig(backend="gather", block_size=Bs, window=16, top_k=2, gather_checkpoint_mib=mib,
                              gather_kernel=kernel)
        saved[mib], out = saved_bytes(lambda cfg=cfg: attend(q, k, v, meta, cfg, sparse))
        results[mib] = (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))
    assert saved[0.0] < saved[1024.0], saved
    for a, b in zip(results[0.0], results[1024.0]):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()

def test_full_layer_paths_match_dense(seed):
    Bs, S = 8, random.randint(40, 160)
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, 4, 2, S, 16)
    w = torch.randn(2, 4, S, 16)
    ref = run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs), False, w)
    for backend in backend_choices():  # every value that resolves to a backend with a CPU backward
        cfg = AttentionConfig(backend=backend, block_size=Bs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not resolve(cfg, q, meta, False).runs_on("cpu", backward=True):
                continue  # flex (flash falls back to gather)
            got = run(q, k, v, meta, cfg, False, w)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert rel_err(a, b) < 1e-4, f"seed={seed} {backend} {name} {rel_err(a, b):.2e}"


def test_sparse_covering_everything_equals_full(seed):
    Bs, S = 8, random.randint(40, 200)
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, v = random_qkv(2, 4, 2, S, 16, grad=False)
    full = attend(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs), False)
    for cover in (dict(window=S, top_k=1), dict(window=0, top_k=S)):  # the window, or top-k alone
        cfg = AttentionConfig(block_size=Bs, sink=False, visual_always=False, **cover)
        sel = select_blocks(q, k, meta, cfg)
        full_BHSS = dense_mask(meta, None, None, 4).expand(-1, 4, -1, -1)
        assert torch.equal(dense_mask(meta, cfg, sel, 4), full_BHSS)
        for backend in backends_on("cpu", backward=True, layer="sparse"):
            cfg = AttentionConfig(backend=backend, block_size=Bs, sink=False, **cover)
            got = attend(q, k, v, meta, cfg, True)
            assert rel_err(got, full) < 1e-5, f"seed={seed} {backend}"


def _doc_blocks(doc_BS, Bs):
    """Doc-relative block of every token, counted by hand."""
    out = torch.empty_like(doc_BS, dtype=torch.long)
    for b in range(doc_BS.shape[0]):
        seen: dict[int, int] = {}
        for i, d in enumerate(doc_BS[b].tolist()):
            out[b, i] = seen.get(d, 0) // Bs
            seen[d] = seen.get(d, 0) + 1
    return out


def test_span_closure_keeps_spans_bidirectional(seed):
    Bs, S = 4, random.randint(60, 150)
    doc, span = random_batch(2, S, Bs)
    meta = build_meta(doc, span, Bs)
    q, k, _ = random_qkv(2, 2, 2, S, 8, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=0, top_k=0, sink=False, visual_always=False)
    mask_BHSS = dense_mask(meta, cfg, select_blocks(q, k, meta, cfg), 2)
    same_span_BSS = (doc[:, :, None] == doc[:, None]) & (span[:, :, None] == span[:, None]) & (
        span[:, :, None] >= 0)
    assert mask_BHSS[same_span_BSS[:, None].expand_as(mask_BHSS)].all(), f"seed={seed}"
    # With nothing else kept, a text token sees only its own document block.
    nblk_BS = _doc_blocks(doc, Bs)
    text_BS1 = (span < 0)[:, :, None]
    other_block_BSS = nblk_BS[:, :, None] != nblk_BS[:, None]
    assert not (mask_BHSS & (text_BS1 & other_block_BSS)[:, None]).any(), f"seed={seed}"


def test_padding_and_tiny_docs_no_nan(seed):
    Bs, S = 8, 64
    doc = torch.tensor([[0, 1, 2] + [3] * 20 + [-1] * (S - 23), list(range(S))], dtype=torch.int32)
    span = torch.full((2, S), -1, dtype=torch.int32)
    span[0, 5:15] = 0
    meta = build_meta(doc, span, Bs)
    for sparse in (True, False):
        for backend in backends_on("cpu", backward=True):
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
    sel = capture.get("selection")
    assert (sel is not None) == sparse
    if sparse:
        G = H if cfg.select_per == "head" else K
        assert sel.row(meta).shape == (2, G, S, 1)
    mask_BHSS = dense_mask(meta, cfg, sel, H).expand(-1, H, -1, -1)
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
    cfg = AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs, window=Bs, top_k=1,
                          select=random.choice(["token", "block"]))
    sel = select_blocks(q, k, meta, cfg) if sparse else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = attend_flex(q, k, v, meta, cfg, sel, compiled=False)
    assert rel_err(got, attend(q, k, v, meta, cfg, sparse)) < 1e-5, f"seed={seed}"


@pytest.mark.slow  # compiles flex on CPU (~25 s)
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


def _listed(num_BHX, idx_BHXY, Y: int) -> torch.Tensor:
    B, H, X = num_BHX.shape
    out = torch.zeros(B, H, X, Y, dtype=torch.bool)
    for b, h, x in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(X)).tolist():
        out[b, h, x, idx_BHXY[b, h, x, : num_BHX[b, h, x]].long()] = True
    return out


@pytest.mark.parametrize("sparse", [True, False])
def test_flex_block_mask_lists_every_pair_mask_mod_allows(seed, sparse):
    """The BlockMask is an optimisation over mask_mod: every allowed (real query, key) pair lies in
    a listed tile, and every "full" tile is allowed entirely (the compiled kernel relies on both)."""
    from torch.nn.attention.flex_attention import create_mask

    Bs, H = random.choice([4, 8, 32, 64, 128]), 4
    S = random.randint(3 * Bs, max(400, 8 * Bs))
    meta = build_meta(*random_batch(2, S, Bs), Bs)
    q, k, _ = random_qkv(2, H, 2, S, 8, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=random.choice([Bs, 512]), top_k=1,
                          select=random.choice(["token", "block"]))
    if sparse:
        bm = sparse_block_mask(meta, cfg, select_blocks(q, k, meta, cfg), H)
        real_BL = meta.aligned().src_BL >= 0
    else:
        bm = full_block_mask(meta)
        real_BL = torch.ones(2, S, dtype=torch.bool)
    L, Bf = real_BL.shape[1], bm.BLOCK_SIZE[0]
    mask_BHLL = create_mask(bm.mask_mod, 2, H if sparse else 1, L, L, device="cpu")
    mask_BHLL = mask_BHLL & real_BL[:, None, :, None]
    X = -(-L // Bf)
    tiles_BHXY = torch.nn.functional.pad(mask_BHLL, (0, X * Bf - L, 0, X * Bf - L)).view(
        *mask_BHLL.shape[:2], X, Bf, X, Bf).any(5).any(3)
    listed = _listed(bm.kv_num_blocks, bm.kv_indices, X)
    full = torch.zeros_like(listed) if bm.full_kv_num_blocks is None else _listed(
        bm.full_kv_num_blocks, bm.full_kv_indices, X)
    assert not (tiles_BHXY & ~(listed | full)).any(), f"seed={seed}: an allowed pair is in no listed tile"
    assert not (listed & full).any()
    if full.any():
        every_BHLL = create_mask(bm.mask_mod, 2, H if sparse else 1, L, L, device="cpu")
        every_BHXY = torch.nn.functional.pad(every_BHLL, (0, X * Bf - L, 0, X * Bf - L)).view(
            2, every_BHLL.shape[1], X, Bf, X, Bf)
        assert every_BHXY.all(5).all(3)[full].all(), f"seed={seed}: a full tile holds a masked pair"


def test_flex_sparse_block_mask_marks_visible_tiles_full(seed):
    """A long document with a long window: flex skips mask_mod on the coarse tiles whose blocks are
    all visible (the fully visible part of the window), as gather's CPU kernel runs them unmasked."""
    Bs, S, H = 64, 64 * random.randint(16, 24), 2
    meta = build_meta(torch.zeros(1, S, dtype=torch.int32), torch.full((1, S), -1, dtype=torch.int32), Bs)
    cfg = AttentionConfig(block_size=Bs, window=8 * Bs, top_k=1)
    q, k, v = random_qkv(1, H, 2, S, 8, grad=False)
    sel = select_blocks(q, k, meta, cfg)
    bm = sparse_block_mask(meta, cfg, sel, H)
    full, part = bm.full_kv_num_blocks.sum(), bm.kv_num_blocks.sum()
    assert full > 0 and part > 0, (full, part)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = attend_flex(q, k, v, meta, cfg, sel, compiled=False)
    dense = AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs, window=8 * Bs, top_k=1)
    ref = attend(q, k, v, meta, dense, True)
    assert rel_err(got, ref) < 1e-5, f"seed={seed}"


@pytest.mark.parametrize("sparse", [True, False])
def test_counts_are_what_the_mask_allows(seed, sparse):
    Bs, H, K = random.choice([4, 8]), 4, 2
    S = random.randint(40, 200)
    doc, span = random_batch(2, S, Bs)
    meta = build_meta(doc, span, Bs)
    q, k, _ = random_qkv(2, H, K, S, 8, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=Bs, top_k=1, select_per=random.choice(["head", "kv_group"]))
    sel = select_blocks(q, k, meta, cfg) if sparse else None
    c = sparse_counts(meta, cfg, sel) if sparse else full_counts(meta)
    real_BS = doc >= 0
    mask_BHSS = dense_mask(meta, cfg, sel, H).expand(-1, H, -1, -1)
    assert float(c["keys"]) == pytest.approx(float(mask_BHSS.sum(-1).double().mean(1)[real_BS].sum()))
    assert float(c["tokens"]) == real_BS.sum()
    assert 0 < float(c["kept"]) <= float(c["reachable"])
    full = full_counts(meta)
    assert float(full["kept"]) == float(full["reachable"]) == float(c["reachable"])
    if sparse:  # kept blocks: the distinct doc blocks holding an allowed key, counted from the mask
        nblk_BS = _doc_blocks(doc, Bs)
        n = 0.0
        for b, i in real_BS.nonzero().tolist():
            for h in range(H):
                n += len(set(nblk_BS[b, mask_BHSS[b, h, i]].tolist())) / H
        assert float(c["kept"]) == pytest.approx(n)
