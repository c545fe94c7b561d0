"""Prompts -> model inputs laid out as mmtrain's documents (remote code; `AutoProcessor`).

A prompt is `<|bos|>`, then its segments: text, or a medium as `<start>` + one placeholder per
merged visual token + `<end>` (no end-of-document: generation continues it). In `text`, each
`<|image_pad|>` / `<|video_pad|>` marks where the next image / video goes; with no text, each
medium alone is a prompt (images, then videos): the caption prompt of `mmtrain generate --image`.
Text between media is tokenized piece by piece (as mmtrain tokenizes segments), special-token
strings in it are plain text, and special ids are dropped. When a prompt is longer than the
context (`model_max_length`), the media budget shrinks as in training (halve the pixels down to
min_pixels, then the video frames); a prompt that still does not fit is an error. Rows are
left-padded for batched generation.

Legend: B prompts, S tokens, N patches.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

IMAGE, VIDEO = "<|image_pad|>", "<|video_pad|>"
MARKERS = {IMAGE: ("<|image_start|>", "<|image_end|>"), VIDEO: ("<|video_start|>", "<|video_end|>")}


class MmtrainProcessor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(
        self,
        images=None,
        text=None,
        videos=None,
        return_tensors: str | None = None,
        video_fps: float | list | None = None,
        padding_side: str = "left",
        **kwargs,
    ) -> BatchFeature:
        images = _as_list(images)
        videos = _as_list(videos)
        if text is None:
            texts = [IMAGE] * len(images) + [VIDEO] * len(videos)
        else:
            texts = [text] if isinstance(text, str) else list(text)
        fps = video_fps if isinstance(video_fps, (list, tuple)) else [video_fps] * len(videos)
        ip = self.image_processor
        decoded = {
            IMAGE: [ip.load_image(im)[None] for im in images],
            VIDEO: [ip.load_video(v, f) for v, f in zip(videos, fps)],
        }
        used = {IMAGE: 0, VIDEO: 0}
        rows, media = [], {IMAGE: [], VIDEO: []}
        for t in texts:
            segs = []
            for piece in re.split(f"({re.escape(IMAGE)}|{re.escape(VIDEO)})", t):
                if piece in MARKERS:
                    if used[piece] == len(decoded[piece]):
                        raise ValueError(
                            f"text: more {piece} placeholders than {'images' if piece == IMAGE else 'videos'}"
                        )
                    segs.append((piece, decoded[piece][used[piece]]))
                    used[piece] += 1
                elif piece:
                    segs.append(self._encode(piece))
            ids, row_media = self._document(segs)
            rows.append(ids)
            for kind, patches, grid in row_media:
                media[kind].append((patches, grid))
        if used[IMAGE] != len(images) or used[VIDEO] != len(videos):
            raise ValueError(
                f"text: {used[IMAGE]} image and {used[VIDEO]} video placeholders for "
                f"{len(images)} images and {len(videos)} videos"
            )
        data = self._pad(rows, padding_side)
        for kind, key, grid_key in (
            (IMAGE, "pixel_values", "image_grid_thw"),
            (VIDEO, "pixel_values_videos", "video_grid_thw"),
        ):
            if media[kind]:
                data[key] = np.concatenate([p for p, _ in media[kind]])
                data[grid_key] = np.array([g for _, g in media[kind]], np.int64)
        return BatchFeature(data, tensor_type=return_tensors)

    def _encode(self, text: str) -> list[int]:
        """Token ids of a text piece: special-token strings as plain text, special ids dropped."""
        backend = self.tokenizer.backend_tokenizer
        was = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            ids = backend.encode(text, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = was
        special = set(self.tokenizer.all_special_ids) | {
            self._id(m) for pair in MARKERS.items() for m in (pair[0], *pair[1])
        }
        return [i for i in ids if i not in special]

    def _id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)

    def _document(self, segs: list) -> tuple[list[int], list]:
        """[bos] + segments, the media at the first budget level where the document fits."""
        ip, seq_len = self.image_processor, self.tokenizer.model_max_length
        texts = sum(len(s) for s in segs if isinstance(s, list))
        if not any(isinstance(s, tuple) for s in segs):
            if texts + 2 > seq_len:
                raise ValueError(
                    f"text: the prompt ({texts} tokens) is longer than the context of {seq_len} tokens"
                )
            return [self.tokenizer.bos_token_id, *[i for s in segs for i in s]], []
        m2 = ip.merge_size**2
        for px, fr in ip.budget_levels():
            grids = [ip.grid(s[1], s[0] == VIDEO, px, fr) for s in segs if isinstance(s, tuple)]
            if texts + sum(2 + t * h * w // m2 for t, h, w in grids) <= seq_len - 2:  # bos + eos
                break
        else:
            raise ValueError(
                f"text: the prompt ({texts} text tokens, {len(grids)} media) is longer than the "
                f"context of {seq_len} tokens"
            )
        ids, media, grids_it = [self.tokenizer.bos_token_id], [], iter(grids)
        for s in segs:
            if isinstance(s, list):
                ids += s
                continue
            kind, frames = s
            t, h, w = next(grids_it)
            start, end = MARKERS[kind]
            ids += [self._id(start), *[self._id(kind)] * (t * h * w // m2), self._id(end)]
            media.append((kind, ip.patches(frames, kind == VIDEO, px, fr), (t, h, w)))
        return ids, media

    def _pad(self, rows: list[list[int]], side: str) -> dict:
        S, pad = max(len(r) for r in rows), self.tokenizer.pad_token_id
        ids = np.full((len(rows), S), pad, np.int64)
        mask = np.zeros((len(rows), S), np.int64)
        for b, r in enumerate(rows):
            sl = slice(S - len(r), S) if side == "left" else slice(0, len(r))
            ids[b, sl], mask[b, sl] = r, 1
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return [
            "input_ids",
            "attention_mask",
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
        ]


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    return [x]


__all__ = ["MmtrainProcessor"]
