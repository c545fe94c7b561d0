"""`torch._grouped_mm`: whether this runtime runs it (probed once per device and dtype), and an
opaque custom op for compiled fp32 steps (the compiler's shape rule accepts bf16 only).

Legend: R rows sorted by expert, E experts, D in features, F out features.
"""

from __future__ import annotations

import functools

import torch

Tensor = torch.Tensor


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
