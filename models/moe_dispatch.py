"""Dropless expert computation: every routed (token, expert) pair is computed, none dropped.

Three paths compute the same function y_T = sum_k w_TK * expert_{idx_TK}(x_T):
- `grouped_mm`: sort the T*K rows by expert, one `torch._grouped_mm` per projection (no
  padding, no host sync). Used where the runtime supports it (probed once per device/dtype);
  compiled fp32 steps call it through an opaque custom op (`grouped_mm_op`).
- `batched`: sort, scatter into a zero-padded (E, C, D) buffer (C = the largest expert load,
  one host sync), `torch.bmm`, gather back. Works everywhere.
- `loop`: the reference; a Python loop over experts on the unsorted tokens.

Tokens with `real_T` False (padding) are not routed: their rows go to a virtual expert E (sorted
last, not counted), enter as zeros and leave as zeros; only grouped_mm runs those zero rows
(with the last expert: no host sync to cut them off), the other paths skip them.

Legend: T tokens, K top_k, R = T*K routed rows, E experts, D model dim, F expert hidden dim,
C padded rows per expert.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .ffn import swiglu

Tensor = torch.Tensor
DISPATCH_PATHS = ("grouped_mm", "batched", "loop")


@torch.compiler.assume_constant_result  # torch.compile: a constant, evaluated, never traced
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    return _grouped_mm_probe(device_type, dtype)


@functools.cache
def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> bool:
    """Does `torch._grouped_mm` run forward and backward here? Tried once on tiny tensors.

    Pure in its arguments (the answer is a property of the build and the device), hence cached.
    Empty groups and unaligned offsets are part of the probe, as real routing produces both.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast(device_type, enabled=False):
            dev = torch.device(device_type)
            a_RD = torch.randn(7, 16, device=dev, dtype=dtype, requires_grad=True)
            b_EDF = torch.randn(3, 16, 32, device=dev, dtype=dtype, requires_grad=True)
            offs_E = torch.tensor([3, 3, 7], device=dev, dtype=torch.int32)
            out_RF = torch._grouped_mm(a_RD, b_EDF, offs=offs_E)
            ref_RF = torch.cat([a_RD[:3] @ b_EDF[0], a_RD[3:] @ b_EDF[2]])
            out_RF.backward(torch.ones_like(out_RF))
            ok = a_RD.grad is not None and b_EDF.grad is not None
            return bool(ok and torch.allclose(out_RF.float(), ref_RF.float(), atol=1e-1, rtol=1e-2))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


@torch.library.custom_op("mmtrain::grouped_mm", mutates_args=())
def grouped_mm_op(x_RD: Tensor, w_EDF: Tensor, offs_E: Tensor) -> Tensor:
    """`torch._grouped_mm` as an opaque op: under torch.compile its shape rule takes bf16 only, while
    eager CPU runs fp32 too; the op keeps the sync-free grouped path for fp32 compiled steps."""
    return torch._grouped_mm(x_RD, w_EDF, offs=offs_E).contiguous()


@grouped_mm_op.register_fake
def _(x_RD, w_EDF, offs_E):
    return x_RD.new_empty(x_RD.shape[0], w_EDF.shape[-1])


@torch.library.custom_op("mmtrain::grouped_mm_backward", mutates_args=())
def grouped_mm_backward_op(dy_RF: Tensor, x_RD: Tensor, w_EDF: Tensor, offs_E: Tensor
                           ) -> tuple[Tensor, Tensor]:
    dx_RD = torch._grouped_mm(dy_RF, w_EDF.transpose(-1, -2), offs=offs_E)
    dw_EDF = torch._grouped_mm(x_RD.t(), dy_RF, offs=offs_E)
    return dx_RD.contiguous(), dw_EDF.contiguous()


@grouped_mm_backward_op.register_fake  # outputs contiguous (the real ones are made so)
def _(dy_RF, x_RD, w_EDF, offs_E):
    return x_RD.new_empty(x_RD.shape), w_EDF.new_empty(w_EDF.shape)


def _gmm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gmm_backward(ctx, dy_RF):
    dx_RD, dw_EDF = grouped_mm_backward_op(dy_RF.contiguous(), *ctx.saved_tensors)
    return dx_RD, dw_EDF, None


grouped_mm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when active (grouped_mm is not an autocast op)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def resolve_dispatch(dispatch: str, x: Tensor) -> str:
    if dispatch != "auto":
        return dispatch
    dtype = compute_dtype(x)
    return "grouped_mm" if grouped_mm_supported(x.device.type, dtype) else "batched"


def count(idx: Tensor, n: int) -> Tensor:
    """(n,) int64 occurrences of 0..n-1 (bincount with a static shape: compiles without a break)."""
    idx = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))


