"""The routed experts: stacked SwiGLU weights and the registry of paths that run them.

Every path computes the same function on rows already grouped by expert (the dispatcher's job):
rows [start_e, start_e + counts_E[e]) go through expert e; rows past sum(counts_E) are zero padding
and leave as zeros. A path is an entry of `EXPERT_PATHS` that states what it supports; `auto` takes
the first entry, in registry order, that is an auto candidate and runs here.
- `grouped_mm`: one `torch._grouped_mm` per projection on groups padded to the dtype's alignment
  (grouped_mm.aligned_layout; no host sync).
- `batched`: scatter into a zero-padded (E, C, D) buffer (C = the largest load, one host sync), bmm.
- `loop`: one matmul per expert on its slice; the reference of the other two on sorted rows.
`experts_reference` is the reference of the whole MoE step: no sorting at all.

Legend: R rows grouped by expert, E experts (local ones under expert parallelism), D model dim,
F expert hidden dim, C padded rows per expert, T tokens, K top_k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ffn import swiglu
from .grouped_mm import aligned_layout, group_align, grouped_mm_op, grouped_mm_supported, strides_aligned

Tensor = torch.Tensor


@dataclass(frozen=True)
class ExpertPath:
    name: str
    run: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (x_RD, counts_E, w_in, w_out) -> y_RD
    supported: Callable[[str, torch.dtype], bool]  # (device type, compute dtype) -> runs here
    host_sync: bool  # reads the loads on the host (a graph break under torch.compile)
    auto: bool  # a candidate of `dispatch: auto`, tried in registry order
    fits: Callable[[torch.dtype, int, int], bool] = lambda dtype, D, F: True  # (dtype, D, F) -> shapes run


EXPERT_PATHS: dict[str, ExpertPath] = {}


def register_expert_path(path: ExpertPath) -> ExpertPath:
    if path.name in EXPERT_PATHS or path.name == "auto":
        raise ValueError(f"expert path {path.name!r} is already registered")
    EXPERT_PATHS[path.name] = path
    return path


def compute_dtype(x: Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when active (grouped_mm is not an autocast op)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def resolve_path(name: str, x: Tensor, hidden: int | None = None) -> ExpertPath:
    """The named path, or auto's pick for x's device and compute dtype (and the shapes D = x's last
    dim and F = hidden, when given)."""
    if name != "auto":
        return EXPERT_PATHS[name]
    dev, dtype, D = x.device.type, compute_dtype(x), x.shape[-1]
    return next(p for p in EXPERT_PATHS.values() if p.auto and p.supported(dev, dtype)
                and (hidden is None or p.fits(dtype, D, hidden)))


def _grouped(x_RD: Tensor, counts_E: Tensor, w_in_EDF2: Tensor, w_out_EFD: Tensor) -> Tensor:
    # Each group padded to the dtype's alignment (an unaligned group can kill a Hopper process);
    # the padding rows are zeros and come back as zeros (swiglu(0) = 0), so they add no gradient.
    dest_R, offs_E, L = aligned_layout(counts_E, x_RD.shape[0], group_align(x_RD.dtype))
    x_LD = x_RD.new_zeros(L, x_RD.shape[1]).index_copy(0, dest_R, x_RD)
    # compiled fp32: the opaque op (the compiler's grouped_mm shape rule accepts bf16 only)
    gmm = grouped_mm_op if torch.compiler.is_compiling() and x_RD.dtype != torch.bfloat16 else _gmm
    h_LF2 = gmm(x_LD, w_in_EDF2, offs_E)
    return gmm(swiglu(h_LF2).contiguous(), w_out_EFD, offs_E)[dest_R]


def _gmm(x_RD: Tensor, w_EDF: Tensor, offs_E: Tensor) -> Tensor:
    return torch._grouped_mm(x_RD, w_EDF, offs=offs_E)


def _batched(x_RD: Tensor, counts_E: Tensor, w_in_EDF2: Tensor, w_out_EFD: Tensor) -> Tensor:
    E, R, D = counts_E.shape[0], x_RD.shape[0], x_RD.shape[1]
    C = max(int(counts_E.max()), 1) if R else 1  # host sync: the padded width
    end_E = counts_E.cumsum(0)
    rows_R = torch.arange(R, device=x_RD.device)
    expert_R = torch.bucketize(rows_R, end_E, right=True)  # E for the padding rows
    start_R = F.pad(end_E, (1, 0))[expert_R.clamp_max(E - 1)]
    dest_R = torch.where(expert_R < E, expert_R * C + rows_R - start_R, E * C)  # padding: a spare slot
    buf_ECD = x_RD.new_zeros(E * C + 1, D).index_copy(0, dest_R, x_RD)[:-1].view(E, C, D)
    h_ECF = swiglu(torch.bmm(buf_ECD, w_in_EDF2))  # padding rows stay exactly 0
    y_ECD = torch.bmm(h_ECF, w_out_EFD)
    return F.pad(y_ECD.reshape(E * C, D), (0, 0, 0, 1))[dest_R]


def _loop(x_RD: Tensor, counts_E: Tensor, w_in_EDF2: Tensor, w_out_EFD: Tensor) -> Tensor:
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):  # host sync: the slice bounds
        outs.append(swiglu(x_RD[start:start + n] @ w_in_EDF2[e]) @ w_out_EFD[e])
        start += n
    outs.append(x_RD.new_zeros(x_RD.shape[0] - start, w_out_EFD.shape[-1]))  # padding rows
    return torch.cat(outs)


register_expert_path(ExpertPath("grouped_mm", _grouped, grouped_mm_supported, host_sync=False, auto=True,
                                fits=strides_aligned))
register_expert_path(ExpertPath("batched", _batched, lambda dev, dtype: True, host_sync=True, auto=True))
register_expert_path(ExpertPath("loop", _loop, lambda dev, dtype: True, host_sync=True, auto=False))


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (experts sharded over an expert-parallel mesh), else t.
    isinstance, not hasattr: Dynamo traces the check on a DTensor parameter as false for hasattr,
    and the compiled graph then hands the DTensor to the grouped_mm op."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Experts(nn.Module):
    """E routed SwiGLU experts; gate | up halves stacked in w_in. Under expert parallelism the
    parameters are DTensors sharded on dim 0 and this module runs this rank's experts only."""

    def __init__(self, n_experts: int, dim: int, hidden: int, path: str = "auto") -> None:
        super().__init__()
        self.path = path
        self.w_in_EDF2 = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.w_out_EFD = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.w_in_EDF2, std=std)
        nn.init.normal_(self.w_out_EFD, std=out_std or std)

    def forward(self, x_RD: Tensor, counts_E: Tensor) -> Tensor:
        w_in, w_out = local_tensor(self.w_in_EDF2), local_tensor(self.w_out_EFD)
        dt = compute_dtype(x_RD)
        # no rows (an expert-parallel rank nobody sent to): batched still yields zero weight
        # gradients, so every rank's FSDP reduces the same parameters
        path = resolve_path(self.path, x_RD, w_out.shape[1]) if x_RD.shape[0] else EXPERT_PATHS["batched"]
        return path.run(x_RD.to(dt), counts_E, w_in.to(dt), w_out.to(dt))


def experts_reference(x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor, w_in_EDF2: Tensor,
                      w_out_EFD: Tensor) -> Tensor:
    """sum_k w_TK * expert_{idx_TK}(x_T), one expert at a time on the tokens that chose it (no
    sorting, no padding; idx = E means not routed). The reference for dispatch + experts."""
    out_TD = torch.zeros_like(x_TD)
    for e in range(w_in_EDF2.shape[0]):
        token_R, slot_R = torch.nonzero(idx_TK == e, as_tuple=True)
        h_RF = swiglu(x_TD[token_R] @ w_in_EDF2[e])
        y_RD = (h_RF @ w_out_EFD[e]) * w_TK[token_R, slot_R, None]
        out_TD = out_TD.index_add(0, token_R, y_RD.to(x_TD.dtype))
    return out_TD
