"""`torch._grouped_mm`: the aligned group layout it is fed, whether this runtime runs it (probed
once per device and dtype), and an opaque custom op for compiled fp32 steps (the compiler's shape
rule accepts bf16 only).

Hopper's grouped GEMMs want every group to start on a 16-byte row boundary: 8 rows in bf16, 16 in
fp8. The offsets live on the device, so the kernel can only check them there: an unaligned group
has been seen to raise a device-side assert, which kills the process. `aligned_layout` pads each
group up to the alignment (torchtitan pads the same way: `TOKEN_GROUP_ALIGN_SIZE_M`), with static
shapes and no host sync.

Legend: R rows sorted by expert, E experts, D in features, F out features, L padded rows.
"""

from __future__ import annotations

import functools

import torch

Tensor = torch.Tensor

# rows per group boundary: 16 bytes of the compute dtype (fp32 and others: 8, a harmless over-pad)
GROUP_ALIGN_ROWS: dict[torch.dtype, int] = {
    torch.bfloat16: 8, torch.float16: 8, torch.float8_e4m3fn: 16, torch.float8_e5m2: 16,
}


def group_align(dtype: torch.dtype) -> int:
    return GROUP_ALIGN_ROWS.get(dtype, 8)


def strides_aligned(dtype: torch.dtype, *dims: int) -> bool:
    """grouped_mm also wants every row stride a multiple of 16 bytes: the model dim D and the expert
    dim F (checked on the host, a RuntimeError mid-step; `auto` picks another path instead)."""
    return all(d * dtype.itemsize % 16 == 0 for d in dims)


def aligned_layout(counts_E: Tensor, R: int, align: int) -> tuple[Tensor, Tensor, int]:
    """Where each of R expert-sorted rows goes in a padded buffer of L rows, and the group ends.

    Group e holds max(counts_E[e], 1) rounded up to `align` rows: an empty expert still gets one
    aligned group of zeros (no zero-size group reaches the kernel; torchtitan does the same). Rows
    past sum(counts_E) (zero padding) land right after the last group, and the last group runs to L
    so that they ride with it (the kernel leaves rows past the last offset uninitialised).
    L = round_up(R + E * align, align) bounds the padded total without reading the loads.
    Returns dest_R (unique slots in [0, L)), offs_E (int32, multiples of align) and L.
    """
    E = counts_E.shape[0]
    L = -(-(R + E * align) // align) * align
    padded_E = (counts_E.clamp_min(1) + align - 1) // align * align
    end_E, pend_E = counts_E.cumsum(0), padded_E.cumsum(0)
    rows_R = torch.arange(R, device=counts_E.device)
    expert_R = torch.bucketize(rows_R, end_E, right=True)  # E for the padding rows
    e_R = expert_R.clamp_max(E - 1)
    in_group_R = pend_E[e_R] - padded_E[e_R] + rows_R - (end_E[e_R] - counts_E[e_R])
    dest_R = torch.where(expert_R < E, in_group_R, pend_E[-1] + rows_R - end_E[-1])
    offs_E = pend_E.to(torch.int32)
    offs_E[-1] = L
    return dest_R, offs_E, L


@torch.compiler.assume_constant_result  # torch.compile: a constant, evaluated, never traced
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    return _grouped_mm_probe(device_type, dtype)


@functools.cache
def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> bool:
    """Does `torch._grouped_mm` run forward and backward here? Tried once on tiny tensors.

    Pure in its arguments (the answer is a property of the build and the device), hence cached.
    It can fail softly only: a device-side assert is not an exception, it kills the process. So
    the probe feeds exactly the layout the experts feed (`aligned_layout`: offsets checked on the
    host, up front, to be multiples of the dtype's alignment), never an unaligned group. That is
    cheaper than a subprocess per rank (a CUDA context, a torch import, each rank at startup) and
    probes this process's own runtime.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast(device_type, enabled=False):
            dev, a = torch.device(device_type), group_align(dtype)
            _, offs_E, L = aligned_layout(torch.tensor([3, 0, 4]), 7, a)  # an empty expert too
            assert (offs_E % a == 0).all(), "the probe must never send an unaligned group"
            a_LD = torch.randn(L, 16, device=dev, dtype=dtype, requires_grad=True)
            b_EDF = torch.randn(3, 16, 32, device=dev, dtype=dtype, requires_grad=True)
            out_LF = torch._grouped_mm(a_LD, b_EDF, offs=offs_E.to(dev))
            bounds = [0, *offs_E.tolist()]
            ref_LF = torch.cat([a_LD[s:t] @ b_EDF[e] for e, (s, t) in enumerate(zip(bounds, bounds[1:]))])
            out_LF.backward(torch.ones_like(out_LF))
            ok = a_LD.grad is not None and b_EDF.grad is not None
            return bool(ok and torch.allclose(out_LF.float(), ref_LF.float(), atol=1e-1, rtol=1e-2))
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
