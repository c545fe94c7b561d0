"""Next visual token prediction (AIM-style) on the decoder's visual positions: which position
predicts which pixels.

A visual token followed by another token of its own medium predicts that next token's raw pixels
from the decoder's final hidden state at its own position; the last token of every medium predicts
nothing. "Next" is the merged raster order (per medium (t, h', w')) that the vision encoder emits and
the placeholders hold (data_pipelines/batch.py), so the pairs follow from the grids alone. A merged
token's pixels are its merge^2 patches in (i, j) order (patch row h' * merge + i, column
w' * merge + j of frame t), each a flattened (C, tp, p, p) tubelet of `patches_NP`: `patch_layout`'s
src_N, the same gather the merge step does on the features.

Inside one image (one video frame) the decoder attends bidirectionally (one span), so position i
already reads token i + 1's visual embedding: there the target is the neighbour's pixels rebuilt
through the decoder, and only the step from a frame's last token to the next frame's first is a
causal prediction. Both still need the pixels to survive the ViT, the projector and the decoder.

Legend: B rows, S sequence, N patches, P patch dim, M media, Q merged tokens (all media), K tokens
with a target, T target values per token (merge^2 * P).
"""

from __future__ import annotations

import itertools

import torch

from .vision import patch_layout

Tensor = torch.Tensor
NORM_EPS = 1e-6  # MAE's: a flat target token normalises to ~0, not to noise


def next_pairs(grid_thw_M3: Tensor, merge: int) -> Tensor:
    """-> src_K: the merged tokens (indices into all media's tokens, in order) that have a next
    token in their medium; token src_K predicts token src_K + 1."""
    tokens_M = grid_thw_M3.long().prod(-1) // merge ** 2
    medium_Q = torch.repeat_interleave(torch.arange(len(tokens_M), device=grid_thw_M3.device), tokens_M)
    return torch.nonzero(medium_Q[1:] == medium_Q[:-1]).flatten()


def target_count(grid_thw_M3: Tensor, merge: int, values: int) -> int:
    """K x T of `next_targets`: the values the media's next-token targets hold (no data read)."""
    tokens_M = grid_thw_M3.long().prod(-1) // merge ** 2
    return int((tokens_M - 1).clamp(min=0).sum()) * values


def predicting_positions(modality_BS: Tensor, grid_thw_M3: Tensor, merge: int) -> tuple[Tensor, Tensor]:
    """-> (b_K, s_K): the decoder positions of the tokens of `next_pairs`, in its order."""
    b_Q, s_Q = torch.nonzero(modality_BS != 0, as_tuple=True)  # row-major: the scatter's order
    src_K = next_pairs(grid_thw_M3, merge).to(b_Q.device)
    if src_K.numel() and int(src_K[-1]) + 1 >= b_Q.numel():
        raise ValueError(f"modality: {b_Q.numel()} visual placeholders, fewer than grid_thw's merged tokens")
    return b_Q[src_K], s_Q[src_K]


def chunk_pairs(modality_BS: Tensor, grid_thw_M3: Tensor, merge: int, lo: int, hi: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Context parallelism: of `predicting_positions` (whole rows), the ones in this rank's chunk
    lo .. hi of every row -> (b_k, s_k - lo, keep_K bool over next_pairs' order)."""
    b_K, s_K = predicting_positions(modality_BS, grid_thw_M3, merge)
    keep_K = (s_K >= lo) & (s_K < hi)
    return b_K[keep_K], s_K[keep_K] - lo, keep_K


def merged_pixels(patches_NP: Tensor, grid_thw_M3: Tensor, merge: int) -> Tensor:
    """(Q, T) every merged token's raw pixels: its merge^2 patches in (i, j) order, concatenated."""
    _, _, src_N = patch_layout(grid_thw_M3, patches_NP.shape[0], merge)
    return patches_NP.index_select(0, src_N.to(patches_NP.device)).reshape(
        -1, merge ** 2 * patches_NP.shape[-1])


def normalise_tokens(x_KT: Tensor) -> Tensor:
    """Each row to mean 0, variance 1 over its values (MAE's normalised pixel targets): the loss is
    about a token's structure, not its brightness or contrast."""
    centred_KT = x_KT - x_KT.mean(-1, keepdim=True)
    return centred_KT / (centred_KT.square().mean(-1, keepdim=True) + NORM_EPS).sqrt()


def next_targets(patches_NP: Tensor, grid_thw_M3: Tensor, merge: int, normalize: bool = True) -> Tensor:
    """(K, T) fp32 target of each token of `next_pairs`: the pixels of the token after it."""
    pix_QT = merged_pixels(patches_NP.float(), grid_thw_M3, merge)
    dst_K = next_pairs(grid_thw_M3, merge).to(pix_QT.device) + 1
    target_KT = pix_QT.index_select(0, dst_K)
    return normalise_tokens(target_KT) if normalize else target_KT


def next_targets_reference(media_ids_BS: Tensor, patches_NP: Tensor, grid_thw_M3: Tensor,
                           merge: int) -> list[tuple[int, int, Tensor]]:
    """The slow reference, from the batch's own medium ids: a loop over media and their merged grid
    cells -> [(b, s, raw target pixels)] for every visual position with a next token in its medium,
    media in order, each medium's positions row-major."""
    out, start = [], 0
    for m, (t, h, w) in enumerate(grid_thw_M3.tolist()):
        positions = torch.nonzero(media_ids_BS == m).tolist()  # row-major
        cells = list(itertools.product(range(t), range(h // merge), range(w // merge)))
        if len(positions) != len(cells):
            raise ValueError(f"media_ids: medium {m} has {len(positions)} placeholders, {len(cells)} tokens")
        for (b, s), (tt, hh, ww) in zip(positions, cells[1:]):  # the last position has no next cell
            rows = [start + tt * h * w + (hh * merge + i) * w + ww * merge + j
                    for i in range(merge) for j in range(merge)]
            out.append((b, s, patches_NP[rows].flatten()))
        start += t * h * w
    return out