def sort_by_expert(idx_TK: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows grouped by expert: (token_R, slot_R (k index), expert_R, counts_E), stable order.
    Rows of the virtual expert n_experts (padding) come last and are not in counts_E."""
    K = idx_TK.shape[1]
    order_R = torch.argsort(idx_TK.reshape(-1), stable=True)
    counts_E = count(idx_TK, n_experts + 1)[:n_experts]
    return order_R // K, order_R % K, idx_TK.reshape(-1)[order_R], counts_E


def _experts_grouped(x_RD: Tensor, counts_E: Tensor, w_in_EDF2: Tensor, w_out_EFD: Tensor) -> Tensor:
    # The last group runs to the end: virtual-expert (padding) rows, zeroed by the caller, ride
    # along with the last expert. Rows past the last offset would be left uninitialised, and
    # CPU grouped_mm's backward was seen to turn them into NaN weight gradients.
    offs_E = counts_E.cumsum(0).to(torch.int32)
    offs_E[-1] = x_RD.shape[0]
    # compiled fp32: the opaque op (the compiler's grouped_mm shape rule accepts bf16 only)
    gmm = grouped_mm_op if torch.compiler.is_compiling() and x_RD.dtype != torch.bfloat16 else _gmm
    h_RF2 = gmm(x_RD, w_in_EDF2, offs_E)
    return gmm(swiglu(h_RF2).contiguous(), w_out_EFD, offs_E)


def _gmm(x_RD: Tensor, w_EDF: Tensor, offs_E: Tensor) -> Tensor:
    return torch._grouped_mm(x_RD, w_EDF, offs=offs_E)


def _experts_batched(x_RD: Tensor, expert_R: Tensor, counts_E: Tensor, w_in_EDF2: Tensor,
                     w_out_EFD: Tensor) -> Tensor:
    E, R, D = counts_E.shape[0], x_RD.shape[0], x_RD.shape[1]
    C = max(int(counts_E.max()), 1) if R else 1  # host sync: the padded width
    start_E = F.pad(counts_E.cumsum(0), (1, 0))
    dest_R = expert_R * C + torch.arange(R, device=x_RD.device) - start_E[expert_R]
    dest_R = torch.where(expert_R < E, dest_R, E * C)  # virtual-expert rows: one spare slot
    buf_ECD = x_RD.new_zeros(E * C + 1, D).index_copy(0, dest_R, x_RD)[:-1].view(E, C, D)
    h_ECF = swiglu(torch.bmm(buf_ECD, w_in_EDF2))  # padding rows stay exactly 0
    y_ECD = torch.bmm(h_ECF, w_out_EFD)
    return F.pad(y_ECD.reshape(E * C, D), (0, 0, 0, 1))[dest_R]


def experts_sorted(x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor, w_in_EDF2: Tensor, w_out_EFD: Tensor,
                   path: str) -> Tensor:
    """The fast paths: sort by expert, run all experts at once, weight and scatter-add back."""
    dt, E = compute_dtype(x_TD), w_in_EDF2.shape[0]
    token_R, slot_R, expert_R, counts_E = sort_by_expert(idx_TK, E)
    routed_R1 = (expert_R < E)[:, None]
    # index_select, not advanced indexing: its backward is an index_add, where x[idx]'s is an
    # index_put with accumulate (several times slower on CPU)
    x_RD = torch.where(routed_R1, x_TD.to(dt).index_select(0, token_R), 0)
    w_in, w_out = w_in_EDF2.to(dt), w_out_EFD.to(dt)
    if path == "grouped_mm":
        y_RD = _experts_grouped(x_RD, counts_E, w_in, w_out)
    elif path == "batched":
        y_RD = _experts_batched(x_RD, expert_R, counts_E, w_in, w_out)
    else:
        raise ValueError(f"dispatch: must be one of {DISPATCH_PATHS} (got {path!r})")
    w_R1 = w_TK.reshape(-1).index_select(0, token_R * w_TK.shape[1] + slot_R)[:, None]
    y_RD = torch.where(routed_R1, y_RD * w_R1.to(y_RD.dtype), 0)
    return torch.zeros_like(x_TD).index_add(0, token_R, y_RD.to(x_TD.dtype))  # sum the K rows


def experts_loop(x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor, w_in_EDF2: Tensor,
                 w_out_EFD: Tensor) -> Tensor:
    """Reference: one expert at a time on the tokens that chose it (no sorting, no padding)."""
    tokens, outs = [], []
    for e in range(w_in_EDF2.shape[0]):
        token_R, slot_R = torch.nonzero(idx_TK == e, as_tuple=True)
        if token_R.numel() == 0:
            continue
        h_RF = swiglu(x_TD[token_R] @ w_in_EDF2[e])
        outs.append((h_RF @ w_out_EFD[e]) * w_TK[token_R, slot_R, None])
        tokens.append(token_R)
    if not outs:
        return torch.zeros_like(x_TD)
    return torch.zeros_like(x_TD).index_add(0, torch.cat(tokens), torch.cat(outs).to(x_TD.dtype))


def run_experts(x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor, w_in_EDF2: Tensor, w_out_EFD: Tensor,
                dispatch: str, real_T: Tensor | None = None) -> Tensor:
    """sum_k w_TK * expert_{idx_TK}(x_T) for real tokens; 0 for the others (real_T False)."""
    if real_T is not None:
        idx_TK = torch.where(real_T[:, None], idx_TK, w_in_EDF2.shape[0])
    path = resolve_dispatch(dispatch, x_TD)
    if path == "loop":
        return experts_loop(x_TD, idx_TK, w_TK, w_in_EDF2, w_out_EFD)
    return experts_sorted(x_TD, idx_TK, w_TK, w_in_EDF2, w_out_EFD, path)
