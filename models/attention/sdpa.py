"""The `sdpa` backend: full layers as PyTorch's fused `scaled_dot_product_attention` per document.

A row is cut into segments along document runs (host-side plan, once per forward, cached in
`meta.cache`; ARCHITECTURE, "Fused kernels on CPU"): a long document is one `is_causal` call, a
document that is one visual span one unmasked call, consecutive equal one-span documents one
batched call, short documents grouped (`sdpa_group`) into one call with the token rule as a
mask; the rows of a causal segment's visual spans are recomputed with their mask and replace the
causal rows. Every call is exact (the function of `dense`). Documents that are not one
contiguous run make `plan` return None: the registry runs the fallback, gather.
Under torch.compile the call is an opaque custom op whose body resolves the backend again; on
CPU it runs aten's flash forward per call and returns every row's log-sum-exp, from which its
backward op runs aten's flash backward (no second attention forward).

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, N segments / patches of a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import AttentionConfig
from .meta import AttnMeta, token_mask
from .opaque import config_from, config_json, meta_from, recompute_grads, register_lse_backward
from .registry import ANY, FULL, Backend, register_backend, resolve

Tensor = torch.Tensor
PATCH_GAP = 64  # spans closer than this are recomputed in one patch


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    kind: str  # "causal", "full" (one span from start to end), "mask" (grouped documents),
    #            "batch" (consecutive one-span documents of `size` tokens each)
    patches: tuple[tuple[int, int, int], ...] = ()  # (query start, query end, key start)
    size: int = 0


def _runs(x_S: Tensor) -> list[int]:
    """Start positions of the runs of equal values of x (host)."""
    start_S = F.pad(x_S[1:] != x_S[:-1], (1, 0), value=True)
    return start_S.nonzero().flatten().tolist()


def plan_row(doc_S: Tensor, skey_S: Tensor, span_last_S: Tensor, group: int) -> list[Segment] | None:
    """Segments covering one row in order, or None if a document is not one contiguous run."""
    S = doc_S.shape[0]
    starts = _runs(doc_S)
    ids = doc_S[starts].tolist()
    if len(set(ids)) != len(ids):
        return None
    bounds = list(zip(starts, starts[1:] + [S]))
    vis_S = skey_S >= 0
    span_starts = (vis_S & F.pad(skey_S[1:] != skey_S[:-1], (1, 0), value=True)).nonzero().flatten()
    spans = list(zip(span_starts.tolist(), (span_last_S[span_starts] + 1).tolist()))
    docs, si = [], 0  # (start, end, its spans)
    for s, e in bounds:
        doc_spans = []
        while si < len(spans) and spans[si][0] < e:
            doc_spans.append(spans[si])
            si += 1
        docs.append((s, e, doc_spans))
    segs: list[Segment] = []
    g0 = None  # start of the open group of short documents
    i = 0
    while i < len(docs):
        s, e, doc_spans = docs[i]
        i += 1
        j = i  # one-span documents of equal length (media in the vision tower): one batched call
        while doc_spans == [(s, e)] and j < len(docs) and docs[j][2] == [docs[j][:2]] and \
                docs[j][1] - docs[j][0] == e - s:
            j += 1
        if j > i:
            if g0 is not None:
                segs.append(Segment(g0, s, "mask"))
                g0 = None
            segs.append(Segment(s, docs[j - 1][1], "batch", size=e - s))
            i = j
            continue
        if e - s <= group:
            if g0 is not None and e - g0 > group:
                segs.append(Segment(g0, s, "mask"))
                g0 = None
            g0 = s if g0 is None else g0
            continue
        if g0 is not None:
            segs.append(Segment(g0, s, "mask"))
            g0 = None
        if doc_spans == [(s, e)]:
            segs.append(Segment(s, e, "full"))
            continue
        patches: list[list[int]] = []
        for a, b in doc_spans:
            if patches and a - patches[-1][1] < PATCH_GAP:
                patches[-1][1] = max(patches[-1][1], b)
            else:
                patches.append([a, b])
        segs.append(Segment(s, e, "causal", tuple((a, b, s) for a, b in patches)))
    if g0 is not None:
        segs.append(Segment(g0, S, "mask"))
    return segs


def plan(doc_BS: Tensor, skey_BS: Tensor, span_last_BS: Tensor, group: int) -> list[list[Segment]] | None:
    rows = [plan_row(doc_BS[b], skey_BS[b], span_last_BS[b], group) for b in range(doc_BS.shape[0])]
    return None if any(r is None for r in rows) else rows


def _mask(doc_S: Tensor, skey_S: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """The token rule for queries [qs, qe) against keys [ks, ke)."""
    pos_q, pos_k = torch.arange(qs, qe, device=doc_S.device), torch.arange(ks, ke, device=doc_S.device)
    return token_mask(doc_S[qs:qe, None], skey_S[qs:qe, None], pos_q[:, None], doc_S[None, ks:ke],
                      skey_S[None, ks:ke], pos_k[None])


def _batch(x: Tensor, size: int) -> Tensor:
    """(1, H, n * size, *) -> (n, H, size, *): consecutive documents as a batch."""
    return x[0].unflatten(1, (-1, size)).transpose(0, 1)


def _unbatch(x: Tensor) -> Tensor:
    """(n, H, size, *) -> (1, H, n * size, *)."""
    return x.transpose(0, 1).flatten(1, 2)[None]


@dataclass(frozen=True)
class Call:
    """One fused call: queries [qs, qe) over keys [ks, ke), with the token rule as `mask` or
    `causal`, or with `size` > 0 that range as a batch of documents of `size` tokens (no mask).
    `keep`: its query rows [a, b) that are the layer's output (a causal call loses the rows of its
    span patches, which their own calls recompute)."""

    qs: int
    qe: int
    ks: int
    ke: int
    keep: tuple[tuple[int, int], ...]
    mask: Tensor | None = None
    causal: bool = False
    size: int = 0


def _calls(segs: list[Segment], doc_S: Tensor, skey_S: Tensor) -> list[Call]:
    """A row's fused calls, from its plan (the forward and the backward walk the same list)."""
    calls = []
    for seg in segs:
        s, e = seg.start, seg.end
        if seg.kind == "mask":
            calls.append(Call(s, e, s, e, ((s, e),), mask=_mask(doc_S, skey_S, s, e, s, e)))
        elif seg.kind == "batch":
            calls.append(Call(s, e, s, e, ((s, e),), size=seg.size))
        else:
            cuts = [s, *(x for a, b, _ in seg.patches for x in (a, b)), e]
            keep = tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a)
            calls.append(Call(s, e, s, e, keep, causal=seg.kind == "causal"))
            calls += [Call(a, b, ks, b, ((a, b),), mask=_mask(doc_S, skey_S, a, b, ks, b))
                      for a, b, ks in seg.patches]
    return calls


