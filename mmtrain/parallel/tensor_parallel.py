"""Tensor parallelism with sequence parallelism over the `tp` mesh dim (mmtrain/parallel/dims.py),
on torch's DTensor styles, applied to the decoder layers from outside the model files.

Weights (torchtitan's composition): every decoder layer's attention `wqkv` and SwiGLU `w_in` (the
dense FFN and the MoE's shared expert) are `ColwiseParallel` (Shard(0) over tp), `wo` and `w_out`
`RowwiseParallel` (Shard(1)), through `parallelize_module`; FSDP2 then shards each layer over the dp
dims only (parallelize.shard_blocks), so a rank holds and gathers 1/tp of these weights and tp never
gathers them. The fused layouts give whole heads and units to a contiguous Shard(0): wqkv's rows are
grouped by KV head (models/self_attention.py), w_in interleaves gate and up per unit (models/ffn.py),
and tp must divide n_kv_heads, so a rank holds whole GQA groups and a sparse layer's selection, per
head or per group, is exactly the single process's.

Activations: between the matmuls a tp rank holds a contiguous chunk of every row (sequence
parallelism): the decoder runs under the same `ContextShard` as context parallelism, over the
(cp, tp) ranks, so norms, residuals, the MoE router and routed experts (each tp rank routes its own
tokens: the same tokens, in the same rows, at any tp), the LM head and the loss see this rank's
tokens only. Around the matmuls (Megatron's pattern; DTensor redistributions):

    attention  x (B, s, D) Shard(1) -all-gather-> Replicate (B, S', D) -> this rank's heads
               -> wo: Partial (B, S', D) -reduce-scatter-> Shard(1) (B, s, D)    (S' = s * tp)
    SwiGLU     x (T, D) Shard(0) -all-gather-> (tp T, D) -> this rank's units -> reduce-scatter

Backward: the all-gather's gradient arrives Partial and leaves by a reduce-scatter, the
reduce-scatter's by an all-gather. The rotary tables of the tp group's tokens are computed by every
rank (the decoder's `ContextShard.rotary_local`): no collective. Evaluation forwards take whole rows
on every tp rank (`context` None): a split layer then enters Replicate and leaves by an all-reduce.

What takes no DTensor style: the layer's norms (attention, FFN, QK), the MoE router and the routed
experts run plain tensors on this rank's tokens (the router's top-k and bias buffers, the experts'
grouped GEMMs), so their parameters are not tp DTensors: FSDP2 shards them over dp x tp as one unit
per layer (parallelize.shard_blocks), which sums their per-tp-rank gradients. Their bytes are the
norms' D-vectors and the router's (E, D): TP's saving is the four matmul weights.

The vision encoder is replicated over tp (every rank of a (cp, tp) group encodes the rows' media,
as under CP; `vision.balance: dp_cp` encodes each medium once in the world instead), FSDP-sharded
over dp x tp with the embeddings and the head.

Legend: B rows, s this rank's tokens of a row, S' the tp group's, D model dim, T tokens, P ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mmtrain.errors import UserError
from mmtrain.models.attention.context import ContextShard
from mmtrain.models.moe import MoE
from mmtrain.parallel.comm import Traffic

if TYPE_CHECKING:
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.models.self_attention import SelfAttention
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.run_config import RunConfig

Tensor = torch.Tensor
COLWISE = ColwiseParallel(use_local_output=True)  # input: a Replicate DTensor (TPComm.enter)
ROWWISE = RowwiseParallel(output_layouts=Partial(), use_local_output=False)  # out: TPComm.leave


class TPComm:
    """The tp group's activation redistributions (every rank calls each in the same order).

    `whole`: the layer's input is whole rows, the same on every tp rank (evaluation and diagnostics
    forwards run without the row shard): a split layer enters Replicate and leaves by an all-reduce.
    Set by each layer's attention from its `context`, read by the same layer's FFN."""

    def __init__(self, mesh, traffic: Traffic | None = None) -> None:
        self.mesh, self.traffic = mesh, traffic
        self.size = mesh.size()
        self.whole = False

    def count(self, kind: str, x: Tensor) -> int:
        """Bytes this rank sends for a collective whose per-rank piece is `x` (ring algorithms)."""
        nbytes = x.numel() * x.element_size() * (self.size - 1)
        self.add(kind, nbytes)
        return nbytes

    def add(self, kind: str, nbytes: int) -> None:
        if self.traffic is not None:
            self.traffic.add(kind, nbytes)

    def count_backward(self, y: Tensor, kind: str, nbytes: int) -> None:
        """Count `nbytes` under `kind` when `y`'s gradient arrives (the collective backward runs). The
        hook holds the int only: a tensor in it would live until backward (activation checkpointing
        would keep every layer's)."""
        if y.requires_grad and self.traffic is not None:
            y.register_hook(lambda g: self.add(kind, nbytes))

    @torch._dynamo.disable  # a graph break: Dynamo cannot trace from_local on dynamic shapes
    def enter(self, x: Tensor, dim: int) -> DTensor:
        """Into a split layer: this rank's chunk all-gathered along `dim` (Replicate), or whole rows."""
        if self.whole:
            return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        nbytes = self.count("tp_all_gather", x)
        full = DTensor.from_local(x, self.mesh, [Shard(dim)], run_check=False).redistribute(
            self.mesh, [Replicate()])
        self.count_backward(full, "tp_reduce_scatter", nbytes)  # the same bytes, reduce-scattered
        return full

    @torch._dynamo.disable  # a graph break: Dynamo cannot trace from_local on dynamic shapes
    def leave(self, y: DTensor, dim: int) -> Tensor:
        """Out of a split layer: the ranks' partial sums reduce-scattered along `dim` (or all-reduced)."""
        if self.whole:
            self.count("tp_all_reduce", y.to_local())
            return y.redistribute(self.mesh, [Replicate()]).to_local()
        out = y.redistribute(self.mesh, [Shard(dim)]).to_local()
        self.count_backward(out, "tp_all_gather", self.count("tp_reduce_scatter", out))
        return out

    @torch._dynamo.disable  # a graph break: Dynamo cannot trace from_local on dynamic shapes
    def gather_rotary(self, c_B1sF: Tensor) -> Tensor:
        """The tp group's rotary tables from each rank's chunk (no gradient): for a caller that did not
        compute them for the group (`ContextShard.rotary_local` does, with no collective)."""
        self.count("tp_rotary_all_gather", c_B1sF)
        return DTensor.from_local(c_B1sF, self.mesh, [Shard(2)], run_check=False).full_tensor()

    @torch._dynamo.disable  # a graph break: Dynamo cannot trace from_local on dynamic shapes
    def gather_heads(self, x_BhSE: Tensor) -> Tensor:
        """Every head's q or k (measured forwards: whole rows, no gradient)."""
        self.count("tp_qk_all_gather", x_BhSE)
        return DTensor.from_local(x_BhSE, self.mesh, [Shard(1)], run_check=False).full_tensor()


def _split_attention(attn: SelfAttention, comm: TPComm, cp: ContextShard | None) -> None:
    """This rank's whole KV groups: its rows of the grouped wqkv, its columns of wo."""
    parallelize_module(attn, comm.mesh, {"wqkv": COLWISE, "wo": ROWWISE}, src_data_rank=None)
    attn.n_heads, attn.n_kv_heads = attn.n_heads // comm.size, attn.n_kv_heads // comm.size
    inner = attn.forward

    def forward(x_BsD, cos_B1SF, sin_B1SF, meta, cfg, sparse=False, capture=None, stats=None,
                context=None, return_qk=False):
        if capture is not None or stats is not None:  # (the decoder measures from return_qk)
            raise ValueError("attend: capture and stats need all heads (run without dist.tp)")
        comm.whole = context is None  # whole rows (evaluation): no chunk to gather, no cp split
        x_BSD = comm.enter(x_BsD, 1)
        if cos_B1SF.shape[2] != x_BSD.shape[1]:  # a caller that computed only its own chunk's tables
            cos_B1SF, sin_B1SF = comm.gather_rotary(cos_B1SF), comm.gather_rotary(sin_B1SF)
        out = inner(x_BSD, cos_B1SF, sin_B1SF, meta, cfg, sparse=sparse,
                    context=None if comm.whole else cp, return_qk=return_qk)
        if not return_qk:
            return comm.leave(out, 1)
        # measured (whole rows only: the decoder refuses it under a row shard): every head's q, k
        return comm.leave(out[0], 1), comm.gather_heads(out[1]), comm.gather_heads(out[2])

    attn.forward = forward


def _split_swiglu(ffn: nn.Module, comm: TPComm) -> None:
    """This rank's hidden units: its rows of the interleaved w_in, its columns of w_out."""
    parallelize_module(ffn, comm.mesh, {"w_in": COLWISE, "w_out": ROWWISE}, src_data_rank=None)
    inner = ffn.forward

    def forward(x_TD: Tensor) -> Tensor:
        return comm.leave(inner(comm.enter(x_TD, 0)), 0)

    ffn.forward = forward


def replicated_parts(layer: nn.Module) -> tuple[list[nn.Module], nn.Module | None] | None:
    """A split decoder layer's modules whose parameters are not tp DTensors: (the small ones: norms,
    router; the routed experts unless already sharded over ep). FSDP2 shards them over dp x tp.
    None: not a split layer."""
    if not isinstance(getattr(getattr(getattr(layer, "attn", None), "wqkv", None), "weight", None), DTensor):
        return None
    attn, ffn = layer.attn, layer.ffn
    small = [layer.attn_norm, layer.ffn_norm, attn.q_norm, attn.k_norm]
    experts = None
    if isinstance(ffn, MoE):
        small.append(ffn.router)
        experts = None if isinstance(ffn.experts.w_in_EDF2, DTensor) else ffn.experts  # over ep already
    return [p for p in small if p is not None], experts


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

    comm = TPComm(dims.tp_mesh(device.type), traffic)
    # under cp too: the attention's tp-gathered tokens are this rank's cp chunk of every row
    cp = ContextShard(CPComm(dims.cp_mesh(device.type)["cp"].get_group(), traffic), seq_len) \
        if dims.cp > 1 else None
    for layer in layers:
        _split_attention(layer.attn, comm, cp)
        ffns = [layer.ffn.shared] if isinstance(layer.ffn, MoE) else [layer.ffn]
        for ffn in ffns:
            if ffn is not None:
                _split_swiglu(ffn, comm)
