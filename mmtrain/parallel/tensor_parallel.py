"""Tensor parallelism with sequence parallelism over the `tp` group (mmtrain/parallel/dims.py),
applied to the decoder from outside the model files.

Between the matmuls a tp rank holds a contiguous chunk of every row (sequence parallelism): the
decoder runs under the same `ContextShard` as context parallelism, over the (cp, tp) ranks, so
embeddings, norms, residuals, the MoE router and routed experts, the LM head and the loss see
this rank's tokens only, exactly as a cp rank's do (the MoE's per-row balance statistics are
completed over the group by `context.comm.sum`, as under CP). Around the matmuls (Megatron's
pattern, torchtitan's SequenceParallel -> colwise -> rowwise plan):

    attention  x (B, s, D) -all-gather(tp)-> (B, S', D) -> this rank's heads -> wo's partial sums
               (B, S', D) -reduce-scatter(tp)-> (B, s, D)          (S' = s * tp: the cp chunk)
    SwiGLU     x (T, D)   -all-gather(tp)-> (tp T, D)  -> this rank's hidden units -> reduce-scatter
               (the dense FFN and the MoE's shared expert)

A rank's heads are whole KV groups (tp must divide n_kv_heads), so a sparse layer's selection,
per head or per GQA group (the mean of the group's queries), is exactly the single process's.

Weights: FSDP2 shards every parameter over (dp_shard x cp x tp) as usual (the dense mesh's
`fsdp` dim includes tp), and a tp rank multiplies by its rows of the gathered wqkv / w_in (head
and hidden-unit slices of the fused [q | k | v] and [gate | up] layouts, which a contiguous
`Shard(0)` DTensor cannot express without a new layout) and its columns of wo / w_out. Its
gradient is zero outside its slice, so FSDP's reduce-scatter (a sum over the tp ranks too)
assembles the full gradient: no tp all-reduce, no extra scale, and the checkpoint is the FSDP
one (DCP reshards across tp and fsdp alike). The price: the weights are all-gathered over tp as
well (ZeRO-3 over tp), where Megatron's TP keeps its shard and never gathers them.

Under `dist.compile` the layers are compiled before they are split (parallelize.build_model):
Dynamo traces the patched forwards on first call, and graph-breaks at each collective (the
call-site wrapper of mmtrain/parallel/calls.py), so a layer compiles between its collectives.

The vision encoder is replicated over tp (every rank of a (cp, tp) group encodes the rows'
media, as under CP): it is a small share of the step, and its visual tokens land in whichever
rank's chunk holds their placeholders.

Legend: B rows, s this rank's tokens of a row, S' the tp group's, D model dim, T tokens, P ranks.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmtrain.errors import UserError
from mmtrain.models.attention.context import ContextShard
from mmtrain.models.ffn import SwiGLU, swiglu
from mmtrain.models.moe import MoE
from mmtrain.parallel.comm import Traffic

if TYPE_CHECKING:
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.models.self_attention import SelfAttention
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.run_config import RunConfig

Tensor = torch.Tensor


class TPComm:
    """The tp group's activation collectives (every rank calls each in the same order).

    `whole`: the layer's input is whole rows, the same on every tp rank (evaluation and
    diagnostics forwards run without the row shard): then a split layer enters by a copy (backward:
    all-reduce) and leaves by an all-reduce (backward: a copy), Megatron's f and g. Set by each
    layer's attention from its `context`, read by the same layer's FFN."""

    def __init__(self, group: dist.ProcessGroup, traffic: Traffic | None = None) -> None:
        self.group, self.traffic = group, traffic
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.whole = False

    def enter(self, x: Tensor, dim: int) -> Tensor:
        """Into a split layer: this rank's chunk gathered along `dim`, or whole rows copied."""
        return _Copy.apply(x, self) if self.whole else self.gather(x, dim)

    def leave(self, x: Tensor, dim: int) -> Tensor:
        """Out of a split layer: the ranks' partial sums reduced (and scattered along `dim`)."""
        return _Reduce.apply(x, self) if self.whole else self.reduce_scatter(x, dim)

    def count(self, kind: str, x: Tensor) -> None:
        if self.traffic is not None:
            self.traffic.add(kind, x.numel() * x.element_size() * (self.size - 1))

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """All-gather along `dim`; backward: reduce-scatter (the sum of every rank's gradient)."""
        return _Gather.apply(x, dim, self)

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        """Sum over the group, keep this rank's chunk of `dim`; backward: all-gather."""
        return _ReduceScatter.apply(x, dim, self)


