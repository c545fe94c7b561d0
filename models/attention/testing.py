"""Test helpers: random documents and packed rows shaped like the data pipeline's (attention and
decoder tests, benchmarks). Padding is document -1, as the packer writes it.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Bs block size.
"""

from __future__ import annotations

import random

import torch

from .registry import BACKENDS

Tensor = torch.Tensor


def backends_on(device: str, backward: bool = False, layer: str = "") -> list[str]:
    """The registered backends whose forward (and backward) runs on `device`, computing `layer`
    ("full", "sparse"; "": either): the tests' parametrisations."""
    return [name for name, b in BACKENDS.items()
            if b.runs_on(device, backward) and (not layer or layer in b.layers)]


def random_doc_spans(L: int, Bs: int, visual: bool = True) -> Tensor:
    """Span ids (0, 1, ... within the document, -1 text) of a document of L tokens: text and
    visual runs alternating, runs of 1 .. 3 blocks, so spans cross block boundaries."""
    span_L = torch.full((L,), -1, dtype=torch.int32)
    p, sid = 0, 0
    while visual and p < L:
        p += random.randint(0, Bs)
        n = min(L - p, random.randint(1, 3 * Bs))
        if n > 0 and random.random() < 0.6:
            span_L[p:p + n] = sid
            sid += 1
        p += max(n, 1)
    return span_L


def random_doc_len(Bs: int, S: int) -> int:
    return min(S, random.choice([random.randint(1, Bs - 1) if Bs > 1 else 1, random.randint(Bs, 4 * Bs),
                                 random.randint(1, 3 * Bs)]))


def pack_row(docs: list[Tensor], S: int, pad: bool = True) -> tuple[Tensor, Tensor]:
    """Documents (their span ids) one after the other into a row of S; the rest is padding (-1).
    Span ids are made unique within the row, as the packer does."""
    doc_S = torch.full((S,), -1, dtype=torch.int32)
    span_S = torch.full((S,), -1, dtype=torch.int32)
    pos, base = 0, 0
    for d, span_L in enumerate(docs):
        L = len(span_L)
        if pos + L > S:
            raise ValueError(f"documents of {pos + L} tokens do not fit a row of {S}")
        doc_S[pos:pos + L] = d
        span_S[pos:pos + L] = torch.where(span_L >= 0, span_L + base, -1)
        base += int(span_L.max()) + 1 if (span_L >= 0).any() else 0
        pos += L
    if not pad and pos < S:
        doc_S[pos:] = len(docs)
    return doc_S, span_S


def random_batch(B: int, S: int, Bs: int, visual: bool = True, pad: bool = True):
    """Packed rows: documents of random lengths (some shorter than a block), visual spans crossing
    block boundaries, padding (document -1) at the end of some rows."""
    doc_BS = torch.empty(B, S, dtype=torch.int32)
    span_BS = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        docs, pos = [], 0
        while pos < S and not (pad and pos > 0 and random.random() < 0.15):
            L = random_doc_len(Bs, S - pos)
            docs.append(random_doc_spans(L, Bs, visual))
            pos += L
        doc_BS[b], span_BS[b] = pack_row(docs, S)
    return doc_BS, span_BS


def random_qkv(B, H, K, S, D, dtype=torch.float32, grad=True):
    q = torch.randn(B, H, S, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, K, S, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, K, S, D, dtype=dtype, requires_grad=grad)
    return q, k, v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def saved_bytes(fn):
    """(bytes autograd saves for backward while fn() runs, fn's result)."""
    nbytes = []

    def pack(t):
        nbytes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(nbytes), out
