"""Context-parallel attention against the dense reference (gloo, 2 and 4 ranks): every rank holds
a chunk of each row; its outputs and its q, k, v gradients equal the whole-row reference's at its
positions, for full layers and for sparse layers that really select (kept blocks <= 50% of the
reachable ones), with documents and visual spans straddling the chunks.
This file is also the worker: `torchrun ... test_context_parallel.py`.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmtrain.models.attention import AttentionConfig, attend, build_meta
from mmtrain.models.attention.context import ContextShard
from mmtrain.models.attention.testing import pack_row, random_doc_spans
from mmtrain.parallel.comm import Traffic
from mmtrain.parallel.context_parallel import CPComm

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve()
B, H, K, S, D, Bs = 2, 4, 2, 128, 8, 2
SPARSE = AttentionConfig(backend="dense", dense_impl="eager", block_size=Bs, window=2, top_k=2, sink=True,
                         visual_always=False, select="block", full_tile=8)
CASES = {
    "full": (SPARSE, False),
    "sparse-block": (SPARSE, True),
    "sparse-token-head": (replace(SPARSE, select="token", select_per="head"), True),
    "sparse-visual-always": (replace(SPARSE, visual_always=True, top_k=1), True),
}


@pytest.mark.parametrize("nproc", [2, 4])
def test_context_parallel_attention_equals_dense(nproc: int) -> None:
    from dist_runs import launch

    launch([str(HERE)], nproc=nproc, timeout=180)


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Long text documents (so the sparse rule cuts) around a document of images whose spans cross
    blocks and the chunk boundary at S / 2; padding at the end."""
    random.seed(seed)
    doc_BS, span_BS = torch.empty(B, S, dtype=torch.int32), torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        images = torch.tensor([-1] * 4 + [0] * 12 + [-1, 1, 1, -1], dtype=torch.int32)  # tokens 54-74 or so
        docs = [random_doc_spans(random.randint(50, 58), Bs, visual=False), images,
                random_doc_spans(random.randint(30, 50), Bs, visual=False)]
        doc_BS[b], span_BS[b] = pack_row(docs, S)
    return doc_BS, span_BS


def _check(cfg: AttentionConfig, sparse: bool, comm: CPComm, seed: int) -> None:
    torch.manual_seed(seed)
    doc_BS, span_BS = _rows(seed)
    assert (span_BS[:, S // 2 - 1] == span_BS[:, S // 2]).all()  # an image across the middle boundary
    meta = build_meta(doc_BS, span_BS, Bs)
    q, k, v = (torch.randn(B, n, S, D, requires_grad=True) for n in (H, K, K))
    g_BHSD = torch.randn(B, H, S, D) * (doc_BS >= 0)[:, None, :, None]  # padding's outputs: unread
    stats = {}
    ref = attend(q, k, v, meta, cfg, sparse, stats=stats if sparse else None)
    (ref * g_BHSD).sum().backward()
    if sparse:
        assert float(stats["kept"]) <= 0.5 * float(stats["reachable"]), stats  # it really selects
    shard = ContextShard(comm, S)
    mine = [shard.local(x.detach(), 2).clone().requires_grad_(True) for x in (q, k, v)]
    out = attend(*mine, build_meta(doc_BS, span_BS, Bs), replace(cfg, backend="gather"), sparse,
                 context=shard)
    (out * shard.local(g_BHSD, 2)).sum().backward()
    real = shard.local(doc_BS >= 0)[:, None, :, None]
    torch.testing.assert_close(torch.where(real, out, 0), torch.where(real, shard.local(ref, 2), 0).detach(),
                               atol=1e-5, rtol=1e-5)
    for name, got, full in zip("qkv", mine, (q, k, v)):
        torch.testing.assert_close(got.grad, shard.local(full.grad, 2), atol=1e-5, rtol=1e-5, msg=name)


def worker() -> None:
    dist.init_process_group("gloo")
    traffic = Traffic()
    comm = CPComm(dist.group.WORLD, traffic)
    for i, (cfg, sparse) in enumerate(CASES.values()):
        _check(cfg, sparse, comm, seed=i)
    kinds = set(traffic.sent)
    assert {"cp_kv_all_gather", "cp_block_sums", "cp_kv_fetch"} <= kinds, kinds
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(worker())
