"""models.attention.stats: the text-row selection and the per-row reductions shared by the
attention-map tool and the trainer's collapse diagnostics.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, R query rows.
"""

from __future__ import annotations

import torch

from mmtrain.models.attention import (
    AttentionConfig,
    build_meta,
    doc_first_BS,
    even_subset,
    recompute_probs,
    reduce_rows,
    row_stats,
    text_rows,
)
from mmtrain.models.attention.testing import random_batch, random_qkv

T, V = 0, 1  # text, visual (image) modality


def test_doc_first_and_text_rows():
    doc_BS = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2]])
    mod_BS = torch.tensor([[T, V, T, T, T, T, T, V, T]])
    assert doc_first_BS(doc_BS).tolist() == [[0, 0, 0, 0, 4, 4, 6, 6, 6]]
    text_BS = mod_BS == T
    # doc 1 has no visual token of its own (the one before it belongs to doc 0): no rows there
    assert text_rows(mod_BS, doc_BS, text_BS).tolist() == [[0, 2], [0, 3], [0, 8]]
    text_BS[0, 3] = False
    assert text_rows(mod_BS, doc_BS, text_BS).tolist() == [[0, 2], [0, 8]]


def test_even_subset_is_bounded_distinct_and_spread():
    assert even_subset(3, 5).tolist() == [0, 1, 2]
    idx = even_subset(1000, 7)
    assert idx[0] == 0 and set(idx.diff().tolist()) <= {142, 143}  # 1000 / 7 apart, all distinct


def test_reduce_rows_by_hand():
    p_HrS = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    vis_BS = torch.tensor([[False, True, True, False]])
    first_BS = torch.zeros(1, 4, dtype=torch.long)
    s = reduce_rows(p_HrS, torch.tensor([[0, 3]]), vis_BS, first_BS)
    torch.testing.assert_close(s.mass_HR, torch.tensor([[0.5]]))
    torch.testing.assert_close(s.sink_HR, torch.tensor([[0.1]]))
    torch.testing.assert_close(s.entropy_HR, -(p_HrS * p_HrS.log()).sum(-1))


def test_row_stats_is_the_reduction_of_all_recomputed_rows():
    torch.manual_seed(0)
    B, H, K, S, D, Bs = 2, 4, 2, 40, 8, 8
    doc_BS, span_BS = random_batch(B, S, Bs)
    mod_BS = (span_BS >= 0).to(torch.int8)
    q, k, _ = random_qkv(B, H, K, S, D, grad=False)
    cfg = AttentionConfig(block_size=Bs, window=8, top_k=1)
    meta = build_meta(doc_BS, span_BS, Bs)
    rows_R2 = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(S), indexing="ij"), -1).reshape(-1, 2)
    seen = []
    for sparse in (False, True):
        capture = {"q": q, "k": k}
        s = row_stats(capture, meta, cfg, sparse, rows_R2, mod_BS, doc_BS, chunk=7,
                      on_chunk=lambda r0, p: seen.append((r0, p.shape[1])))
        p_HRS = recompute_probs(capture, meta, cfg, sparse, rows_R2)
        ref = reduce_rows(p_HRS, rows_R2, mod_BS != T, doc_first_BS(doc_BS))
        for name in ("mass_HR", "entropy_HR", "sink_HR"):
            torch.testing.assert_close(getattr(s, name), getattr(ref, name), atol=1e-6, rtol=0)
        assert ((s.mass_HR >= 0) & (s.mass_HR <= 1 + 1e-6)).all()
    assert sum(n for _, n in seen) == 2 * B * S and seen[1][0] == 7
