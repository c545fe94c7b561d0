"""grouped_mm on groups padded to the dtype's alignment: the layout's invariants, the padded path
against the per-expert loop (outputs and gradients, empty experts, trailing padding rows), and
that neither the path nor the probe ever hands `torch._grouped_mm` an unaligned offset.

Legend: R rows sorted by expert, E experts, D dim, L padded rows.
"""

from __future__ import annotations

import pytest
import torch

from mmtrain.models.moe import grouped_mm as gm
from mmtrain.models.moe.experts import EXPERT_PATHS

# not the probe: a broken layout must fail these tests, not skip them
pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")


def random_counts(gen: torch.Generator, E: int) -> tuple[torch.Tensor, int]:
    """Loads with some empty experts, and R past their sum (the dispatcher's zero padding)."""
    counts_E = torch.randint(0, 12, (E,), generator=gen) * (torch.rand(E, generator=gen) > 0.3)
    return counts_E, int(counts_E.sum()) + int(torch.randint(0, 5, (1,), generator=gen))


def spy_offsets(monkeypatch) -> list[torch.Tensor]:
    """Every offsets tensor handed to torch._grouped_mm from now on."""
    seen, real = [], torch._grouped_mm

    def spy(a, b, offs):
        seen.append(offs.clone())
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return seen


@pytest.mark.parametrize("align", [8, 16])
def test_layout_puts_every_row_in_its_experts_aligned_group(align: int) -> None:
    gen = torch.Generator().manual_seed(align)
    for _ in range(20):
        counts_E, R = random_counts(gen, 6)
        dest_R, offs_E, L = gm.aligned_layout(counts_E, R, align)
        assert (offs_E % align == 0).all() and offs_E[-1] == L and L % align == 0
        assert (offs_E.diff() >= align).all() and offs_E[0] >= align  # no group is empty
        assert dest_R.unique().numel() == R and dest_R.min() >= 0 and dest_R.max() < L
        group_R = torch.bucketize(dest_R, offs_E.long(), right=True)
        expert_R = torch.repeat_interleave(torch.arange(6), counts_E)
        want_R = torch.cat([expert_R, torch.full((R - expert_R.numel(),), 5)])  # padding: the last
        assert torch.equal(group_R, want_R)
        assert (dest_R.diff() > 0).all()  # order kept within and across groups


@pytest.mark.parametrize("dtype, align", [(torch.float32, 8), (torch.float32, 16), (torch.bfloat16, None)])
def test_padded_grouped_mm_matches_the_loop_forward_and_backward(dtype, align, monkeypatch) -> None:
    if align is not None:  # fp32 under fp8's alignment too; bf16 under its own (the production one)
        monkeypatch.setitem(gm.GROUP_ALIGN_ROWS, dtype, align)
    align, tol = gm.group_align(dtype), 1e-4 if dtype == torch.float32 else 3e-2
    seen = spy_offsets(monkeypatch)
    gen = torch.Generator().manual_seed(100 + align)
    E, D, F = 5, 16, 24  # row strides of 16 bytes (strides_aligned) in bf16
    for _ in range(4):
        counts_E, R = random_counts(gen, E)
        x_RD = torch.randn(R, D, generator=gen)
        x_RD[int(counts_E.sum()):] = 0  # the dispatcher's padding rows are zeros
        w_in = torch.randn(E, D, 2 * F, generator=gen)
        w_out = torch.randn(E, F, D, generator=gen)
        g_RD = torch.randn(R, D, generator=gen)
        grads = []
        for name in ("grouped_mm", "loop"):
            leaves = [t.to(dtype).requires_grad_(True) for t in (x_RD, w_in, w_out)]
            y_RD = EXPERT_PATHS[name].run(leaves[0], counts_E, leaves[1], leaves[2])
            (y_RD * g_RD).sum().backward()
            grads.append([y_RD.detach()] + [t.grad for t in leaves])
        for got, want in zip(*grads):
            torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max(), rtol=tol)
    assert seen and all((o % align == 0).all() for o in seen)


def test_probe_accepts_the_padded_layout_and_sends_only_aligned_offsets(monkeypatch) -> None:
    seen = spy_offsets(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        ok = gm._grouped_mm_probe.__wrapped__("cpu", dtype)
        assert ok or dtype != torch.float32  # this CPU build runs fp32 grouped_mm
    assert seen and all((o % gm.group_align(torch.bfloat16) == 0).all() for o in seen)


def test_auto_leaves_grouped_mm_when_a_row_stride_is_not_16_bytes() -> None:
    """bf16 F = 12: 24-byte rows, which grouped_mm refuses mid-step; auto takes batched instead."""
    from mmtrain.models.moe.experts import Experts, resolve_path

    x_RD = torch.randn(9, 16, dtype=torch.bfloat16)
    assert resolve_path("auto", x_RD, 16).name == "grouped_mm"
    assert resolve_path("auto", x_RD, 12).name == "batched"
    experts = Experts(4, 16, 12)
    experts.reset_parameters()
    counts_E = torch.tensor([3, 0, 4, 2])
    y_RD = experts(x_RD, counts_E)  # runs (grouped_mm would raise here)
    w_in, w_out = experts.w_in_EDF2.bfloat16(), experts.w_out_EFD.bfloat16()
    torch.testing.assert_close(y_RD, EXPERT_PATHS["loop"].run(x_RD, counts_E, w_in, w_out))
