"""Attention as opaque custom ops under torch.compile: the sparse layers' op, and the shared parts.

A backend lists in `Backend.opaque` the layer kinds whose work is sized from the batch on the host
(how many blocks a tile visits, the sdpa plan), which a traced graph cannot hold without a break
or a recompilation per batch. Under torch.compile such a call is one custom op: Dynamo and
Inductor see q/k/v in and the output out (same shape as q) and compile everything around it. The
op's body rebuilds the metadata from tensors (documents, span keys; `build_meta` is tensor ops
only), calls `registry.resolve` again eagerly, with the host values, and runs what it picks: the
backend eager would run, fallbacks included. The op also returns the log-sum-exp where the
backend keeps it (`Backend.saved`: gather's CPU tile kernel), and its backward, a second op,
runs the fused backward from the saved output and lse (the selection, deterministic, is
recomputed: the same blocks); elsewhere it replays the layer with autograd (one extra attention
forward, as with checkpointing). The config travels as JSON.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import torch

from .config import AttentionConfig
from .meta import AttnMeta, build_meta
from .registry import resolve
from .select import select_blocks

Tensor = torch.Tensor


def meta_from(doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor, block_size: int) -> AttnMeta:
    """The layer's AttnMeta again: span ids = span keys (unique per span within a row)."""
    return build_meta(doc_BS, torch.where(vis_BS, skey_BS, -1), block_size)


def config_from(cfg_json: str) -> AttentionConfig:
    return AttentionConfig(**json.loads(cfg_json))


def _resolved(q, doc_BS, skey_BS, vis_BS, cfg_json: str):
    cfg = config_from(cfg_json)
    meta = meta_from(doc_BS, skey_BS, vis_BS, cfg.block_size)
    return cfg, meta, resolve(cfg, q, meta, sparse=True)


def _attend(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json: str) -> tuple[Tensor, Tensor]:
    """What `attend` runs eagerly for a sparse layer, the resolved backend on the selection; with
    the log-sum-exp (B, H, S) where the backend keeps it (`Backend.saved`), else zeros."""
    cfg, meta, backend = _resolved(q, doc_BS, skey_BS, vis_BS, cfg_json)
    sel = select_blocks(q, k, meta, cfg)
    got = backend.saved[0](q, k, v, meta, cfg, sel) if backend.saved else None
    if got is not None:
        return got[0].to(q.dtype), got[1].float()
    return backend.run(q, k, v, meta, cfg, sel).to(q.dtype), q.new_zeros(q.shape[:3], dtype=torch.float32)


@contextlib.contextmanager
def _autograd_inside_op():
    """A custom op's body runs below the autograd dispatch keys; re-enable them for a recompute."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


@torch.library.custom_op("mmtrain::sparse_attend", mutates_args=())
def sparse_attend_op(q: Tensor, k: Tensor, v: Tensor, doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor,
                     cfg_json: str) -> tuple[Tensor, Tensor]:
    out, lse = _attend(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json)
    return out.contiguous(), lse.contiguous()


@sparse_attend_op.register_fake  # outputs contiguous (the real ones are made so)
def _(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("mmtrain::sparse_attend_backward", mutates_args=())
def sparse_attend_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor, cfg_json: str
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """From the saved output and lse where the backend keeps them (the selection, deterministic, is
    recomputed: the same blocks), else by replaying the layer with autograd."""
    cfg, meta, backend = _resolved(q, doc_BS, skey_BS, vis_BS, cfg_json)
    if backend.saved:
        got = backend.saved[1](grad, q, k, v, out.to(q.dtype), lse, meta, cfg, select_blocks(q, k, meta, cfg))
        if got is not None:
            return tuple(g.contiguous() for g in got)
    return recompute_grads(lambda *qkv: _attend(*qkv, doc_BS, skey_BS, vis_BS, cfg_json)[0], grad, q, k, v)


def register_lse_backward(op, backward_op) -> None:
    """Wire `op(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json) -> (out, lse)` to `backward_op(grad, q,
    k, v, out, lse, doc_BS, skey_BS, vis_BS, cfg_json) -> (dq, dk, dv)`: the backward's fake
    (contiguous gradients) and the autograd formula (what it saves: inputs, output, lse)."""

    @backward_op.register_fake
    def _(grad, q, k, v, *rest):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup(ctx, inputs, output):
        q, k, v, doc_BS, skey_BS, vis_BS, cfg_json = inputs
        ctx.save_for_backward(q, k, v, *output, doc_BS, skey_BS, vis_BS)
        ctx.cfg_json = cfg_json

    def backward(ctx, grad, _grad_lse):
        dq, dk, dv = backward_op(grad.contiguous(), *ctx.saved_tensors, ctx.cfg_json)
        return dq, dk, dv, None, None, None, None

    op.register_autograd(backward, setup_context=setup)


register_lse_backward(sparse_attend_op, sparse_attend_backward_op)


def recompute_grads(fn, grad: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of fn(q, k, v) against grad, recomputed with autograd inside a custom op."""
    with _autograd_inside_op():
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        return tuple(g.contiguous() for g in torch.autograd.grad(out, xs, grad))




@torch.compiler.assume_constant_result  # evaluated once when traced, a constant in the graph
def config_json(cfg: AttentionConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))


def attend_sparse_opaque(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta,
                         cfg: AttentionConfig) -> Tensor:
    doc_BS, skey_BS, vis_BS = meta.doc_BS, meta.skey_BS, meta.vis_BS
    return sparse_attend_op(q_BHSD, k_BKSD, v_BKSD, doc_BS, skey_BS, vis_BS, config_json(cfg))[0]
