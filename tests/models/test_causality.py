"""End-to-end properties of the whole model (vision encoder + F/S decoder + MoE), fp32 on CPU:

  * causality: changing the text tokens after position p, and the pixels of every medium that
    starts after p, leaves the logits at <= p unchanged;
  * document isolation: changing every other document of the row (tokens and pixels) leaves a
    document's logits unchanged;
  * packing invariance: a document alone in a row gives the logits it gets packed at a random
    offset behind other documents (document-relative sparse blocks), to fp32 rounding.
Random layouts, block sizes, windows, top_k, selection rules and documents every run (seed printed).

Legend: B rows, S tokens, V vocab, P patch dim.
"""

from __future__ import annotations

import random

import torch

from mmtrain.models.attention import AttentionConfig
from mmtrain.models.decoder import DecoderConfig
from mmtrain.models.moe import MoEConfig
from mmtrain.models.multimodal import ModelConfig, MultimodalModel
from mmtrain.models.testing import IMAGE, VIDEO, pack, random_doc
from mmtrain.models.vision import VisionConfig

V = 64



def random_model() -> MultimodalModel:
    Bs = random.choice([2, 4])
    attn = AttentionConfig(backend="auto", block_size=Bs, window=random.choice([0, Bs]),
                           top_k=random.randint(1, 2), sink=random.random() < 0.5,
                           visual_always=random.random() < 0.5, select=random.choice(["token", "block"]))
    moe = MoEConfig(n_routed=4, top_k=2, n_shared=1, expert_dim=16, first_dense_layers=1)
    dec = DecoderConfig(vocab_size=V, dim=32, n_layers=3, n_heads=4, n_kv_heads=random.choice([1, 2]),
                        ffn_dim=48, mrope_sections=(1, 1, 2), layer_layout=random.choice(["S", "FS", "SF"]),
                        attention=attn, moe=moe if random.random() < 0.7 else None)
    return MultimodalModel(ModelConfig(VisionConfig(dim=16, depth=1, n_heads=2, patch_size=4), dec)).eval()


def random_docs(P: int, n: int) -> list[list]:
    media = [(), ((IMAGE, (1, 4, 4)),), ((VIDEO, (2, 4, 4)),), ((IMAGE, (1, 4, 6)), (VIDEO, (2, 4, 4)))]
    return [random_doc(V, P, random.randint(2, 24), random.choice(media)) for _ in range(n)]


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits_BSV


def media_spans(inputs) -> list[tuple[int, int, int]]:
    """(row, first position, last position) of every medium, in the batch's medium order."""
    grid_M3, merge = inputs["grid_thw_M3"], 2
    n_M = (grid_M3[:, 0] * grid_M3[:, 1] * grid_M3[:, 2] // merge**2).tolist()
    b_Q, s_Q = (inputs["modality_BS"] != 0).nonzero(as_tuple=True)
    out, q = [], 0
    for n in n_M:
        out.append((int(b_Q[q]), int(s_Q[q]), int(s_Q[q + n - 1])))
        q += n
    return out


def patch_ranges(inputs) -> list[slice]:
    grid_M3 = inputs["grid_thw_M3"]
    n_M = (grid_M3[:, 0] * grid_M3[:, 1] * grid_M3[:, 2]).tolist()
    starts = [sum(n_M[:m]) for m in range(len(n_M))]
    return [slice(s, s + n) for s, n in zip(starts, n_M)]


def perturb(inputs, tokens_BS: torch.Tensor, media: list[bool]) -> dict:
    """New text ids where tokens_BS (text only) and new pixels for the chosen media."""
    out = dict(inputs)
    text_BS = tokens_BS & (inputs["modality_BS"] == 0)
    out["tokens_BS"] = torch.where(text_BS, torch.randint(3, V, tokens_BS.shape), inputs["tokens_BS"])
    patches = inputs["patches_NP"].clone()
    for sl, change in zip(patch_ranges(inputs), media):
        if change:
            patches[sl] = torch.randn_like(patches[sl])
    out["patches_NP"] = patches
    return out


def test_future_tokens_and_media_do_not_move_earlier_logits(seed):
    for _ in range(4):
        _future_case(seed)


def _future_case(seed):
    model = random_model()
    P = model.cfg.vision.patch_dim
    rows = [random_docs(P, random.randint(1, 4)) for _ in range(2)]
    inputs = pack(rows, sum(len(_flat(d)) for d in rows[0]) + sum(len(_flat(d)) for d in rows[1]) + 8, P)
    S = inputs["tokens_BS"].shape[1]
    ref = logits(model, inputs)
    spans = media_spans(inputs)
    for p in random.sample(range(2, S - 1), 8):
        after_S = torch.arange(S) > p
        future = perturb(inputs, after_S.expand_as(inputs["tokens_BS"]),
                         [b != 0 or first > p for b, first, _ in spans])
        got = logits(model, future)
        # Visual tokens of a medium that crosses p may see its later part (bidirectional span).
        keep_S = ~after_S
        for b, first, last in spans:
            if b == 0 and first <= p < last:
                keep_S[first:last + 1] = False
        err = (got[0, keep_S] - ref[0, keep_S]).abs().max().item()
        assert err < 1e-5, f"seed={seed} p={p}: logits at <= p moved by {err:.2e} ({model.cfg.decoder})"


def _flat(doc: list) -> list:
    """Token count of a random_doc (text segments + merged visual tokens)."""
    n = []
    for seg in doc:
        if isinstance(seg, torch.Tensor):
            n.extend([0] * seg.numel())
        else:
            t, h, w = seg.grid_thw
            n.extend([1] * (t * (h // 2) * (w // 2)))
    return n


def test_other_documents_do_not_move_a_document(seed):
    model = random_model()
    P = model.cfg.vision.patch_dim
    docs = random_docs(P, random.randint(2, 4))
    inputs = pack([docs], sum(len(_flat(d)) for d in docs) + random.randint(0, 8), P)
    d = random.randrange(len(docs))
    mine_S = inputs["doc_ids_BS"][0] == d
    spans = media_spans(inputs)
    got = logits(model, perturb(inputs, ~mine_S[None], [not bool(mine_S[first]) for _, first, _ in spans]))
    err = (got[0, mine_S] - logits(model, inputs)[0, mine_S]).abs().max().item()
    assert err < 1e-5, f"seed={seed} document {d} moved by {err:.2e} ({model.cfg.decoder})"


def test_document_alone_equals_document_packed_at_an_offset(seed):
    model = random_model()
    P = model.cfg.vision.patch_dim
    doc, others = random_docs(P, 1)[0], random_docs(P, random.randint(1, 3))
    L, off = len(_flat(doc)), sum(len(_flat(d)) for d in others)
    S = off + L + random.randint(0, 8)
    alone = logits(model, pack([[doc]], S, P))[0, :L]
    packed = logits(model, pack([others + [doc]], S, P))[0, off:off + L]
    err = ((alone - packed).abs().max() / alone.abs().max()).item()
    assert err < 1e-4, f"seed={seed} offset {off}: relative difference {err:.2e} ({model.cfg.decoder})"
