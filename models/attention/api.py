"""`attend`: one attention function, several backends (see the package docstring).

Legend: B batch, H query heads, K kv heads, S tokens, D head dim.
"""

from __future__ import annotations

import torch

from . import flash
from .config import AttentionConfig
from .context import ContextShard, attend_context
from .counts import full_counts, sparse_counts
from .dense import attend_dense
from .flex import attend_flex
from .gather import attend_gather_full, attend_gather_sparse
from .meta import AttnMeta
from .opaque import attend_sparse_opaque
from .sdpa import attend_sdpa_full
from .select import select_blocks

Tensor = torch.Tensor


def _check(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig) -> None:
    if q_BHSD.dim() != 4 or k_BKSD.dim() != 4 or k_BKSD.shape != v_BKSD.shape:
        raise ValueError(f"attend: need q (B,H,S,D), k/v (B,Hkv,S,D) (got {tuple(q_BHSD.shape)}, "
                         f"{tuple(k_BKSD.shape)}, {tuple(v_BKSD.shape)})")
    B, H, S, D = q_BHSD.shape
    if k_BKSD.shape[0] != B or k_BKSD.shape[2] != S or k_BKSD.shape[3] != D or H % k_BKSD.shape[1]:
        raise ValueError(f"attend: k/v {tuple(k_BKSD.shape)} do not match q {tuple(q_BHSD.shape)} (GQA)")
    if meta.batch != B or meta.seq_len != S:
        raise ValueError(f"attend: meta is for (B, S) = ({meta.batch}, {meta.seq_len}), q has ({B}, {S})")
    if meta.block_size != cfg.block_size:
        raise ValueError(f"block_size: meta was built with {meta.block_size} (got {cfg.block_size})")


def resolve_backend(cfg: AttentionConfig, q_BHSD: Tensor, meta: AttnMeta, sparse: bool) -> str:
    """The backend that will run: cfg.backend, with auto resolved and flash falling back when unusable.

    auto: sparse -> flex on CUDA, gather elsewhere; full -> flash if usable, else flex on CUDA,
    else sdpa (fused SDPA per document, sdpa.py). sdpa on a sparse layer -> gather.
    """
    backend = cfg.backend
    if backend == "sdpa" or (backend == "auto" and not q_BHSD.is_cuda):
        return "gather" if sparse else "sdpa"
    if backend == "auto" and not sparse and q_BHSD.is_cuda and flash.usable(q_BHSD, meta, sparse):
        return "flash"
    if backend == "flash" and flash.usable(q_BHSD, meta, sparse):
        return "flash"
    if backend in ("auto", "flash"):
        return "flex" if q_BHSD.is_cuda else "gather"
    return backend


def attend(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
           sparse: bool, capture: dict | None = None, stats: dict | None = None,
           context: ContextShard | None = None) -> Tensor:
    """Attention of q over k/v under the token rule (and, if `sparse`, the block rule).

    q (B, H, S, D); k, v (B, Hkv, S, D), H % Hkv == 0. Returns (B, H, S, D) in q's dtype; softmax
    scale 1/sqrt(D). With `capture`, stores "q", "k" (detached) and, for sparse layers,
    "selection" (the `Selection` of picks). With `stats`, stores what the layer visits
    (counts.py: keys, kept and reachable blocks, tokens; scalar tensors). With `context`, q, k, v
    are this rank's chunk of every row (context.py; the gather kernel, any backend asked for).
    """
    if context is not None:
        if capture is not None or stats is not None:
            raise ValueError("attend: capture and stats need whole rows (run without context parallelism)")
        return attend_context(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sparse, context)
    _check(q_BHSD, k_BKSD, v_BKSD, meta, cfg)
    if (sparse and capture is None and stats is None and torch.compiler.is_compiling()
            and resolve_backend(cfg, q_BHSD, meta, sparse) == "gather"):
        return attend_sparse_opaque(q_BHSD, k_BKSD, v_BKSD, meta, cfg)  # selection + gather: one op
    sel = select_blocks(q_BHSD, k_BKSD, meta, cfg) if sparse else None
    if capture is not None:
        capture["q"] = q_BHSD.detach()
        capture["k"] = k_BKSD.detach()
        if sel is not None:
            capture["selection"] = sel
    if stats is not None:
        stats.update(sparse_counts(meta, cfg, sel) if sparse else full_counts(meta))
    backend = resolve_backend(cfg, q_BHSD, meta, sparse)
    out = attend_sdpa_full(q_BHSD, k_BKSD, v_BKSD, meta, cfg.sdpa_group) if backend == "sdpa" else None
    if out is None:
        out = _run(backend, q_BHSD, k_BKSD, v_BKSD, meta, cfg, sparse, sel)
    return out.to(q_BHSD.dtype)


def _run(backend: str, q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
         sparse: bool, sel) -> Tensor:
    if backend in ("gather", "sdpa"):  # sdpa here: documents that are not contiguous runs
        if sparse:
            return attend_gather_sparse(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel)
        return attend_gather_full(q_BHSD, k_BKSD, v_BKSD, meta, cfg)
    if backend == "flex":
        return attend_flex(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel)
    if backend == "flash":
        return flash.attend_flash(q_BHSD, k_BKSD, v_BKSD, meta)
    return attend_dense(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel, eager=cfg.dense_impl == "eager")
