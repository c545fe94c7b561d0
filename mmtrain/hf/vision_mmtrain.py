"""mmtrain's vision tower (a ViT trained from scratch) for the HF classes.

Input: the patches of all media concatenated (media in order, each in raster (t, h, w) order of
its patch grid; a patch is one (temporal_patch x patch x patch) tubelet, channel-major, normalised
pixels), with the grids. Each medium attends only to itself, bidirectionally; positions are axial
RoPE over (t, h, w) inside the medium plus, when `abs_pos_grid` > 0, a learned row + column
embedding of the patch's relative place in its frame. After the pre-norm blocks and the final
norm, each merge x merge neighbourhood becomes one token ((i, j) order inside it) and an MLP
(GELU, tanh) projects it to the decoder width, then (when `out_norm`) an RMSNorm with a learned
gain (fp32, eps `rms_norm_eps`); tokens leave per medium in raster (t, h', w').

Legend: N patches, P patch dim, D vision dim, O decoder dim, Q = N / merge^2 tokens, E head dim,
F rotary pairs, H heads, n patches of one medium.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops_mmtrain import RMSNorm, apply_rotary, attention, axial_angles, vision_freqs

Tensor = torch.Tensor


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # q | k | v, heads inside each
        self.proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None

    def forward(self, x_ND: Tensor, cos_NF: Tensor, sin_NF: Tensor, sizes: list[int], impl: str) -> Tensor:
        N, H, E = x_ND.shape[0], self.heads, self.head_dim
        q_HNE, k_HNE, v_HNE = self.qkv(x_ND).view(N, 3 * H, E).transpose(0, 1).split(H)
        if self.q_norm is not None:
            q_HNE, k_HNE = self.q_norm(q_HNE), self.k_norm(k_HNE)
        q_HNE, k_HNE = apply_rotary(q_HNE, cos_NF, sin_NF), apply_rotary(k_HNE, cos_NF, sin_NF)
        outs = []
        for q, k, v in zip(*(t.split(sizes, dim=1) for t in (q_HNE, k_HNE, v_HNE))):  # one medium at a time
            mask = torch.ones(1, 1, q.shape[1], q.shape[1], dtype=torch.bool, device=q.device)
            outs.append(attention(q[None], k[None], v[None], mask, impl)[0])
        return self.proj(torch.cat(outs, 1).transpose(0, 1).reshape(N, H * E))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        D = v["hidden_size"]
        self.norm1 = RMSNorm(D, v["rms_norm_eps"])
        self.attn = VisionAttention(D, v["num_heads"], v["qk_norm"], v["rms_norm_eps"])
        self.norm2 = RMSNorm(D, v["rms_norm_eps"])
        self.mlp = VisionMLP(D, v["intermediate_size"], D)

    def forward(self, x_ND: Tensor, cos_NF: Tensor, sin_NF: Tensor, sizes: list[int], impl: str) -> Tensor:
        x_ND = x_ND + self.attn(self.norm1(x_ND), cos_NF, sin_NF, sizes, impl)
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchEmbed(nn.Module):
    def __init__(self, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, dim, bias=True)

    def forward(self, x_NP: Tensor) -> Tensor:
        return self.proj(x_NP)


class Merger(nn.Module):
    def __init__(self, dim: int, merge: int, out: int, out_norm: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.mlp = VisionMLP(dim * merge * merge, dim * merge * merge, out)
        self.out_norm = RMSNorm(out, eps) if out_norm else None  # None: no weight, as exports without it

    def forward(self, x_QX: Tensor) -> Tensor:
        x_QO = self.mlp(x_QX)
        return x_QO if self.out_norm is None else self.out_norm(x_QO)


class MmtrainVision(nn.Module):
    def __init__(self, v: dict, out_dim: int) -> None:
        super().__init__()
        self.v = v
        D, G = v["hidden_size"], v["abs_pos_grid"]
        patch_dim = v["in_channels"] * v["temporal_patch"] * v["patch_size"] ** 2
        self.patch_embed = PatchEmbed(patch_dim, D)
        self.row_embed = nn.Parameter(torch.zeros(G, D)) if G else None
        self.col_embed = nn.Parameter(torch.zeros(G, D)) if G else None
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v["depth"]))
        self.norm = RMSNorm(D, v["rms_norm_eps"])
        self.merger = Merger(D, v["spatial_merge_size"], out_dim, v["out_norm"], v["rms_norm_eps"])

    def forward(self, patches_NP: Tensor, grid_M3: Tensor, impl: str) -> Tensor:
        """-> (Q, O) merged tokens, media in input order."""
        grids = grid_M3.tolist()
        sizes = [t * h * w for t, h, w in grids]
        if sum(sizes) != patches_NP.shape[0]:
            raise ValueError(
                f"grid_thw: patch counts sum to {sum(sizes)}, pixel_values has {patches_NP.shape[0]} rows"
            )
        m = self.v["spatial_merge_size"]
        pos_3N, src_N, rel_2N = _patch_tables(grids, m, patches_NP.device)
        freqs = vision_freqs(
            self.v["hidden_size"] // self.v["num_heads"], self.v["rope_theta"], patches_NP.device
        )
        angles_NF = axial_angles(pos_3N, freqs)
        cos_NF, sin_NF = angles_NF.cos(), angles_NF.sin()
        x_ND = self.patch_embed(patches_NP)
        if self.row_embed is not None:
            G = self.v["abs_pos_grid"]
            x_ND = (
                x_ND + self.row_embed[rel_2N[0] * G // rel_2N[2]] + self.col_embed[rel_2N[1] * G // rel_2N[3]]
            )
        for blk in self.blocks:
            x_ND = blk(x_ND, cos_NF, sin_NF, sizes, impl)
        x_ND = self.norm(x_ND)
        return self.merger(x_ND[src_N].reshape(len(src_N) // m**2, -1))


def _patch_tables(grids: list[list[int]], m: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """-> pos_3N (t, h, w in the medium), src_N (patch of every merged slot: per medium (t, h', w', i, j)),
    rel_4N (h, w, H, W: place and size of the frame, for the absolute embedding)."""
    pos, src, rel, start = [], [], [], 0
    for t, h, w in grids:
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pos.append(torch.stack([tt, hh, ww]).reshape(3, -1))
        idx = torch.arange(t * h * w).view(t, h // m, m, w // m, m).permute(0, 1, 3, 2, 4)
        src.append(start + idx.reshape(-1))
        rel.append(
            torch.stack(
                [hh.reshape(-1), ww.reshape(-1), torch.full((t * h * w,), h), torch.full((t * h * w,), w)]
            )
        )
        start += t * h * w
    return (torch.cat(pos, 1).to(device), torch.cat(src).to(device), torch.cat(rel, 1).to(device))