def _all_gather(x: Tensor, dim: int, comm: TPComm, kind: str) -> Tensor:
    comm.count(kind, x)
    parts = [torch.empty_like(x) for _ in range(comm.size)]
    dist.all_gather(parts, x.contiguous(), group=comm.group)
    return torch.cat(parts, dim)


def _sum_chunk(x: Tensor, dim: int, comm: TPComm, kind: str) -> Tensor:
    """The group's sum, this rank's chunk of `dim`: a reduce-scatter (gloo runs the tensor form too),
    each rank sending (P - 1) / P of `x`, half an all-reduce's bytes. `dim` is moved to the front
    for the collective (it scatters along dim 0) and back."""
    x_front = x.movedim(dim, 0).contiguous()
    out = x_front.new_empty(x_front.shape[0] // comm.size, *x_front.shape[1:])
    comm.count(kind, out)
    dist.reduce_scatter_single(out, x_front, group=comm.group)
    return out.movedim(0, dim).contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, comm: TPComm) -> Tensor:
        ctx.dim, ctx.comm = dim, comm
        return _all_gather(x, dim, comm, "tp_all_gather")

    @staticmethod
    def backward(ctx, g: Tensor):
        return _sum_chunk(g, ctx.dim, ctx.comm, "tp_reduce_scatter"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, comm: TPComm) -> Tensor:
        ctx.dim, ctx.comm = dim, comm
        return _sum_chunk(x, dim, comm, "tp_reduce_scatter")

    @staticmethod
    def backward(ctx, g: Tensor):
        return _all_gather(g, ctx.dim, ctx.comm, "tp_all_gather"), None, None


def _all_reduce(x: Tensor, comm: TPComm) -> Tensor:
    comm.count("tp_all_reduce", x)
    x = x.clone(memory_format=torch.contiguous_format)  # one copy, contiguous for the collective
    dist.all_reduce(x, group=comm.group)
    return x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _all_reduce(g, ctx.comm), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, comm: TPComm) -> Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


# ----- the slices a tp rank multiplies by -------------------------------------------------------
def _rows_linear(linear: nn.Linear, spans: list[tuple[int, int]], x: Tensor) -> Tensor:
    """x @ W[rows].T for the row spans (start, length): a column-parallel slice of a fused weight.
    `linear.weight` is read at call time: FSDP2's gathered parameter."""
    w = torch.cat([linear.weight.narrow(0, a, n) for a, n in spans])
    return F.linear(x, w)


def _cols_linear(linear: nn.Linear, start: int, length: int, x: Tensor) -> Tensor:
    """x @ W[:, cols].T: a row-parallel slice (partial sums, reduced by the caller)."""
    return F.linear(x, linear.weight.narrow(1, start, length))


def _split_attention(attn: SelfAttention, comm: TPComm, cp: ContextShard | None) -> None:
    """This rank's whole KV groups: its q heads, k and v heads of the fused wqkv, its wo columns."""
    H, K, E, t, P = attn.n_heads, attn.n_kv_heads, attn.head_dim, comm.rank, comm.size
    h, k = H // P, K // P
    attn.wqkv.forward = partial(_rows_linear, attn.wqkv, [(t * h * E, h * E), ((H + t * k) * E, k * E),
                                                          ((H + K + t * k) * E, k * E)])
    attn.wo.forward = partial(_cols_linear, attn.wo, t * h * E, h * E)
    attn.n_heads, attn.n_kv_heads = h, k  # project() and output() view with the local counts
    inner = attn.forward

    def forward(x_BsD, cos_B1sF, sin_B1sF, meta, cfg, sparse=False, capture=None, stats=None,
                context=None, return_qk=False):
        if capture is not None or stats is not None:  # (the decoder measures from return_qk)
            raise ValueError("attend: capture and stats need all heads (run without dist.tp)")
        comm.whole = context is None  # whole rows (evaluation): no chunk to gather, no cp split
        cos, sin = cos_B1sF, sin_B1sF
        if not comm.whole:
            with torch.no_grad():  # the rotary of the gathered chunk (no parameters behind it)
                cos, sin = (_all_gather(c, 2, comm, "tp_rotary_all_gather") for c in (cos, sin))
        out = inner(comm.enter(x_BsD, 1), cos, sin, meta, cfg, sparse=sparse,
                    context=None if comm.whole else cp, return_qk=return_qk)
        if not return_qk:
            return comm.leave(out, 1)
        # measured (whole rows only: the decoder refuses it under a row shard): every head's q, k
        return comm.leave(out[0], 1), *(_all_gather(t, 1, comm, "tp_qk_all_gather") for t in out[1:])

    attn.forward = forward