def _row(calls: list[Call], run) -> tuple[Tensor, ...]:
    """One row's outputs: `run(call)` -> a tuple of (1, H, qe - qs, ...) tensors; each call's kept
    rows, put in row order and joined."""
    pieces = []
    for c in calls:
        res = run(c)
        pieces += [(a, tuple(t[:, :, a - c.qs:z - c.qs] for t in res)) for a, z in c.keep]
    pieces.sort(key=lambda p: p[0])
    columns = zip(*(p for _, p in pieces))  # output, then lse (the op's forward)
    return tuple(torch.cat(parts, 2) if len(parts) > 1 else parts[0] for parts in columns)


def attend_rows(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, doc_BS: Tensor, skey_BS: Tensor,
                rows: list[list[Segment]]) -> Tensor:
    """The eager body: every row by its plan (SDPA's default scale 1 / sqrt(D)), kept 4-D (CPU SDPA
    runs its fused kernel only on 4-D inputs, else the math path); autograd through SDPA."""
    gqa = q_BHSD.shape[1] != k_BKSD.shape[1]
    outs = []
    for b, segs in enumerate(rows):
        q, k, v = q_BHSD[b:b + 1], k_BKSD[b:b + 1], v_BKSD[b:b + 1]

        def run(c: Call, q=q, k=k, v=v):
            qi, ki, vi = q[:, :, c.qs:c.qe], k[:, :, c.ks:c.ke], v[:, :, c.ks:c.ke]
            if c.size:
                o = F.scaled_dot_product_attention(_batch(qi, c.size), _batch(ki, c.size), _batch(vi, c.size),
                                                   enable_gqa=gqa)
                return (_unbatch(o),)
            return (F.scaled_dot_product_attention(qi, ki, vi, attn_mask=c.mask, is_causal=c.causal,
                                                   enable_gqa=gqa),)
        outs.append(_row(_calls(segs, doc_BS[b], skey_BS[b]), run)[0])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _flash(q, k, v, b: int, c: Call) -> tuple[Tensor, Tensor]:
    """Call c on row b with aten's CPU flash forward (GQA native) -> (out (1, H, L, D), lse (1, H, L))."""
    qi, ki, vi = q[b:b + 1, :, c.qs:c.qe], k[b:b + 1, :, c.ks:c.ke], v[b:b + 1, :, c.ks:c.ke]
    if c.size:
        qi, ki, vi = (_batch(t, c.size) for t in (qi, ki, vi))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qi.contiguous(), ki.contiguous(), vi.contiguous(), 0.0, c.causal, attn_mask=_bias(c.mask, q))
    return (_unbatch(out), _unbatch(lse)) if c.size else (out, lse)


