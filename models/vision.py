"""Vision encoder: a ViT trained from scratch over packed media of any resolution and length.

Patches of all media arrive concatenated (NaViT-style packing), each medium in raster (t, h, w)
order of its patch grid; a patch is one (temporal_patch x patch x patch) tubelet, flattened.
Attention is bidirectional inside one medium only (doc = span = medium), so media never see
each other. Positions: axial RoPE over (t, h, w) -- 2-D inside a frame (images have t = 0), and
a temporal section so that a video is a sequence of frames, not a bag of images. After the
blocks, each merge x merge patch neighbourhood becomes one token and an MLP projects it to the
decoder width; tokens come out per medium in raster (t, h / merge, w / merge) order, matching
the placeholder order of the packed batch.

Optional self-supervised term (SimMIM-style, `ssl_head`): a second pass over the media that
have masked patches, with those patches' embeddings replaced by a learned mask token, and a
linear head predicting their (already normalised) pixels from the final normed features.

Legend: N patches (all media), P patch dim (C * tp * p * p), M media, D vision dim,
O output (decoder) dim, Q = N / merge^2 merged tokens, F rotary pairs, H heads, K masked patches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.checks import check

from .attention import AttentionConfig, build_meta
from .ffn import GeluMLP
from .norms import RMSNorm
from .rope import axial_angles, vision_freqs
from .self_attention import SelfAttention

Tensor = torch.Tensor


@dataclass
class VisionConfig:
    patch_size: int = 8
    temporal_patch: int = 2
    in_channels: int = 3
    dim: int = 96
    depth: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    merge: int = 2  # merge x merge patches -> one decoder token
    rope_theta: float = 10000.0
    qk_norm: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # Learned absolute position of a patch inside its frame, as G row + G column embeddings
    # indexed by the patch's relative coordinate (h * G // H): resolution-free. RoPE alone is
    # translation-equivariant, so "top left" would have to be inferred from the decoder's
    # M-RoPE offsets; this makes it a feature of the visual token. 0 disables.
    abs_pos_grid: int = 0
    # Masked-patch reconstruction: a learned mask token and a linear pixel head (`masked_patch_loss`).
    ssl_head: bool = False
    # RMSNorm on the projector's output: the visual tokens enter the decoder at RMS = its gain (1 at
    # init). Without it, Adam's lr-sized steps on the projector's small, noisy gradients grow their
    # norm 100-1000x in a text-heavy run, and the decoder's pre-norms then shrink every gradient into
    # the vision path by as much (docs/EXPERIMENTS.md, the onset experiment).
    out_norm: bool = False
    # ... after subtracting each medium's mean visual token: measured, the projector's output in a
    # text-heavy run is a constant vector plus a deviation 2-30% of its norm (0.01% under out_norm
    # alone), so a norm by itself keeps the decoder blind; centred, the deviation is all that is left.
    out_center: bool = False

    def __post_init__(self) -> None:
        check(self, "abs_pos_grid", ge=0)
        check(self, "patch_size", "temporal_patch", "in_channels", "dim", "depth", "n_heads", "merge", ge=1)
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(f"n_heads: dim / n_heads must be a multiple of 4 for (t, h, w) RoPE "
                             f"(got dim {self.dim}, n_heads {self.n_heads})")
        check(self, "mlp_ratio", gt=0)
        check(self, "rope_theta", gt=1)
        if self.out_center and not self.out_norm:
            raise ValueError("out_center: needs out_norm (centring alone leaves the scale free)")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch_size ** 2


def patch_layout(grid_thw_M3: Tensor, n_patches: int, merge: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> medium_N, pos_3N (t, h, w inside its medium), src_N (patch index in merged order).

    Merged order: per medium (t, h', w', i, j) with h = h' * merge + i, w = w' * merge + j, so
    src_N reshaped to (Q, merge^2) lists each merged token's patches.
    """
    grid = grid_thw_M3.tolist()  # one host sync: validate before indexing with it
    sizes = [t * h * w for t, h, w in grid]
    if sum(sizes) != n_patches:
        raise ValueError(f"grid_thw: patch counts sum to {sum(sizes)}, patches_NP has {n_patches} rows")
    bad = [g for g in grid if g[1] % merge or g[2] % merge or min(g) < 1]
    if bad:
        raise ValueError(f"grid_thw: h and w must be positive multiples of merge {merge} (got {bad[0]})")
    dev = grid_thw_M3.device
    g_M3 = grid_thw_M3.long()
    size_M = g_M3.prod(-1)
    medium_N = torch.repeat_interleave(torch.arange(len(grid), device=dev), size_M, output_size=n_patches)
    start_M = size_M.cumsum(0) - size_M
    r_N = torch.arange(n_patches, device=dev) - start_M[medium_N]  # index inside the medium
    Hh, Ww = g_M3[medium_N, 1], g_M3[medium_N, 2]
    pos_3N = torch.stack([r_N // (Hh * Ww), (r_N // Ww) % Hh, r_N % Ww])
    m = merge
    j, i = r_N % m, (r_N // m) % m
    w2, h2 = (r_N // m**2) % (Ww // m), (r_N // (m**2 * (Ww // m))) % (Hh // m)
    src_N = start_M[medium_N] + pos_3N[0] * Hh * Ww + (h2 * m + i) * Ww + w2 * m + j
    return medium_N, pos_3N, src_N


def size_order(grid_thw_M3: Tensor) -> Tensor | None:
    """-> perm_N: the patch permutation that stably sorts the media by patch count; None when
    equal sizes already sit together. The blocks treat each medium alone, so the order is free,
    and the fused attention runs one batched call per run of equal-size media (sdpa's "batch"
    kind): in input order, a batch alternating images and clips is cut into masked groups."""
    sizes = grid_thw_M3.long().prod(-1).tolist()
    runs = 1 + sum(a != b for a, b in itertools.pairwise(sizes))
    if runs <= len(set(sizes)):
        return None
    start = [0, *itertools.accumulate(sizes)]
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    return torch.cat([torch.arange(start[m], start[m + 1]) for m in order]).to(grid_thw_M3.device)


def make_ssl_mask(grid_thw_M3: Tensor, mask_ratio: float, media_share: float,
                  generator: torch.Generator | None = None) -> Tensor:
    """-> mask_N (bool): round(media_share * M) random media (>= 1 when share > 0), and in each
    round(mask_ratio * n) of its n patches (>= 1), at random; deterministic given `generator`.
    """
    if not 0 < mask_ratio < 1:
        raise ValueError(f"mask_ratio: must be in (0, 1) (got {mask_ratio})")
    if not 0 <= media_share <= 1:
        raise ValueError(f"media_share: must be in [0, 1] (got {media_share})")
    sizes = grid_thw_M3.long().prod(-1).tolist()
    M, dev = len(sizes), generator.device if generator is not None else torch.device("cpu")
    n_media = max(round(media_share * M), 1) if media_share > 0 and M > 0 else 0
    starts = [0, *itertools.accumulate(sizes)]
    mask_N = torch.zeros(sum(sizes), dtype=torch.bool, device=dev)
    for m in sorted(torch.randperm(M, generator=generator, device=dev)[:n_media].tolist()):
        k = max(round(mask_ratio * sizes[m]), 1)
        mask_N[starts[m] + torch.randperm(sizes[m], generator=generator, device=dev)[:k]] = True
    return mask_N.to(grid_thw_M3.device)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = SelfAttention(cfg.dim, cfg.n_heads, cfg.n_heads, cfg.qk_norm, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GeluMLP(cfg.dim, int(cfg.mlp_ratio * cfg.dim))

    def forward(self, x_1ND: Tensor, cos_11NF: Tensor, sin_11NF: Tensor, meta,
                attn_cfg: AttentionConfig) -> Tensor:
        x_1ND = x_1ND + self.attn(self.attn_norm(x_1ND), cos_11NF, sin_11NF, meta, attn_cfg)
        return x_1ND + self.mlp(self.mlp_norm(x_1ND))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, out_dim: int, attn_cfg: AttentionConfig | None = None) -> None:
        super().__init__()
        self.cfg, self.out_dim = cfg, out_dim
        self.attn_cfg = attn_cfg or AttentionConfig()
        self.group_by_size = True  # run media grouped by size (size_order); False: input order, the reference
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.dim, bias=True)
        G = cfg.abs_pos_grid
        self.row_embed = nn.Parameter(torch.empty(G, cfg.dim)) if G else None
        self.col_embed = nn.Parameter(torch.empty(G, cfg.dim)) if G else None
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        merged = cfg.dim * cfg.merge ** 2
        self.projector = GeluMLP(merged, merged, out_dim)  # Qwen2-VL-style merger
        self.out_norm = RMSNorm(out_dim, cfg.norm_eps) if cfg.out_norm else None  # None: state_dict as before
        # None when off: no parameters, so state_dicts (and checkpoints) stay as they were
        self.mask_token = nn.Parameter(torch.empty(cfg.dim)) if cfg.ssl_head else None
        self.ssl_head = nn.Linear(cfg.dim, cfg.patch_dim) if cfg.ssl_head else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std, out_std = self.cfg.init_std, self.cfg.init_std / (2 * self.cfg.depth) ** 0.5
        nn.init.normal_(self.patch_embed.weight, std=std)
        nn.init.zeros_(self.patch_embed.bias)
        if self.row_embed is not None:
            nn.init.normal_(self.row_embed, std=std)
            nn.init.normal_(self.col_embed, std=std)
        for blk in self.blocks:
            blk.attn.reset_parameters(std, out_std)
            nn.init.normal_(blk.mlp.w_in.weight, std=std)
            nn.init.normal_(blk.mlp.w_out.weight, std=out_std)
            blk.attn_norm.reset_parameters()
            blk.mlp_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.projector.w_in.weight, std=std)
        nn.init.normal_(self.projector.w_out.weight, std=std)
        if self.out_norm is not None:
            self.out_norm.reset_parameters()
        if self.ssl_head is not None:
            nn.init.normal_(self.mask_token, std=std)
            nn.init.normal_(self.ssl_head.weight, std=std)
            nn.init.zeros_(self.ssl_head.bias)

    def forward(self, patches_NP: Tensor, grid_thw_M3: Tensor) -> Tensor:
        """-> (N / merge^2, out_dim) merged visual tokens, media in input order."""
        if patches_NP.shape[-1] != self.cfg.patch_dim:
            raise ValueError(f"patches: need {self.cfg.patch_dim} values per patch "
                             f"(C * tp * p * p) (got {patches_NP.shape[-1]})")
        if grid_thw_M3.shape[0] == 0:
            return self._no_media(patches_NP)
        return self._encode(patches_NP, grid_thw_M3)

    def masked_patch_loss(self, patches_NP: Tensor, grid_thw_M3: Tensor, mask_N: Tensor) -> Tensor:
        """Mean squared error of the predicted pixels of the masked patches (fp32 scalar).

        Nothing masked (or no media): 0, still from a pass over a blank frame, so every rank runs
        the same blocks (FSDP2) and the mask token and head get (zero) gradients (DDP).
        """
        self._check_ssl(patches_NP, mask_N)
        if grid_thw_M3.shape[0] == 0 or not bool(mask_N.any()):
            m = self.cfg.merge
            blank_NP = patches_NP.new_zeros(m * m, self.cfg.patch_dim)
            grid_13 = torch.tensor([[1, m, m]], device=patches_NP.device)
            one_N = torch.arange(m * m, device=patches_NP.device) == 0
            return 0.0 * self._masked_predictions(blank_NP, grid_13, one_N).float().square().mean()
        pred_KP = self._masked_predictions(patches_NP, grid_thw_M3, mask_N)
        return (pred_KP.float() - patches_NP[mask_N].float()).square().mean()

    def masked_patch_predictions(self, patches_NP: Tensor, grid_thw_M3: Tensor, mask_N: Tensor) -> Tensor:
        """(K, P) predicted pixels of the K masked patches, in patch order."""
        self._check_ssl(patches_NP, mask_N)
        if grid_thw_M3.shape[0] == 0 or not bool(mask_N.any()):
            return patches_NP.new_zeros(0, self.cfg.patch_dim)
        return self._masked_predictions(patches_NP, grid_thw_M3, mask_N)

    def _check_ssl(self, patches_NP: Tensor, mask_N: Tensor) -> None:
        if self.ssl_head is None:
            raise ValueError("ssl_head: masked_patch_loss needs VisionConfig(ssl_head=True)")
        if patches_NP.shape[-1] != self.cfg.patch_dim:
            raise ValueError(f"patches: need {self.cfg.patch_dim} values per patch "
                             f"(got {patches_NP.shape[-1]})")
        if mask_N.dtype != torch.bool or mask_N.shape != patches_NP.shape[:1]:
            raise ValueError(f"ssl_mask: need a bool (N,) mask over the {patches_NP.shape[0]} patches "
                             f"(got {mask_N.dtype} {tuple(mask_N.shape)})")

    def _masked_predictions(self, patches_NP: Tensor, grid_thw_M3: Tensor, mask_N: Tensor) -> Tensor:
        """Second pass over only the media with a masked patch (the rest would be wasted work)."""
        size_M = grid_thw_M3.long().prod(-1)
        medium_N = torch.repeat_interleave(torch.arange(len(size_M), device=mask_N.device), size_M)
        if medium_N.shape[0] != mask_N.shape[0]:
            raise ValueError(f"grid_thw: patch counts sum to {medium_N.shape[0]}, "
                             f"patches_NP has {mask_N.shape[0]} rows")
        hit_M = torch.zeros_like(size_M, dtype=torch.bool).index_fill_(0, medium_N[mask_N], True)
        keep_N = hit_M[medium_N]
        sub_mask_N = mask_N[keep_N]
        x_ND, _ = self._features(patches_NP[keep_N], grid_thw_M3[hit_M], sub_mask_N)
        return self.ssl_head(x_ND[sub_mask_N])

    def _abs_pos(self, grid_thw_M3: Tensor, medium_N: Tensor, pos_3N: Tensor) -> Tensor:
        """(N, D) row + column embedding of each patch's relative place in its frame."""
        G = self.cfg.abs_pos_grid
        hw_N2 = grid_thw_M3.long()[medium_N, 1:]
        row_N = pos_3N[1] * G // hw_N2[:, 0]
        col_N = pos_3N[2] * G // hw_N2[:, 1]
        # index_select: its backward is an index_add (x[idx]'s, an index_put, is ~10x slower on CPU)
        return self.row_embed.index_select(0, row_N) + self.col_embed.index_select(0, col_N)

    def _no_media(self, patches_NP: Tensor) -> Tensor:
        """No media: run one blank frame and return 0 rows still tied to every parameter.

        Every rank then runs the same blocks (FSDP2 collectives stay matched) and every vision
        parameter gets a (zero) gradient.
        """
        m = self.cfg.merge
        blank_NP = patches_NP.new_zeros(m * m, self.cfg.patch_dim)
        grid_13 = torch.tensor([[1, m, m]], device=patches_NP.device)
        out_QO = self._encode(blank_NP, grid_13)
        return out_QO[:0] + 0.0 * out_QO.sum()

    def _encode(self, patches_NP: Tensor, grid_thw_M3: Tensor) -> Tensor:
        cfg, N = self.cfg, patches_NP.shape[0]
        x_ND, src_N = self._features(patches_NP, grid_thw_M3)
        x_QD4 = x_ND.index_select(0, src_N).reshape(N // cfg.merge ** 2, cfg.merge ** 2 * cfg.dim)
        out_QO = self.projector(x_QD4)
        if cfg.out_center:
            out_QO = out_QO - _medium_means(out_QO, grid_thw_M3, cfg.merge)
        return out_QO if self.out_norm is None else self.out_norm(out_QO)

    def _features(self, patches_NP: Tensor, grid_thw_M3: Tensor,
                  mask_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """-> (N, D) final normed per-patch features (masked patches enter as the mask token), src_N;
        in input order, though the blocks run with media grouped by size (see size_order)."""
        medium_N, pos_3N, src_N = patch_layout(grid_thw_M3, patches_NP.shape[0], self.cfg.merge)
        perm_N = size_order(grid_thw_M3) if self.group_by_size else None
        if perm_N is None:
            return self._blocks(patches_NP, grid_thw_M3, medium_N, pos_3N, mask_N), src_N
        x_ND = self._blocks(patches_NP.index_select(0, perm_N), grid_thw_M3, medium_N[perm_N],
                            pos_3N[:, perm_N], None if mask_N is None else mask_N[perm_N])
        inv_N = torch.empty_like(perm_N)
        inv_N[perm_N] = torch.arange(len(perm_N), device=perm_N.device)
        return x_ND.index_select(0, inv_N), src_N

    def _blocks(self, patches_NP: Tensor, grid_thw_M3: Tensor, medium_N: Tensor, pos_3N: Tensor,
                mask_N: Tensor | None) -> Tensor:
        """Patches in any order of whole media (medium_N, pos_3N say whose and where) -> (N, D)."""
        cfg = self.cfg
        head_dim = cfg.dim // cfg.n_heads
        angles_NF = axial_angles(pos_3N, vision_freqs(head_dim, cfg.rope_theta, patches_NP.device))
        cos_11NF, sin_11NF = angles_NF.cos()[None, None], angles_NF.sin()[None, None]
        meta = build_meta(medium_N[None], medium_N[None], self.attn_cfg.block_size)
        x_1ND = self.patch_embed(patches_NP)[None]
        if mask_N is not None:  # positions are added as usual: the model knows where the hole is
            x_1ND = torch.where(mask_N[None, :, None], self.mask_token.to(x_1ND.dtype), x_1ND)
        if self.row_embed is not None:
            x_1ND = x_1ND + self._abs_pos(grid_thw_M3, medium_N, pos_3N)[None]
        for blk in self.blocks:
            x_1ND = blk(x_1ND, cos_11NF, sin_11NF, meta, self.attn_cfg)
        return self.norm(x_1ND[0])


def _medium_means(x_QO: Tensor, grid_thw_M3: Tensor, merge: int) -> Tensor:
    """(Q, O): each merged token's row is its medium's mean token (media contiguous, in input order)."""
    tokens_M = (grid_thw_M3.prod(-1) // merge ** 2).to(x_QO.device)
    medium_Q = torch.repeat_interleave(torch.arange(len(tokens_M), device=x_QO.device), tokens_M)
    sums_MO = x_QO.new_zeros(len(tokens_M), x_QO.shape[1]).index_add_(0, medium_Q, x_QO)
    return (sums_MO / tokens_M.to(x_QO.dtype)[:, None]).index_select(0, medium_Q)
