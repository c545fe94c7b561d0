"""The LM head and cross-entropy over chunks of tokens: no (B, S, V) logits in forward or backward.

    ce_BS, lse_BS, hit_BS = head_ce(hidden_BSD, weight_VD, labels_BS, chunk=2048)

Per chunk of C tokens the forward forms the chunk's logits (C, V) in fp32, keeps its logsumexp,
cross-entropy and argmax hit, and drops them; the backward forms them again and turns them into
dlogits = softmax * (g_ce + 2 lse g_z) - onehot * g_ce in place, then accumulates grad_hidden and
grad_weight from it. Held at once: one chunk's (C, V) fp32 (the logsumexp overwrites it; under
bf16 autocast also its bf16 copy, the head's bf16 copy and a (V, D) product), the (V, D) weight
gradient and the (T, D) hidden gradient -- a bound that scales with C, not with S.

`ce_BS` and `lse_BS` both carry gradients: the task sums, the contrast and token weighting read the
per-token CE, the z-loss reads lse. The reference path (`full_logits_ce`) builds the same three from
the full logits; tests/mmtrain/test_chunked_ce.py holds the two equal. Legend: T = B * S tokens,
C tokens of a chunk, V vocabulary, D width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmtrain.data_pipelines.batch import IGNORE_INDEX


def _chunk_logits(h_CD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """The chunk's logits in the compute dtype (w_VD's: bf16 under autocast, as the reference's),
    then fp32. The hidden chunk is cast here, so no (T, D) copy in that dtype is ever held."""
    return (h_CD.to(w_VD.dtype) @ w_VD.T).float()


def _logsumexp_(x_CV: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, overwriting `x_CV` (torch.logsumexp would hold a second copy)."""
    max_C = x_CV.amax(-1)
    max_C = torch.where(max_C.isfinite(), max_C, 0.0)  # all -inf rows: lse -inf, as torch's
    return x_CV.sub_(max_C[:, None]).exp_().sum(-1).log_().add_(max_C)


class _HeadCE(torch.autograd.Function):
    """(hidden_TD, weight_VD, labels_T, chunk, dtype) -> (ce_T, lse_T, hit_T), chunk by chunk; the
    matmuls in `dtype`, the inputs and their gradients in their own dtypes (as autocast's casts)."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, labels_T, chunk, dtype):
        T = h_TD.shape[0]
        ce_T = torch.zeros(T, dtype=torch.float32, device=h_TD.device)
        lse_T, hit_T = torch.empty_like(ce_T), torch.zeros(T, dtype=torch.bool, device=h_TD.device)
        valid_T = labels_T != IGNORE_INDEX
        safe_T = torch.where(valid_T, labels_T, 0)
        w_c_VD = w_VD.to(dtype)  # the head in the compute dtype (a copy only under autocast)
        for lo in range(0, T, chunk):
            sl = slice(lo, lo + chunk)
            logits_CV = _chunk_logits(h_TD[sl], w_c_VD)
            picked_C = logits_CV.gather(1, safe_T[sl, None]).squeeze(1)
            hit_T[sl] = (logits_CV.argmax(-1) == labels_T[sl]) & valid_T[sl]
            lse_T[sl] = _logsumexp_(logits_CV)
            ce_T[sl] = torch.where(valid_T[sl], lse_T[sl] - picked_C, 0.0)
            del logits_CV
        ctx.save_for_backward(h_TD, w_VD, safe_T, valid_T, lse_T)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(hit_T)
        return ce_T, lse_T, hit_T

    @staticmethod
    def backward(ctx, g_ce_T, g_lse_T, _g_hit):
        h_TD, w_VD, safe_T, valid_T, lse_T = ctx.saved_tensors
        g_ce_T = torch.zeros_like(lse_T) if g_ce_T is None else g_ce_T.float() * valid_T
        g_lse_T = torch.zeros_like(lse_T) if g_lse_T is None else g_lse_T.float()
        g_h_TD = torch.empty_like(h_TD) if ctx.needs_input_grad[0] else None
        g_w_VD = torch.zeros_like(w_VD, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        w_c_VD = w_VD.to(ctx.dtype)
        for lo in range(0, h_TD.shape[0], ctx.chunk):
            sl = slice(lo, lo + ctx.chunk)
            d_CV = _chunk_logits(h_TD[sl], w_c_VD)  # the logits again, turned into dlogits in place
            d_CV.sub_(lse_T[sl, None]).exp_().mul_((g_ce_T[sl] + g_lse_T[sl])[:, None])
            d_CV.scatter_add_(1, safe_T[sl, None], -g_ce_T[sl, None])
            d_CV = d_CV.to(ctx.dtype)  # as the reference's backward through .float()
            if g_h_TD is not None and g_h_TD.dtype == d_CV.dtype:
                torch.mm(d_CV, w_c_VD, out=g_h_TD[sl])
            elif g_h_TD is not None:  # the reference's bf16 product, cast back as autocast's would
                g_h_TD[sl] = d_CV @ w_c_VD
            if g_w_VD is not None and d_CV.dtype == torch.float32:
                g_w_VD.addmm_(d_CV.T, h_TD[sl])
            elif g_w_VD is not None:  # bf16: a (V, D) product a chunk, not an fp32 copy of d_CV
                g_w_VD.add_(d_CV.T @ h_TD[sl].to(ctx.dtype))
            del d_CV
        return g_h_TD, None if g_w_VD is None else g_w_VD.to(w_VD.dtype), None, None, None


def head_ce(hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor,
            chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (ce_BS, lse_BS, hit_BS) of logits = hidden @ weight.T, `chunk` tokens at a time: fp32
    cross-entropy (0 where the label is IGNORE_INDEX) and logsumexp with their graphs, bool argmax
    hits (on trained tokens). Under autocast the matmul runs in its dtype, as the reference's."""
    dev = hidden_BSD.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden_BSD.dtype
    B, S = labels_BS.shape
    with torch.autocast(dev, enabled=False):
        ce_T, lse_T, hit_T = _HeadCE.apply(hidden_BSD.reshape(B * S, -1), weight_VD,
                                           labels_BS.reshape(-1), chunk, dtype)
    return ce_T.view(B, S), lse_T.view(B, S), hit_T.view(B, S)


def full_logits_ce(logits_BSV: torch.Tensor, labels_BS: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: the same three from the full logits (fp32 copies of (B, S, V))."""
    ce_BS = F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="none").view_as(labels_BS)
    lse_BS = torch.logsumexp(logits_BSV.float(), dim=-1)
    with torch.no_grad():
        hit_BS = (logits_BSV.argmax(-1) == labels_BS) & (labels_BS != IGNORE_INDEX)
    return ce_BS, lse_BS, hit_BS
