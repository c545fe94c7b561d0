"""torch.compile of the tiny model's blocks (as `dist.compile` applies it: every vision block and
decoder layer): no graph break in the steady state (full layers' sdpa, sparse layers' selection +
gather and fp32 grouped_mm MoE run as opaque custom ops), and the same loss and gradients as
eager. aot_eager (Dynamo + AOTAutograd, what Inductor receives) keeps the test in seconds;
Inductor itself is exercised by `tools.bench.bench_peer --compile`.
Also: `build_meta` traces as one graph (no host synchronisation), and eager and compiled layers
run the same backend, fallbacks included (the op bodies call the same `resolve`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from mmtrain.models import DecoderConfig, ModelConfig, MoEConfig, MultimodalModel
from mmtrain.models.attention import AttentionConfig, attend, build_meta, sdpa
from mmtrain.models.attention.registry import BACKENDS
from mmtrain.models.attention.testing import random_batch as random_ids
from mmtrain.models.attention.testing import random_qkv
from mmtrain.models.vision import VisionConfig
from mmtrain.parallel.parallelize import compile_blocks, layer_graphs
from tools.bench.bench_model import random_batch


def tiny() -> ModelConfig:
    attn = AttentionConfig(block_size=4, window=8, top_k=2, sink=True, visual_always=False)
    return ModelConfig(vision=VisionConfig(dim=32, depth=2, n_heads=2),
                       decoder=DecoderConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                             mrope_sections=(2, 3, 3), layer_layout="FS", attention=attn,
                                             moe=MoEConfig(n_routed=4, top_k=2, expert_dim=16)))


def loss_and_grads(model, batch):
    out = model(**batch)
    labels_BS = batch["tokens_BS"].roll(-1, dims=1)
    loss = F.cross_entropy(out.logits_BSV.flatten(0, 1), labels_BS.flatten()) + sum(out.aux_losses.values())
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return loss.detach(), grads


def compiled_copy(eager: MultimodalModel) -> MultimodalModel:
    """A copy with every block compiled as `dist.compile` does; Dynamo's caches and counters reset."""
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    return compiled


def test_compiled_blocks_no_graph_breaks_same_gradients(seed):
    cfg = tiny()
    eager = MultimodalModel(cfg).train()
    compiled = compiled_copy(eager)
    for _ in range(3):  # new documents, spans and routing every step: no break, no per-batch graph
        batch = random_batch(cfg, 2, 96, 0.25, 4)
        (l_c, g_c), (l_e, g_e) = loss_and_grads(compiled, batch), loss_and_grads(eager, batch)
        assert torch.allclose(l_c, l_e, atol=1e-5), (l_c, l_e)
        for a, b in zip(g_c, g_e):
            if b is not None:
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])


def test_build_meta_has_no_host_sync():
    doc_BS, span_BS = random_ids(2, 64, 4)
    explained = torch._dynamo.explain(build_meta)(doc_BS, span_BS, 4)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    meta = build_meta(doc_BS, span_BS, 4)  # the host values are computed on first use
    assert meta.has_spans == bool((span_BS >= 0).any()) and meta.aligned_blocks >= 1


@pytest.mark.budget(40)  # 8 s measured: inductor
def test_measuring_forwards_run_the_compiled_layers_bounded_graphs(seed):
    """The trainer asks for attention counts on log steps and the diagnostics capture q/k: those
    forwards run the compiled layers themselves (under FSDP a detour to `_orig_mod` skipped the
    unshard hook), which return q and k as outputs; no graph break, the eager counts, and a bounded
    set of graphs: one per layer kind (here F + dense FFN, S + MoE, F + MoE) x measured x grad mode,
    so that Dynamo's recompile limit (raised by compile_blocks) is never hit."""
    cfg = tiny()
    eager = MultimodalModel(cfg).train()
    compiled = compiled_copy(eager)
    graphs = []
    for _ in range(2):  # the second round of the same kinds of forward adds no graph
        batch = random_batch(cfg, 2, 96, 0.25, 4)
        l_c, _ = loss_and_grads(compiled, batch)
        l_e, _ = loss_and_grads(eager, batch)
        assert torch.allclose(l_c, l_e, atol=1e-5)
        stats_c = compiled(**batch, attn_stats=True).attn_stats
        stats_e = eager(**batch, attn_stats=True).attn_stats
        assert stats_c.keys() == stats_e.keys() == set(range(4))
        for i in stats_e:
            assert {k: int(v) for k, v in stats_c[i].items()} == {k: int(v) for k, v in stats_e[i].items()}
        with torch.no_grad():
            cap = compiled(**batch, capture_layers=[0, 1]).captures  # a full and a sparse layer
            cap_e = eager(**batch, capture_layers=[0, 1]).captures
        assert set(cap[0]) == {"q", "k"} and set(cap[1]) == {"q", "k", "selection"}
        assert torch.equal(cap[1]["selection"].picks_BGLk, cap_e[1]["selection"].picks_BGLk)
        graphs.append(counters["stats"]["unique_graphs"])
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["frames"]["ok"] == counters["frames"]["total"], dict(counters["unimplemented"])
    vision = 2  # grad mode
    assert graphs[0] == graphs[1] <= layer_graphs(3) // 2 + vision, graphs  # train mode only here


