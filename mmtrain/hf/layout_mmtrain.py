"""Token layout of a row, read from its ids and media grids as mmtrain's loader writes it.

A row holds one document: its real tokens (attention_mask 1), left padding before them for
generation. A medium is a run of its placeholder id (one per merged visual token, raster
(t, h, w) order of the merged grid); media are numbered in row-major placeholder order, images
and videos each in the order of their grids. M-RoPE positions (mmtrain's data pipeline): text
t = h = w = running position; a medium's token at merged cell (t, h, w) gets running + (t, h, w),
and the running position then moves on by max(t, h, w). Spans (bidirectional attention): one per
image, one per video frame (temporal slice).

Legend: B rows, S tokens, M media of a kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor
TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass
class Layout:
    real_BS: Tensor  # bool: a token of the row's document
    rank_BS: Tensor  # int64 position in the document (0 at its first token; padding 0)
    modality_BS: Tensor  # int64 TEXT / IMAGE / VIDEO
    span_BS: Tensor  # int64 visual span (unique in the row), -1 for text and padding
    pos_3BS: Tensor  # int64 M-RoPE (t, h, w); padding 0

    @property
    def next_pos_B(self) -> Tensor:
        """The M-RoPE position of the token after the row's last (t = h = w: text)."""
        return torch.where(self.real_BS[None], self.pos_3BS, -1).amax(dim=(0, 2)) + 1


def token_layout(
    ids_BS: Tensor,
    real_BS: Tensor,
    image_grid_M3: Tensor | None,
    video_grid_M3: Tensor | None,
    image_id: int,
    video_id: int,
    merge: int,
) -> Layout:
    """The layout of a batch (see the module docstring); ValueError when the placeholders and the
    grids disagree."""
    B, S = ids_BS.shape
    modality_BS = torch.where(ids_BS == image_id, IMAGE, torch.where(ids_BS == video_id, VIDEO, TEXT))
    modality_BS = torch.where(real_BS, modality_BS, TEXT)
    rank_BS = (real_BS.long().cumsum(1) - 1).clamp_min(0)
    pos_3BS = rank_BS[None].repeat(3, 1, 1)
    span_BS = torch.full_like(rank_BS, -1)
    if not bool((modality_BS != TEXT).any()):
        return Layout(real_BS, rank_BS, modality_BS, span_BS, pos_3BS)
    grids = {IMAGE: _grids(image_grid_M3), VIDEO: _grids(video_grid_M3)}
    used, span = {IMAGE: 0, VIDEO: 0}, 0
    for b in range(B):
        shift = 0  # how far the running position is ahead of the rank (media advance by max(t, h, w))
        mod = modality_BS[b].tolist()
        i = 0
        while i < S:
            kind = mod[i]
            if kind == TEXT:
                j = i
                while j < S and mod[j] == TEXT:
                    j += 1
                pos_3BS[:, b, i:j] += shift
                i = j
                continue
            if used[kind] == len(grids[kind]):
                raise ValueError(f"input_ids: more {('image', 'video')[kind - 1]} placeholders than grids")
            t, h, w = grids[kind][used[kind]]
            used[kind] += 1
            h, w = h // merge, w // merge
            n = t * h * w
            if mod[i : i + n] != [kind] * n:
                raise ValueError(
                    f"input_ids: a {('image', 'video')[kind - 1]} of grid {(t, h * merge, w * merge)} "
                    f"needs {n} placeholders in a run"
                )
            cell_3n = torch.stack(
                torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            ).reshape(3, n)
            start = int(rank_BS[b, i]) + shift
            pos_3BS[:, b, i : i + n] = start + cell_3n.to(pos_3BS.device)
            span_BS[b, i : i + n] = span + (cell_3n[0].to(span_BS.device) if kind == VIDEO else 0)
            span += t if kind == VIDEO else 1
            shift = start + max(t, h, w) - int(rank_BS[b, i + n - 1]) - 1
            i += n
    for kind, name in ((IMAGE, "image"), (VIDEO, "video")):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{name}_grid_thw: {len(grids[kind])} grids, {used[kind]} {name}s in input_ids")
    return Layout(real_BS, rank_BS, modality_BS, span_BS, pos_3BS)


def _grids(grid_M3: Tensor | None) -> list[list[int]]:
    return [] if grid_M3 is None else grid_M3.reshape(-1, 3).tolist()
