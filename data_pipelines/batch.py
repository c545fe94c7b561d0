"""The packed batch: the one contract between the data pipeline and the trainer.

Shape legend: B = rows, S = seq_len, N = visual patches in the batch (all media, all rows),
P = patch dim (channels * temporal_patch * patch * patch), M = media in the batch.

Media are numbered 0..M-1 in the order their placeholder tokens appear when the (B, S) token
grid is read row by row; their patches are concatenated in the same order, each medium's
patches in raster (t, h, w) order of its patch grid. So
`tokens_BS[tokens_BS == image_pad or video_pad]` lines up with the vision encoder's output
after the `merge x merge` spatial merge (one placeholder per merged token).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Modality of a token (modality_BS) and of a medium (media_kind_M).
TEXT, IMAGE, VIDEO = 0, 1, 2
MODALITY_NAMES = ("text", "image", "video")

# Task of the document a token belongs to (task_BS): which loss the token's target feeds.
TASK_TEXT, TASK_IMAGE_TEXT, TASK_VIDEO_TEXT, TASK_PAD = 0, 1, 2, -1
TASK_NAMES = ("text", "image_text", "video_text")
MEDIA_TASKS = TASK_NAMES[1:]  # the tasks whose documents hold media

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    tokens_BS: torch.Tensor  # int64 token ids; visual tokens hold the image_pad / video_pad id
    labels_BS: torch.Tensor  # int64 next-token target per position, IGNORE_INDEX where no loss
    doc_ids_BS: torch.Tensor  # int32 document index within the row (0, 1, ...); padding is document -1
    span_ids_BS: torch.Tensor  # int32 bidirectional span (one image / one video frame), -1 for text
    modality_BS: torch.Tensor  # int8 TEXT / IMAGE / VIDEO of the token itself
    task_BS: torch.Tensor  # int8 TASK_* of the token's document (TASK_PAD for padding)
    pos_ids_3BS: torch.Tensor  # int64 M-RoPE positions (t, h, w); text has t = h = w
    media_ids_BS: torch.Tensor  # int32 medium index in 0..M-1 for visual tokens, -1 elsewhere
    patches_NP: torch.Tensor  # float32 normalised pixels of every medium, media concatenated
    grid_thw_M3: torch.Tensor  # int64 patch grid (t, h, w) of each medium, before the merge
    media_kind_M: torch.Tensor  # int8 IMAGE or VIDEO per medium

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        )

    def pin_memory(self) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    @property
    def loss_mask_BS(self) -> torch.Tensor:
        return self.labels_BS != IGNORE_INDEX

    def num_tokens(self) -> int:
        """Non-padding tokens (text + visual placeholders)."""
        return int((self.task_BS != TASK_PAD).sum())

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The tensors the model's forward takes (models never see this class)."""
        return dict(
            tokens_BS=self.tokens_BS,
            pos_ids_3BS=self.pos_ids_3BS,
            doc_ids_BS=self.doc_ids_BS,
            span_ids_BS=self.span_ids_BS,
            modality_BS=self.modality_BS,
            patches_NP=self.patches_NP,
            grid_thw_M3=self.grid_thw_M3,
        )