def _bias(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """aten's flash ops take the mask as an additive bias."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, float("-inf"))


def _forward_rows(q, k, v, doc_BS, skey_BS, rows) -> tuple[Tensor, Tensor]:
    """The custom op's CPU body: (out (B, H, S, D), lse (B, H, S)), the lse saved for backward."""
    outs = []
    for b, segs in enumerate(rows):
        outs.append(_row(_calls(segs, doc_BS[b], skey_BS[b]), lambda c, b=b: _flash(q, k, v, b, c)))
    return tuple(torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*outs))


def _resolved(q: Tensor, doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor, cfg_json: str):
    """The op's config, metadata and backend: `resolve` as eager runs it (sdpa, or its fallback)."""
    cfg = config_from(cfg_json)
    meta = meta_from(doc_BS, skey_BS, vis_BS, cfg.block_size)
    return cfg, meta, resolve(cfg, q, meta, sparse=False)


@torch.library.custom_op("mmtrain::sdpa_full", mutates_args=())
def sdpa_full_op(q: Tensor, k: Tensor, v: Tensor, doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor,
                 cfg_json: str) -> tuple[Tensor, Tensor]:
    """-> (out, lse). On CPU the sdpa plan keeps every row's lse for the backward (no second
    forward); elsewhere, or where the call resolves to the fallback, lse is zeros and the backward
    recomputes with autograd."""
    cfg, meta, backend = _resolved(q, doc_BS, skey_BS, vis_BS, cfg_json)
    if backend.name != "sdpa" or q.device.type != "cpu":
        out = backend.run(q, k, v, meta, cfg, None)
        return out.contiguous(), q.new_zeros(q.shape[:3], dtype=torch.float32)
    rows = _plan(meta, cfg.sdpa_group)
    out, lse = _forward_rows(q.contiguous(), k.contiguous(), v.contiguous(), meta.doc_BS, meta.skey_BS, rows)
    return out.contiguous(), lse.float().contiguous()


