"""Rotary position embeddings: 1-D, M-RoPE (decoder) and axial (t, h, w) RoPE (vision encoder).

The rotary frequencies of a head (F = head_dim / 2 pairs) are split into sections, one per
position axis; pair i of section a rotates by pos_a * inv_freq[i]. Pairs are laid out
"rotate-half" style: feature i pairs with feature i + F.

- M-RoPE (Qwen2-VL): one frequency ladder over all F pairs, cut into contiguous (t, h, w)
  sections. Text has t = h = w = position, so it is exactly 1-D RoPE.
- Vision: each axis gets its own full ladder over its section (an axis with few pairs still
  spans high and low frequencies); images have t = 0, so inside a frame this is 2-D RoPE.

Legend: A position axes, F rotary pairs (head_dim / 2), D head dim, B batch, S tokens,
N patches, H heads; `*` any leading shape.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def inv_freq(n_pairs: int, theta: float, device: torch.device | None = None) -> Tensor:
    """(n_pairs,) fp32 ladder theta^(-i / n_pairs): pair i of a 2 * n_pairs-dim rotary."""
    return theta ** (-torch.arange(n_pairs, dtype=torch.float32, device=device) / n_pairs)


def axial_angles(pos_A_: Tensor, freqs: list[Tensor]) -> Tensor:
    """Positions (A, *) and one frequency vector per axis -> angles (*, sum of section sizes)."""
    if pos_A_.shape[0] != len(freqs):
        raise ValueError(f"pos: {len(freqs)} axes expected (got {pos_A_.shape[0]})")
    parts = [pos_A_[a].float()[..., None] * f for a, f in enumerate(freqs) if f.numel()]
    return torch.cat(parts, dim=-1)


def mrope_freqs(head_dim: int, sections: tuple[int, ...], theta: float,
                device: torch.device | None = None) -> list[Tensor]:
    """One ladder over head_dim / 2 pairs, cut into contiguous per-axis sections."""
    f_F = inv_freq(head_dim // 2, theta, device)
    return list(torch.split(f_F, list(sections)))


def vision_sections(head_dim: int) -> tuple[int, int, int]:
    """(t, h, w) pair counts: a quarter to time, the rest split evenly between h and w."""
    F = head_dim // 2
    hw = (F - F // 4) // 2
    return (F - 2 * hw, hw, hw)


def vision_freqs(head_dim: int, theta: float, device: torch.device | None = None) -> list[Tensor]:
    """A full ladder per axis over that axis's own pairs."""
    return [inv_freq(n, theta, device) for n in vision_sections(head_dim)]


def apply_rotary(x_D: Tensor, cos_F: Tensor, sin_F: Tensor) -> Tensor:
    """Rotate pairs (i, i + F) of x (*, D) by the angles; cos/sin broadcast against x[..., :F].

    Computed in fp32, returned in x's dtype.
    """
    F = x_D.shape[-1] // 2
    x1, x2 = x_D.float()[..., :F], x_D.float()[..., F:]
    out_D = torch.cat([x1 * cos_F - x2 * sin_F, x2 * cos_F + x1 * sin_F], dim=-1)
    return out_D.to(x_D.dtype)