@pytest.mark.parametrize("sparse", [False, True])
def test_eager_and_compiled_run_the_same_backend(monkeypatch, seed, sparse):
    """Contiguous documents and documents split across a row (sdpa cannot run those: its fallback,
    gather, does), with auto on CPU: the compiled call's op body runs what eager runs."""
    ran: list[str] = []
    for name, b in list(BACKENDS.items()):
        def spy(*args, name=name, run=b.run):
            ran.append(name)
            return run(*args)

        def spy_saved(*args, name=name, forward=b.saved[0] if b.saved else None):
            got = forward(*args)  # the compiled sparse op's forward (it keeps the lse)
            ran.extend([name] if got is not None else [])
            return got
        saved = (spy_saved, b.saved[1]) if b.saved else None
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(b, run=spy, saved=saved))
    forward_rows = sdpa._forward_rows  # the sdpa op's own CPU forward (it keeps the lse)
    monkeypatch.setattr(sdpa, "_forward_rows", lambda *a: ran.append("sdpa") or forward_rows(*a))
    cfg = AttentionConfig(block_size=4, window=4, top_k=1)
    doc_BS, span_BS = random_ids(2, 48, 4)
    split_BS = torch.randint(0, 3, (2, 48), dtype=torch.int32)  # documents interleaved token by token
    for docs_BS in (doc_BS, split_BS):
        meta = build_meta(docs_BS, span_BS, 4)
        q, k, v = random_qkv(2, 4, 2, 48, 8, grad=False)
        ran.clear()
        eager = attend(q, k, v, meta, cfg, sparse)
        eager_ran = list(ran)
        torch._dynamo.reset()
        ran.clear()
        compiled = torch.compile(functools.partial(attend, meta=meta, cfg=cfg, sparse=sparse),
                                 backend="aot_eager")(q, k, v)
        assert ran == eager_ran, (ran, eager_ran)
        assert torch.allclose(compiled, eager, atol=1e-5)
    assert eager_ran == ["gather"]  # the split documents' fallback (and sparse layers' backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_sparse_backward_runs_from_the_saved_lse(monkeypatch, seed, dtype):
    """Under compile the sparse op returns its log-sum-exp and its backward runs the fused backward
    from it: one tile forward per step, not two, and the eager gradients."""
    from mmtrain.models.attention import gather, tiles

    calls = []
    forward = tiles.tiles_forward
    for module in (gather, tiles):  # gather's saved_forward and the eager TileAttention
        monkeypatch.setattr(module, "tiles_forward", lambda *a: calls.append(1) or forward(*a))
    cfg = AttentionConfig(block_size=4, window=8, top_k=2, gather_kernel="tiles")
    meta = build_meta(*random_ids(2, 64, 4), 4)
    q, k, v = random_qkv(2, 4, 2, 64, 8, dtype=dtype)
    w = torch.randn(2, 4, 64, 8, dtype=dtype)
    eager = torch.autograd.grad((attend(q, k, v, meta, cfg, sparse=True) * w).sum(), (q, k, v))
    assert len(calls) == 1
    calls.clear()
    torch._dynamo.reset()
    fn = torch.compile(functools.partial(attend, meta=meta, cfg=cfg, sparse=True), backend="aot_eager")
    compiled = torch.autograd.grad((fn(q, k, v) * w).sum(), (q, k, v))
    assert len(calls) == 1, calls
    for a, b in zip(compiled, eager):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
