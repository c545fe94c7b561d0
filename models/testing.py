"""Synthetic model inputs for tests and benchmarks, built by the packed-batch rules
(data_pipelines/batch.py) without importing data_pipelines.

A document is a list of segments: a text segment is a 1-D tensor of token ids; a medium is
`Medium(kind, grid_thw, patches_NP)` with its pre-merge patch grid. Packing rules followed:
positions restart per document (text t = h = w = running position; a visual token at merged
grid cell (t, h', w') gets running + (t, h', w'), the running position then moves past the
largest); one span per image and per temporal slice of a video (unique within the row);
padding is document -1; media numbered in row-major placeholder order.

Legend: B rows, S seq_len, N patches, P patch dim, M media.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor
TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass
class Medium:
    kind: int  # IMAGE or VIDEO
    grid_thw: tuple[int, int, int]  # pre-merge patch grid; an image has t = 1
    patches_NP: Tensor


def random_doc(vocab: int, patch_dim: int, n_text: int = 8, media: tuple[tuple[int, tuple], ...] = (),
               pad_ids: tuple[int, int] = (1, 2)) -> list:
    """Text, then each medium followed by more text: [(kind, grid_thw), ...] -> segments."""
    lo = max(pad_ids) + 1
    segs: list = [torch.randint(lo, vocab, (n_text,))]
    for kind, grid in media:
        segs.append(Medium(kind, grid, torch.randn(grid[0] * grid[1] * grid[2], patch_dim)))
        segs.append(torch.randint(lo, vocab, (max(n_text // 2, 1),)))
    return segs


def _doc_tokens(segs: list, merge: int, pad_ids: tuple[int, int], span0: int):
    toks, mods, spans, pos, media, pos_next, span = [], [], [], [], [], 0, span0
    for seg in segs:
        if isinstance(seg, Tensor):
            n = seg.numel()
            toks.append(seg.long())
            mods.append(torch.full((n,), TEXT))
            spans.append(torch.full((n,), -1))
            pos.append((pos_next + torch.arange(n)).expand(3, n))
            pos_next += n
            continue
        t, h, w = seg.grid_thw[0], seg.grid_thw[1] // merge, seg.grid_thw[2] // merge
        n = t * h * w
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        toks.append(torch.full((n,), pad_ids[seg.kind - 1]))
        mods.append(torch.full((n,), seg.kind))
        per_slice = seg.kind == VIDEO  # one span per image, per video frame (temporal slice)
        spans.append(span + (tt.reshape(-1) if per_slice else torch.zeros(n, dtype=torch.long)))
        span += t if per_slice else 1
        pos.append(pos_next + torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]))
        pos_next += max(t, h, w)
        media.append(seg)
    return (torch.cat(toks), torch.cat(mods), torch.cat(spans), torch.cat(pos, dim=1), media, span)


def pack(rows: list[list[list]], seq_len: int, patch_dim: int, merge: int = 2,
         pad_ids: tuple[int, int] = (1, 2), pad_token: int = 0) -> dict[str, Tensor]:
    """rows of documents -> the model's keyword inputs (MultimodalModel.forward)."""
    out = {k: [] for k in ("tokens", "modality", "span", "pos", "doc")}
    media: list[Medium] = []
    for docs in rows:
        parts, span = [], 0
        for d, segs in enumerate(docs):
            tok, mod, sp, pos, med, span = _doc_tokens(segs, merge, pad_ids, span)
            parts.append((tok, mod, sp, pos, torch.full_like(tok, d)))
            media.extend(med)
        n = sum(p[0].numel() for p in parts)
        if n > seq_len:
            raise ValueError(f"seq_len: documents need {n} tokens (got {seq_len})")
        pad = seq_len - n
        parts.append((torch.full((pad,), pad_token), torch.zeros(pad, dtype=torch.long),
                      torch.full((pad,), -1), torch.arange(pad).expand(3, pad),
                      torch.full((pad,), -1)))
        for key, i in (("tokens", 0), ("modality", 1), ("span", 2), ("doc", 4)):
            out[key].append(torch.cat([p[i] for p in parts]))
        out["pos"].append(torch.cat([p[3] for p in parts], dim=1))
    return dict(
        tokens_BS=torch.stack(out["tokens"]),
        pos_ids_3BS=torch.stack(out["pos"], dim=1),
        doc_ids_BS=torch.stack(out["doc"]).int(),
        span_ids_BS=torch.stack(out["span"]).int(),
        modality_BS=torch.stack(out["modality"]).to(torch.int8),
        patches_NP=(torch.cat([m.patches_NP for m in media]) if media else torch.zeros(0, patch_dim)),
        grid_thw_M3=torch.tensor([m.grid_thw for m in media], dtype=torch.long).view(-1, 3),
    )
