"""Properties of every attention backend, full and sparse layers (not re-statements of the rule):

  * causality: changing q/k/v at positions after p leaves every output at <= p unchanged
    (except tokens whose own visual span reaches past p, which may see it by design);
  * document isolation: changing every other document leaves a document's outputs unchanged;
  * packing invariance: a document alone in a row equals the same document packed at a random
    offset behind others (document-relative blocks), to fp32 rounding.
Random configs every run (block sizes, windows, top_k, GQA, per-token and block selection,
images/videos crossing blocks, padding, 1-4 documents of up to 12 blocks); the seed is printed.
Each property is also checked to be non-vacuous (the perturbation does move what it may move).
The backends are the registry's (every one whose forward runs on CPU), and a backend registered
inside a test gets the same suite.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Bs block size.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch

from mmtrain.models.attention import AttentionConfig, attend, build_meta, flex
from mmtrain.models.attention.registry import BACKENDS, backend_choices, register_backend, unregister_backend
from mmtrain.models.attention.testing import pack_row, random_doc_spans

CPU_BACKENDS = [name for name, b in BACKENDS.items() if b.runs_on("cpu")]
TOL = 1e-5


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    """flex compiled on CPU would recompile for every random shape: here it runs its eager kernel
    (the same BlockMask and mask_mod); test_attention_gpu.py runs the compiled one."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex, "compiled_flex", lambda: flex_attention)


@pytest.fixture
def toy_backend():
    """A backend registered only inside the test (dense's entry under another name), removed after."""
    backend = register_backend(dataclasses.replace(BACKENDS["dense"], name="toy", auto=0))
    yield backend.name
    unregister_backend(backend.name)


def random_cfg(Bs: int) -> AttentionConfig:
    return AttentionConfig(block_size=Bs, window=random.choice([0, 0, random.randint(1, 2 * Bs)]),
                           top_k=random.randint(1, 2), sink=random.random() < 0.5,
                           visual_always=random.random() < 0.5,
                           select_per=random.choice(["head", "kv_group"]),
                           select=random.choice(["token", "block"]), dense_impl="eager")


def random_docs(Bs: int, n: int) -> list[torch.Tensor]:
    lengths = [random.choice([random.randint(1, 2 * Bs), random.randint(4 * Bs, 12 * Bs)]) for _ in range(n)]
    return [random_doc_spans(L, Bs, visual=random.random() < 0.7) for L in lengths]


