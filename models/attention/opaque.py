"""Sparse layers' `gather` path as one opaque op under torch.compile.

The selection and the gather kernel size their work from the batch (how many blocks a tile
visits, how far back a chunk reaches: host values), which a traced graph cannot hold without a
break or a recompilation per batch. Under torch.compile the whole sparse attention (selection +
gather) is therefore one custom op: Dynamo and Inductor see a node with q/k/v in and the output
out (same shape as q) and compile everything around it. Its backward is a second op that
recomputes the layer's attention eagerly with autograd (the selection is deterministic, so the
same blocks) and returns the gradients: one extra attention forward, as with checkpointing.

The op takes the metadata as tensors (documents, span keys) and rebuilds `AttnMeta` inside
(build_meta: tensor ops only), and the config as JSON.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import torch

from .config import AttentionConfig
from .gather import attend_gather_sparse
from .meta import build_meta
from .select import select_blocks

Tensor = torch.Tensor


def _meta(doc_BS: Tensor, skey_BS: Tensor, vis_BS: Tensor, block_size: int):
    """The layer's AttnMeta again: span ids = span keys (unique per span within a row)."""
    return build_meta(doc_BS, torch.where(vis_BS, skey_BS, -1), block_size)


def _attend(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json: str) -> Tensor:
    """What `attend` runs eagerly for a sparse layer on the gather backend: selection + gather."""
    cfg = AttentionConfig(**json.loads(cfg_json))
    meta = _meta(doc_BS, skey_BS, vis_BS, cfg.block_size)
    return attend_gather_sparse(q, k, v, meta, cfg, select_blocks(q, k, meta, cfg)).to(q.dtype)


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
                     cfg_json: str) -> Tensor:
    return _attend(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json).contiguous()


@sparse_attend_op.register_fake  # outputs contiguous (the real ones are made so)
def _(q, k, v, doc_BS, skey_BS, vis_BS, cfg_json):
    return q.new_empty(q.shape)


@torch.library.custom_op("mmtrain::sparse_attend_backward", mutates_args=())
def sparse_attend_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, doc_BS: Tensor, skey_BS: Tensor,
                              vis_BS: Tensor, cfg_json: str) -> tuple[Tensor, Tensor, Tensor]:
    return recompute_grads(lambda *qkv: _attend(*qkv, doc_BS, skey_BS, vis_BS, cfg_json), grad, q, k, v)


def recompute_grads(fn, grad: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of fn(q, k, v) against grad, recomputed with autograd inside a custom op."""
    with _autograd_inside_op():
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        return tuple(g.contiguous() for g in torch.autograd.grad(out, xs, grad))


def register_qkv_backward(op, backward_op) -> None:
    """Wire an attention op `op(q, k, v, *six_tensors_and_consts)` to `backward_op(grad, q, k, v,
    ...)` -> (dq, dk, dv): the fake backward (contiguous gradients) and the autograd formula.
    The op's inputs are 6 tensors then one non-tensor constant."""

    @backward_op.register_fake
    def _(grad, q, k, v, *rest):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:6])
        ctx.const = inputs[6]

    def backward(ctx, grad):
        dq, dk, dv = backward_op(grad.contiguous(), *ctx.saved_tensors, ctx.const)
        return dq, dk, dv, None, None, None, None

    op.register_autograd(backward, setup_context=setup)


register_qkv_backward(sparse_attend_op, sparse_attend_backward_op)


@torch.compiler.assume_constant_result  # evaluated once when traced, a constant in the graph
def config_json(cfg: AttentionConfig) -> str:
    return json.dumps(dataclasses.asdict(dataclasses.replace(cfg, backend="gather")))


def attend_sparse_opaque(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta, cfg: AttentionConfig
                         ) -> Tensor:
    return sparse_attend_op(q_BHSD, k_BKSD, v_BKSD, meta.doc_BS, meta.skey_BS, meta.vis_BS, config_json(cfg))
