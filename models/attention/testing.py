"""Test helpers: random packed batches shaped like the data pipeline's (for attention and decoder tests).

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Bs block size.
"""

from __future__ import annotations

import random

import torch


def random_batch(B: int, S: int, Bs: int, visual: bool = True, pad: bool = True):
    """Packed rows: documents of random lengths (some shorter than a block), visual spans crossing
    block boundaries, span ids per row or restarting per document, padding as its own document."""
    doc_BS = torch.empty(B, S, dtype=torch.int32)
    span_BS = torch.full((B, S), -1, dtype=torch.int32)
    per_doc_ids = random.random() < 0.5
    for b in range(B):
        pos, d, sid = 0, 0, 0
        while pos < S:
            if pad and pos > 0 and random.random() < 0.15:
                doc_BS[b, pos:] = d  # padding: one document of its own
                break
            L = min(S - pos, random.choice([random.randint(1, Bs - 1), random.randint(Bs, 4 * Bs),
                                            random.randint(1, 3 * Bs)]))
            doc_BS[b, pos:pos + L] = d
            p, sid = pos, 0 if per_doc_ids else sid
            while visual and p < pos + L:  # alternate text and visual runs inside the document
                p += random.randint(0, Bs)
                n = min(pos + L - p, random.randint(1, 3 * Bs))
                if n > 0 and random.random() < 0.6:
                    span_BS[b, p:p + n] = sid
                    sid += 1
                p += max(n, 1)
            pos, d = pos + L, d + 1
    return doc_BS, span_BS


def random_qkv(B, H, K, S, D, dtype=torch.float32, grad=True):
    q = torch.randn(B, H, S, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, K, S, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, K, S, D, dtype=dtype, requires_grad=grad)
    return q, k, v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))
