"""`attend`: one attention function, several backends (see the package docstring).

Legend: B batch, H query heads, K kv heads, S tokens, D head dim.
"""

from __future__ import annotations

import torch

from . import dense, flash, flex, gather, sdpa  # noqa: F401  (each registers its backend)
from .config import AttentionConfig
from .context import ContextShard, attend_context
from .counts import full_counts, sparse_counts
from .knockout import check_call
from .meta import AttnMeta
from .registry import FULL, SPARSE, resolve
from .select import Selection, select_blocks

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
    """The name of the backend that runs this call (registry.resolve: auto and fallbacks resolved)."""
    return resolve(cfg, q_BHSD, meta, sparse).name


def attend(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
           sparse: bool, capture: dict | None = None, stats: dict | None = None,
           context: ContextShard | None = None) -> Tensor:
    """Attention of q over k/v under the token rule (and, if `sparse`, the block rule).

    q (B, H, S, D); k, v (B, Hkv, S, D), H % Hkv == 0. Returns (B, H, S, D) in q's dtype; softmax
    scale 1/sqrt(D). With `capture`, stores "q", "k" (detached) and, for sparse layers,
    "selection" (the `Selection` of picks). With `stats`, stores what the layer visits
    (counts.py: keys, kept and reachable blocks, tokens; scalar tensors). A key knockout in meta
    (knockout.py) runs on a backend that applies it (else dense). With `context`, q, k, v
    are this rank's chunk of every row (context.py; the gather kernel, any backend asked for).
    Under torch.compile a backend's `opaque` layer kinds run as its custom op (opaque.py).
    """
    check_call(meta, torch.compiler.is_compiling(), context)
    if context is not None:
        if capture is not None or stats is not None:
            raise ValueError("attend: capture and stats need whole rows (run without context parallelism)")
        return attend_context(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sparse, context)
    _check(q_BHSD, k_BKSD, v_BKSD, meta, cfg)
    backend = resolve(cfg, q_BHSD, meta, sparse)
    op = backend.opaque.get(SPARSE if sparse else FULL) if torch.compiler.is_compiling() else None
    measured = capture is not None or stats is not None
    sel = select_blocks(q_BHSD, k_BKSD, meta, cfg) if sparse and (op is None or measured) else None
    _measure(q_BHSD, k_BKSD, meta, cfg, sparse, sel, capture, stats)
    if op is not None:
        return op(q_BHSD, k_BKSD, v_BKSD, meta, cfg)
    return backend.run(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel).to(q_BHSD.dtype)


def measure(q_BHSD: Tensor, k_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig, sparse: bool,
            capture: dict | None, stats: dict | None) -> None:
    """What `attend(capture=, stats=)` records, from a layer's q and k alone (eager, outside a
    compiled layer: the selection reads the host): the selection is deterministic, so recomputing
    it gives the blocks the layer kept."""
    sel = select_blocks(q_BHSD, k_BKSD, meta, cfg) if sparse else None
    _measure(q_BHSD, k_BKSD, meta, cfg, sparse, sel, capture, stats)


def _measure(q_BHSD: Tensor, k_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig, sparse: bool,
             sel: Selection | None, capture: dict | None, stats: dict | None) -> None:
    if capture is not None:
        capture["q"] = q_BHSD.detach()
        capture["k"] = k_BKSD.detach()
        if sel is not None:
            capture["selection"] = sel
    if stats is not None:
        stats.update(sparse_counts(meta, cfg, sel) if sparse else full_counts(meta))
