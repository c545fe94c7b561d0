"""Rotary embeddings: M-RoPE reduces to 1-D RoPE on text, preserves norms, is relative.

Legend: A axes, S tokens, D head dim, F pairs.
"""

from __future__ import annotations

import torch

from mmtrain.models.rope import (
    apply_rotary,
    axial_angles,
    inv_freq,
    mrope_freqs,
    vision_freqs,
    vision_sections,
)

D, SECTIONS, THETA = 32, (4, 6, 6), 10000.0


def _rotate(x_SD: torch.Tensor, pos_AS: torch.Tensor, freqs: list[torch.Tensor]) -> torch.Tensor:
    angles_SF = axial_angles(pos_AS, freqs)
    return apply_rotary(x_SD, angles_SF.cos(), angles_SF.sin())


def _rope_1d(x_SD: torch.Tensor, pos_S: torch.Tensor) -> torch.Tensor:
    """Textbook rotate-half RoPE, written independently."""
    f_F = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang_SD = torch.cat([pos_S[:, None] * f_F] * 2, dim=-1)
    x1, x2 = x_SD[:, : D // 2], x_SD[:, D // 2:]
    return x_SD * ang_SD.cos() + torch.cat([-x2, x1], dim=-1) * ang_SD.sin()


def test_text_positions_reduce_to_1d_rope() -> None:
    pos_S = torch.randint(0, 5000, (12,))
    x_SD = torch.randn(12, D)
    out = _rotate(x_SD, pos_S.expand(3, -1), mrope_freqs(D, SECTIONS, THETA))
    torch.testing.assert_close(out, _rope_1d(x_SD, pos_S.float()), atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.cat(mrope_freqs(D, SECTIONS, THETA)), inv_freq(D // 2, THETA))


def test_rotation_preserves_norms() -> None:
    x_SD = torch.randn(20, D)
    for pos_AS, freqs in ((torch.randint(0, 100, (3, 20)), mrope_freqs(D, SECTIONS, THETA)),
                          (torch.randint(0, 100, (3, 20)), vision_freqs(D, THETA))):
        out = _rotate(x_SD, pos_AS, freqs)
        torch.testing.assert_close(out.norm(dim=-1), x_SD.norm(dim=-1))


def test_scores_depend_only_on_relative_position() -> None:
    q_D, k_D = torch.randn(1, D), torch.randn(1, D)
    for freqs in (mrope_freqs(D, SECTIONS, THETA), vision_freqs(D, THETA)):
        pq, pk = torch.randint(0, 50, (3, 1)), torch.randint(0, 50, (3, 1))
        shift = torch.randint(0, 500, (3, 1))  # the same shift on every axis for both
        s0 = (_rotate(q_D, pq, freqs) * _rotate(k_D, pk, freqs)).sum()
        s1 = (_rotate(q_D, pq + shift, freqs) * _rotate(k_D, pk + shift, freqs)).sum()
        torch.testing.assert_close(s0, s1, atol=1e-3, rtol=1e-4)
        s2 = (_rotate(q_D, pq + 1, freqs) * _rotate(k_D, pk, freqs)).sum()
        assert not torch.allclose(s0, s2)  # and the relative position is seen


def test_vision_sections_cover_the_head() -> None:
    for head_dim in (8, 16, 32, 64, 72, 128):
        t, h, w = vision_sections(head_dim)
        assert t + h + w == head_dim // 2 and h == w and t >= 1
    # an image (t = 0) is rotated by (h, w) only: 2-D RoPE inside a frame
    x_SD = torch.randn(5, D)
    hw_2S = torch.randint(0, 9, (2, 5))
    pos_AS = torch.cat([torch.zeros(1, 5, dtype=torch.long), hw_2S])
    t = vision_sections(D)[0]
    out = _rotate(x_SD, pos_AS, vision_freqs(D, THETA))
    torch.testing.assert_close(out[:, :t], x_SD[:, :t])
    torch.testing.assert_close(out[:, D // 2: D // 2 + t], x_SD[:, D // 2: D // 2 + t])
