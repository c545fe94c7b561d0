"""models.attention on CUDA: flex (fwd + bwd), gather and flash vs the dense eager reference.

Marked gpu and skipped without CUDA. Fresh random inputs each run; the seed is printed.
Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Bs block size.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from mmtrain.models.attention import AttentionConfig, attend, build_meta, resolve_backend
from mmtrain.models.attention.testing import backends_on, random_batch, random_qkv, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def _run(q, k, v, meta, cfg, sparse, w):
    out = attend(q, k, v, meta, cfg, sparse)
    return (out, *torch.autograd.grad((out.float() * w).sum(), (q, k, v)))


def _inputs(B, H, K, S, D, Bs, dtype, visual=True):
    doc, span = random_batch(B, S, Bs, visual=visual)
    meta = build_meta(doc.cuda(), span.cuda(), Bs)
    q, k, v = (t.detach().cuda().to(dtype).requires_grad_() for t in random_qkv(B, H, K, S, D))
    return meta, q, k, v, torch.randn(B, H, S, D, device="cuda")


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("backend", [b for b in backends_on("cuda", backward=True) if b != "dense"])
def test_cuda_backend_matches_dense_fp32(seed, backend, sparse):
    Bs, S = 64, 1000  # S not a multiple of the block; fixed so flex compiles once
    meta, q, k, v, w = _inputs(2, 4, 2, S, 64, Bs, torch.float32)
    common = dict(block_size=Bs, window=128, top_k=2, select_per=random.choice(["head", "kv_group"]))
    ref = _run(q, k, v, meta, AttentionConfig(backend="dense", dense_impl="eager", **common), sparse, w)
    got = _run(q, k, v, meta, AttentionConfig(backend=backend, **common), sparse, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 1e-4, f"seed={seed} {backend} {name} {rel_err(a, b):.2e}"


def test_flex_bf16_close_to_fp32_reference(seed):
    Bs, S = 64, 1000
    meta, q, k, v, w = _inputs(2, 4, 2, S, 64, Bs, torch.bfloat16)
    cfg = dict(block_size=Bs, window=128, top_k=2)
    ref = _run(*(t.detach().float().requires_grad_() for t in (q, k, v)), meta,
               AttentionConfig(backend="dense", dense_impl="eager", **cfg), True, w)
    got = _run(q, k, v, meta, AttentionConfig(backend="flex", **cfg), True, w)
    assert got[0].dtype == torch.bfloat16
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) < 3e-2, f"seed={seed} {name} {rel_err(a, b):.2e}"


def test_flash_matches_dense(seed):
    pytest.importorskip("flash_attn")
    Bs, S = 64, 1000
    meta, q, k, v, w = _inputs(2, 4, 2, S, 64, Bs, torch.bfloat16, visual=False)
    cfg = AttentionConfig(backend="flash", block_size=Bs)
    assert resolve_backend(cfg, q, meta, sparse=False) == "flash"
    ref = _run(*(t.detach().float().requires_grad_() for t in (q, k, v)), meta,
               AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs), False, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), _run(q, k, v, meta, cfg, False, w), ref):
        assert rel_err(a, b) < 3e-2, f"seed={seed} {name} {rel_err(a, b):.2e}"


def test_auto_on_cuda_and_flash_fallback():
    meta, q, _, _, _ = _inputs(1, 2, 2, 128, 16, 64, torch.bfloat16)
    assert resolve_backend(AttentionConfig(), q, meta, sparse=True) == "flex"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = resolve_backend(AttentionConfig(), q, meta, sparse=False)
        forced = resolve_backend(AttentionConfig(backend="flash"), q, meta, sparse=False)
    assert full == "flex" and forced == "flex"  # this batch has spans: flash cannot express them


@pytest.mark.parametrize("sparse", [True, False])
def test_compiled_flex_is_causal_on_cuda(seed, sparse):
    """The property tests of test_attention_properties.py run the eager flex on CPU; this one runs
    the compiled kernel (the BlockMask lists decide what it visits): future positions never move
    the past."""
    Bs, S = 64, 1000
    meta, q, k, v, _ = _inputs(1, 4, 2, S, 64, Bs, torch.float32)
    cfg = AttentionConfig(backend="flex", block_size=Bs, window=128, top_k=2,
                          select=random.choice(["token", "block"]))
    p = random.randrange(S // 4, 3 * S // 4)
    later = (torch.arange(S, device="cuda") > p)[:, None]
    with torch.no_grad():
        ref = attend(q, k, v, meta, cfg, sparse)
        got = attend(*(x + 3 * torch.randn_like(x) * later for x in (q, k, v)), meta, cfg, sparse)
    span_BS = meta.span_last_BS[0]
    past = (torch.arange(S, device="cuda") <= p) & (span_BS <= p)
    assert (got - ref)[0][:, past].abs().max() < 1e-4, f"seed={seed} p={p}"
