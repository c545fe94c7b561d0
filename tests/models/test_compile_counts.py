"""How often compiled code compiles over many batches of varied documents (issue 35, finding 4).

Every batch below packs new documents (lengths, visual spans, padding), so the aligned layout's
length A (meta.py) changes from batch to batch. Bounds:
  * a compiled training step (every decoder layer compiled, CPU backends): the layers see (B, S)
    only -- the attention is an opaque op -- so one graph per layer kind, whatever A is: 2 here
    (a full and a sparse layer, dense FFN).
  * compiled flex's forward (CPU, inference; `dynamic=False`): one compile per shape. A full layer
    has one (S); a sparse layer one per value of A, which is bucketed: Q + the excess over Q rounded
    up to a power of two, capped at S (`aligned_sizes`): for S = 128, Bs = 16, Q = 8 and
    A in {8, 9, 10, 12, 16, 24, 40, 72, 128}: at most 9 + 1 = 10 compiles, however many batches.
    The exact A (no bucket) compiles once per distinct value.
Dynamo's CompileCounter stands in for Inductor: each frame it is handed is one Inductor compile.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from mmtrain.models import DecoderConfig, ModelConfig, MultimodalModel
from mmtrain.models.attention import AttentionConfig, attend, build_meta, flex
from mmtrain.models.attention.meta import aligned_sizes, bucket_blocks
from mmtrain.models.attention.testing import random_batch, random_qkv
from mmtrain.models.vision import VisionConfig
from mmtrain.parallel.parallelize import compile_blocks

BATCHES = 50


def _tiny(backend: str) -> MultimodalModel:
    attn = AttentionConfig(backend=backend, block_size=4, window=4, top_k=1)
    dec = DecoderConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16,
                        mrope_sections=(1, 1, 2), layer_layout="FS", attention=attn)
    return MultimodalModel(ModelConfig(vision=VisionConfig(dim=16, depth=1, n_heads=1), decoder=dec))


def _step(model: MultimodalModel, doc_BS: torch.Tensor, span_BS: torch.Tensor) -> None:
    B, S = doc_BS.shape
    tokens_BS = torch.randint(0, 32, (B, S))
    pos_3BS = torch.arange(S).expand(3, B, S)
    out = model.decoder(tokens_BS, pos_3BS, doc_BS, span_BS, torch.zeros(B, S, dtype=torch.int8))
    out.hidden_BSD.square().mean().backward()


def test_compiled_training_step_compiles_once_per_layer_kind(seed):
    for backend in ("gather", "dense"):
        model = _tiny(backend).train()
        compile_blocks(model, backend="aot_eager")
        torch._dynamo.reset()
        counters.clear()
        aligned = set()
        for _ in range(BATCHES):
            doc_BS, span_BS = random_batch(1, 64, 4)
            aligned.add(build_meta(doc_BS, span_BS, 4).blocks_B.max().item())
            _step(model, doc_BS, span_BS)
        assert len(aligned) > 2, aligned  # the batches do vary the layout
        assert dict(counters["graph_break"]) == {}, (backend, dict(counters["graph_break"]))
        assert counters["stats"]["unique_graphs"] == 2, (backend, dict(counters["stats"]))


def test_compiled_flex_forward_compiles_once_per_aligned_bucket(monkeypatch, seed):
    from torch.nn.attention.flex_attention import flex_attention

    S, Bs = 128, 16
    counter = CompileCounter()
    compiled = torch.compile(flex_attention, dynamic=False, backend=counter)
    monkeypatch.setattr(flex, "compiled_flex", lambda: compiled)
    torch._dynamo.reset()
    cfg = AttentionConfig(backend="flex", block_size=Bs, window=Bs, top_k=1)
    sizes, needs = set(), set()  # A used, longest row's need
    for _ in range(BATCHES):
        meta = build_meta(*random_batch(2, S, Bs), Bs)
        q, k, v = random_qkv(2, 2, 1, S, 8, grad=False)
        with torch.no_grad():
            attend(q, k, v, meta, cfg, sparse=True)
            attend(q, k, v, meta, cfg, sparse=False)
        sizes.add(meta.aligned_blocks)
        needs.add(meta.blocks_B.max().item())
    buckets = {bucket_blocks(n, S, Bs) for n in needs}
    assert len(needs) > len(buckets), (needs, buckets)  # unbucketed, these would each compile
    assert len(aligned_sizes(S, Bs)) == 9 and buckets <= set(aligned_sizes(S, Bs))
    assert counter.frame_count <= len(buckets) + 1 <= 10, (counter.frame_count, buckets, sizes)


def test_static_aligned_length_under_a_document_cap(seed):
    """With a per-row document cap A is static (no host read): the bound holds for every batch,
    and the layout computes what the bucketed one does (empty trailing blocks change nothing)."""
    S, Bs = 64, 4
    cfg = AttentionConfig(backend="gather", block_size=Bs, window=Bs, top_k=1)
    for _ in range(5):
        doc_BS, span_BS = random_batch(2, S, Bs)
        docs = max(len(row.unique()) for row in doc_BS)
        capped = build_meta(doc_BS, span_BS, Bs, max_docs=docs)
        assert capped.aligned_blocks == min(S, S // Bs + docs - 1) >= capped.blocks_B.max()
        q, k, v = random_qkv(2, 2, 1, S, 8, grad=False)
        got = attend(q, k, v, capped, cfg, sparse=True)
        want = attend(q, k, v, build_meta(doc_BS, span_BS, Bs), cfg, sparse=True)
        assert torch.allclose(got, want, atol=1e-6)


def test_caption_prefill_sees_bucketed_prompt_lengths(monkeypatch, seed):
    """Prompts of 5 .. 60 tokens: prefill's attention runs at 16, 32 or 64 positions only
    (`prompt_bucket`: powers of two), and what it returns is the unpadded prompts'."""
    from mmtrain.models.inference import engine, prefill
    from mmtrain.models.testing import pack, random_doc

    seen = set()
    attend_ = engine.attend
    monkeypatch.setattr(engine, "attend", lambda q, *a, **kw: seen.add(q.shape[2]) or attend_(q, *a, **kw))
    model = _tiny("gather").eval()
    lengths = range(5, 61, 5)
    for n in lengths:
        inputs = pack([[random_doc(32, model.cfg.vision.patch_dim, n)]], n, model.cfg.vision.patch_dim)
        hidden_BSD, cache = prefill(model, **inputs, capacity=n + 4)
        assert hidden_BSD.shape[1] == n and int(cache.len_B[0]) == n
    assert seen == {16, 32, 64}, seen