def run(backend: str, q, k, v, doc_BS, span_BS, cfg: AttentionConfig, sparse: bool) -> torch.Tensor:
    meta = build_meta(doc_BS, span_BS, cfg.block_size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # sdpa: small random groups, so causal segments, span patches and masked groups all occur
        group = random.choice([0, 4, 16, 64])
        return attend(q, k, v, meta, dataclasses.replace(cfg, backend=backend, sdpa_group=group), sparse)


def span_end(doc_S: torch.Tensor, span_S: torch.Tensor) -> torch.Tensor:
    """Last position of each token's own visual span (text: itself), from the ids alone."""
    S = len(doc_S)
    end = torch.arange(S)
    for i in range(S - 2, -1, -1):
        if span_S[i] >= 0 and span_S[i + 1] == span_S[i] and doc_S[i + 1] == doc_S[i]:
            end[i] = end[i + 1]
    return end


def heads() -> tuple[int, int]:
    return random.choice([(4, 2), (4, 1), (2, 2), (3, 3)])


def random_row(min_docs: int):
    """A random config and one packed row of 1-4 documents with q, k, v."""
    Bs = random.choice([2, 4, 8])
    cfg = random_cfg(Bs)
    docs = random_docs(Bs, random.randint(min_docs, 4))
    S = sum(len(d) for d in docs) + random.randint(0, Bs)
    doc_S, span_S = pack_row(docs, S)
    H, K = heads()
    return cfg, len(docs), doc_S, span_S, [torch.randn(1, n, S, 16) for n in (H, K, K)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sparse", [True, False])
def test_future_tokens_do_not_move_the_past(seed, backend, sparse):
    for _ in range(3):
        _future_case(seed, backend, sparse)


def _future_case(seed, backend, sparse):
    cfg, _, doc_S, span_S, (q, k, v) = random_row(1)
    S = len(doc_S)
    ref = run(backend, q, k, v, doc_S[None], span_S[None], cfg, sparse)
    end = span_end(doc_S, span_S)
    for p in random.sample(range(S - 1), min(6, S - 1)):
        later = torch.arange(S) > p
        q2, k2, v2 = (x + 3 * torch.randn_like(x) * later[:, None] for x in (q, k, v))
        got = run(backend, q2, k2, v2, doc_S[None], span_S[None], cfg, sparse)
        past = (torch.arange(S) <= p) & (end <= p)
        err = (got - ref)[:, :, past].abs().max().item() if past.any() else 0.0
        assert err < TOL, f"seed={seed} p={p} max change at <= p: {err:.2e} cfg={cfg}"
        assert (got - ref)[:, :, later].abs().max() > 1e-3, "the perturbation moved nothing (vacuous)"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sparse", [True, False])
def test_other_documents_do_not_move_a_document(seed, backend, sparse):
    _isolation_case(seed, backend, sparse)


def _isolation_case(seed, backend, sparse):
    cfg, n_docs, doc_S, span_S, (q, k, v) = random_row(2)
    d = random.randrange(n_docs)
    other = doc_S != d
    q2, k2, v2 = (x + 3 * torch.randn_like(x) * other[:, None] for x in (q, k, v))
    ref = run(backend, q, k, v, doc_S[None], span_S[None], cfg, sparse)
    got = run(backend, q2, k2, v2, doc_S[None], span_S[None], cfg, sparse)
    err = (got - ref)[:, :, ~other].abs().max().item()
    assert err < TOL, f"seed={seed} doc {d}: max change {err:.2e} cfg={cfg}"
    assert (got - ref)[:, :, other].abs().max() > 1e-3, "vacuous"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sparse", [True, False])
def test_document_alone_equals_document_packed_at_an_offset(seed, backend, sparse):
    _packing_case(seed, backend, sparse)


def _packing_case(seed, backend, sparse):
    Bs = random.choice([2, 4, 8])
    cfg = random_cfg(Bs)
    doc = random_docs(Bs, 1)[0]
    before, after = random_docs(Bs, random.randint(1, 3)), random_docs(Bs, random.randint(0, 1))
    S = sum(len(d) for d in before + after) + len(doc) + random.randint(0, Bs)
    H, K = heads()
    L = len(doc)
    x_alone = [torch.randn(1, n, L, 16) for n in (H, K, K)]
    alone_doc, alone_span = pack_row([doc], S)
    packed_doc, packed_span = pack_row(before + [doc] + after, S)
    off = sum(len(d) for d in before)
    x_solo, x_packed = [], []
    for x in x_alone:
        solo, packed = torch.randn(*x.shape[:2], S, 16), torch.randn(*x.shape[:2], S, 16)
        solo[:, :, :L], packed[:, :, off:off + L] = x, x
        x_solo.append(solo)
        x_packed.append(packed)
    a = run(backend, *x_solo, alone_doc[None], alone_span[None], cfg, sparse)[:, :, :L]
    b = run(backend, *x_packed, packed_doc[None], packed_span[None], cfg, sparse)[:, :, off:off + L]
    err = (a - b).abs().max().item()
    assert err < TOL, f"seed={seed} offset {off}: max difference {err:.2e} cfg={cfg}"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sparse_layers_are_sparse(seed, backend):
    """Non-vacuity of the sparse rule: a long document with a narrow rule differs from full
    attention, and a rule that keeps everything equals it."""
    Bs = random.choice([2, 4])
    doc_S, span_S = pack_row([torch.full((10 * Bs,), -1, dtype=torch.int32)], 10 * Bs)
    q, k, v = (torch.randn(1, 2, 10 * Bs, 16) for _ in range(3))
    narrow = AttentionConfig(block_size=Bs, window=0, top_k=1, sink=False, visual_always=False)
    wide = AttentionConfig(block_size=Bs, window=10 * Bs, top_k=1, sink=False, visual_always=False)
    full = run(backend, q, k, v, doc_S[None], span_S[None], narrow, False)
    assert (run(backend, q, k, v, doc_S[None], span_S[None], narrow, True) - full).abs().max() > 1e-3
    assert (run(backend, q, k, v, doc_S[None], span_S[None], wide, True) - full).abs().max() < TOL


@pytest.mark.parametrize("sparse", [True, False])
def test_a_registered_backend_gets_the_property_suite(seed, toy_backend, sparse):
    assert AttentionConfig(backend=toy_backend).backend == toy_backend
    _future_case(seed, toy_backend, sparse)
    _isolation_case(seed, toy_backend, sparse)
    _packing_case(seed, toy_backend, sparse)


def test_the_config_accepts_the_registered_backends_only():
    assert set(backend_choices()) == {"auto", *BACKENDS}
    register_backend(dataclasses.replace(BACKENDS["dense"], name="toy2", auto=0))
    try:
        AttentionConfig(backend="toy2")
    finally:
        unregister_backend("toy2")
    with pytest.raises(ValueError, match="backend"):
        AttentionConfig(backend="toy2")
