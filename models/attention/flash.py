"""The `flash` backend: flash-attn varlen for full layers of span-free batches (optional extra).

One flash "sequence" per document run: cu_seqlens come from the doc ids; causal inside. It cannot
express bidirectional spans or block selections, so `usable` says when it applies and the registry
runs its fallback otherwise (flex on CUDA, else gather). If flash-attn is not installed, the
registry reports it once (a warning) and falls back; never an import error.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, T = B * S packed tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from .meta import AttnMeta
from .registry import FULL, Backend, register_backend

Tensor = torch.Tensor


@functools.cache
def flash_varlen():
    """flash_attn_varlen_func (the registry checks that flash_attn is importable first)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def usable(q_BHSD: Tensor, meta: AttnMeta) -> bool:
    """Whether flash computes this full layer exactly: half precision, no span, documents contiguous."""
    return q_BHSD.dtype in (torch.float16, torch.bfloat16) and not meta.has_spans and meta.docs_contiguous


def cu_seqlens(meta: AttnMeta) -> tuple[Tensor, int]:
    """Start offsets of every document run in the (B * S) packed token order, and the longest run."""
    doc_BS = meta.doc_BS
    B, S = doc_BS.shape
    start_BS = torch.ones_like(doc_BS, dtype=torch.bool)
    start_BS[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
    starts_R = start_BS.reshape(-1).nonzero().squeeze(1)
    cu_R1 = torch.cat([starts_R, starts_R.new_tensor([B * S])]).to(torch.int32)
    return cu_R1, int((cu_R1[1:] - cu_R1[:-1]).max())


def attend_flash(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta) -> Tensor:
    fn = flash_varlen()
    B, H, S, D = q_BHSD.shape
    cu, max_len = cu_seqlens(meta)
    q_THD = q_BHSD.transpose(1, 2).reshape(B * S, H, D)
    k_TKD = k_BKSD.transpose(1, 2).reshape(B * S, -1, D)
    v_TKD = v_BKSD.transpose(1, 2).reshape(B * S, -1, D)
    out_THD = fn(q_THD, k_TKD, v_TKD, cu, cu, max_len, max_len, softmax_scale=1 / math.sqrt(D), causal=True)
    return out_THD.view(B, S, H, D).transpose(1, 2)


def run_flash(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg, sel) -> Tensor:
    return attend_flash(q_BHSD, k_BKSD, v_BKSD, meta)


register_backend(Backend("flash", run_flash, layers=frozenset({FULL}), devices=("cuda",), train=("cuda",),
                         package="flash_attn", usable=usable, fallback=("flex", "gather"), auto=1))
