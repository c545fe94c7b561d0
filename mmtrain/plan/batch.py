"""The planned micro-batch: `data.batch_size` rows of `data.seq_len` tokens, a stated share of them
visual. Each row holds documents of one image at `data.media.max_pixels` (square) and a caption,
until the visual share is reached, then one text document fills the row (no padding: the worst
case for activations). The integer fields are real tensors (the model reads document ids, spans
and grids on the host); the pixels are fake (no memory).

Legend: B rows, S seq_len, N patches, P patch dim, M media.
"""

from __future__ import annotations

import contextlib
import math

import torch

from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    IMAGE,
    TASK_IMAGE_TEXT,
    TASK_PAD,
    TASK_TEXT,
    PackedBatch,
)
from mmtrain.models.testing import Medium, pack

CAPTION = 64  # text tokens after each image


def image_grid(cfg) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a square image at max_pixels (h, w multiples of merge)."""
    media = cfg.data.media
    unit = media.patch_size * media.merge
    side = max(1, int(math.isqrt(media.max_pixels) // unit)) * media.merge
    return (1, side, side)  # an image is one tubelet deep


def plan_batch(cfg, fake_mode, visual_frac: float) -> PackedBatch:
    B, S, merge = cfg.data.batch_size, cfg.data.seq_len, cfg.data.media.merge
    grid = image_grid(cfg)
    n_vis = grid[0] * (grid[1] // merge) * (grid[2] // merge)
    per_doc = n_vis + CAPTION
    n_img = min(int(visual_frac * S // n_vis), (S - 1) // per_doc) if visual_frac > 0 else 0
    P = cfg.model.vision.patch_dim
    with fake_mode or contextlib.nullcontext():  # None: real pixels (the measured run)
        patches_NP = torch.randn(grid[0] * grid[1] * grid[2], P)
    vocab = cfg.model.decoder.vocab_size
    row = [[Medium(IMAGE, grid, patches_NP), _text(CAPTION, vocab)] for _ in range(n_img)]
    rest = S - n_img * per_doc
    row += [[_text(rest, vocab)]] if rest else []
    fields = pack([row] * B, S, P, merge)
    return _with_targets(fields, n_img, n_vis)


def _text(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n,))


def _with_targets(f: dict, n_img: int, n_vis: int) -> PackedBatch:
    """Labels on text tokens (the next id), tasks by document, media numbered row by row."""
    tokens_BS, mod_BS, doc_BS = f["tokens_BS"], f["modality_BS"], f["doc_ids_BS"]
    B = tokens_BS.shape[0]
    text_BS = mod_BS == 0
    labels_BS = torch.where(text_BS, tokens_BS.roll(-1, 1), IGNORE_INDEX)
    task_BS = torch.where(doc_BS < n_img, TASK_IMAGE_TEXT, TASK_TEXT).to(torch.int8)
    task_BS = torch.where(doc_BS < 0, TASK_PAD, task_BS).to(torch.int8)
    media_BS = torch.full_like(doc_BS, -1)
    m = B * n_img
    media_BS[~text_BS] = torch.arange(m, dtype=torch.int32).repeat_interleave(n_vis)
    return PackedBatch(tokens_BS=tokens_BS, labels_BS=labels_BS, doc_ids_BS=doc_BS,
                       span_ids_BS=f["span_ids_BS"], modality_BS=mod_BS, task_BS=task_BS,
                       pos_ids_3BS=f["pos_ids_3BS"], media_ids_BS=media_BS, patches_NP=f["patches_NP"],
                       grid_thw_M3=f["grid_thw_M3"], media_kind_M=torch.full((m,), IMAGE, dtype=torch.int8))