def _split_swiglu(ffn: SwiGLU, comm: TPComm) -> None:
    """This rank's hidden units: its gate and up rows of w_in, its w_out columns."""
    F2, t, P = ffn.w_in.weight.shape[0], comm.rank, comm.size
    f = F2 // 2 // P

    def forward(x_TD: Tensor) -> Tensor:
        x_tD = comm.enter(x_TD, 0)
        h_tF = swiglu(_rows_linear(ffn.w_in, [(t * f, f), (F2 // 2 + t * f, f)], x_tD))
        return comm.leave(_cols_linear(ffn.w_out, t * f, f, h_tF), 0)

    ffn.forward = forward


def check_tp(cfg: RunConfig, dims: ParallelDims) -> None:
    """What tensor parallelism needs of the config: one line naming the key, before any work."""
    tp, dec = dims.tp, cfg.model.decoder
    rules = [
        (dec.n_kv_heads % tp == 0, f"model.decoder.n_kv_heads: {dec.n_kv_heads} must be a multiple of "
         f"dist.tp {tp} (a tp rank holds whole KV groups; replicated KV heads are not supported)"),
        (dec.ffn_dim % tp == 0, f"model.decoder.ffn_dim: {dec.ffn_dim} must be a multiple of dist.tp {tp}"),
        (dec.moe is None or (dec.moe.n_shared * dec.moe.expert_dim) % tp == 0,
         f"model.decoder.moe.expert_dim: the shared expert's width must be a multiple of dist.tp {tp}"),
        (cfg.data.seq_len % (dims.cp * tp) == 0,
         f"data.seq_len: {cfg.data.seq_len} must be a multiple of dist.cp x dist.tp = {dims.cp * tp}"),
        (cfg.vision.balance == "none", "vision.balance: not with dist.tp > 1 (use vision.balance: none)"),
        # as under cp: these add whole-row forwards of their own to the training step
        (not cfg.loss.token_weighting.strength,
         "loss.token_weighting: not with dist.tp > 1 (it takes whole-row forwards of its own)"),
        (not cfg.loss.contrast.weight, "loss.contrast: not with dist.tp > 1 (its copies are whole rows)"),
    ]
    for ok, message in rules:
        if not ok:
            raise UserError(message)


def apply_tp(model: MultimodalModel, dims: ParallelDims, device: torch.device, seq_len: int,
             traffic: Traffic | None = None) -> None:
    """Split every decoder layer's attention and SwiGLU (dense FFN, shared expert) over tp, before
    FSDP wraps the layers. The caller runs the decoder under `row_shard` (sequence parallelism)."""
    apply_tp_layers(list(model.decoder.layers), dims, device, seq_len, traffic)


def apply_tp_layers(layers: list[nn.Module], dims: ParallelDims, device: torch.device, seq_len: int,
                 traffic: Traffic | None = None) -> None:
    """`apply_tp` on some decoder layers: a pipeline stage's (mmtrain/parallel/pipeline_model.py)."""
    from mmtrain.parallel.context_parallel import CPComm

    comm = TPComm(dims.tp_mesh(device.type).get_group(), traffic)
    # under cp too: the attention's tp-gathered tokens are this rank's cp chunk of every row
    cp = ContextShard(CPComm(dims.cp_mesh(device.type)["cp"].get_group(), traffic), seq_len) \
        if dims.cp > 1 else None
    for layer in layers:
        _split_attention(layer.attn, comm, cp)
        ffns = [layer.ffn.shared] if isinstance(layer.ffn, MoE) else [layer.ffn]
        for ffn in ffns:
            if ffn is not None:
                _split_swiglu(ffn, comm)