@sdpa_full_op.register_fake  # outputs contiguous (the real ones are made so)
def _(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _call_backward(grads, grad_1HSD, q, k, v, out, lse, b: int, c: Call) -> None:
    """Call c's backward on row b from the saved output and lse; accumulate its gradients.

    The rows of a causal call that a span patch replaced get a zero gradient here, and their saved
    out / lse are the patch's: with dO = 0 the kernel's row terms vanish whatever O and lse are
    (lse finite: the patch's is over a superset of the causal keys)."""
    dq, dk, dv = grads
    if c.keep != ((c.qs, c.qe),):  # rows the call does not keep: no gradient from it
        kept = torch.zeros_like(grad_1HSD)
        for a, z in c.keep:
            kept[:, :, a - c.qs:z - c.qs] = grad_1HSD[:, :, a - c.qs:z - c.qs]
        grad_1HSD = kept
    xs = (grad_1HSD, q[b:b + 1, :, c.qs:c.qe], k[b:b + 1, :, c.ks:c.ke], v[b:b + 1, :, c.ks:c.ke],
          out[b:b + 1, :, c.qs:c.qe], lse[b:b + 1, :, c.qs:c.qe])
    if c.size:
        xs = tuple(_batch(t, c.size) for t in xs)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.contiguous() for t in xs), 0.0, c.causal, attn_mask=_bias(c.mask, q))
    if c.size:
        gq, gk, gv = _unbatch(gq), _unbatch(gk), _unbatch(gv)
    dq[b:b + 1, :, c.qs:c.qe] += gq
    dk[b:b + 1, :, c.ks:c.ke] += gk
    dv[b:b + 1, :, c.ks:c.ke] += gv


def _backward_rows(grad, q, k, v, out, lse, doc_BS, skey_BS, rows) -> tuple[Tensor, Tensor, Tensor]:
    grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    for b, segs in enumerate(rows):
        for c in _calls(segs, doc_BS[b], skey_BS[b]):
            _call_backward(grads, grad[b:b + 1, :, c.qs:c.qe], q, k, v, out, lse, b, c)
    return grads


@torch.library.custom_op("mmtrain::sdpa_full_backward", mutates_args=())
def sdpa_full_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor, cfg_json: str
                          ) -> tuple[Tensor, Tensor, Tensor]:
    cfg, meta, backend = _resolved(q, doc_BS, skey_BS, vis_BS, cfg_json)
    if backend.name != "sdpa" or q.device.type != "cpu":  # no saved lse there: recompute with autograd
        return recompute_grads(lambda *qkv: backend.run(*qkv, meta, cfg, None), grad, q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _backward_rows(grad, q, k, v, out, lse, meta.doc_BS, meta.skey_BS, _plan(meta, cfg.sdpa_group))


register_lse_backward(sdpa_full_op, sdpa_full_backward_op)


def _plan(meta: AttnMeta, group: int) -> list[list[Segment]]:
    """The rows' plan, once per forward (the registry checked that documents are contiguous runs)."""
    key = ("sdpa_plan", group)
    if key not in meta.cache:
        meta.cache[key] = plan(meta.doc_BS, meta.skey_BS, meta.span_last_BS, group)
    return meta.cache[key]


def attend_sdpa_full(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                     sel=None) -> Tensor:
    """A full layer by fused SDPA calls (`plan`; full layers only, so no selection)."""
    return attend_rows(q_BHSD, k_BKSD, v_BKSD, meta.doc_BS, meta.skey_BS, _plan(meta, cfg.sdpa_group))


def attend_sdpa_opaque(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta,
                       cfg: AttentionConfig) -> Tensor:
    return sdpa_full_op(q_BHSD, k_BKSD, v_BKSD, meta.doc_BS, meta.skey_BS, meta.vis_BS, config_json(cfg))[0]


def docs_contiguous(q_BHSD: Tensor, meta: AttnMeta) -> bool:
    return meta.docs_contiguous


register_backend(Backend("sdpa", attend_sdpa_full, layers=frozenset({FULL}), devices=ANY, train=ANY,
                         usable=docs_contiguous, opaque={FULL: attend_sdpa_opaque}, fallback=("gather",),
                         auto=3))
