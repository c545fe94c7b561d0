"""Pack documents into fixed-length rows and assemble the PackedBatch.

First fit with lookahead: the packer keeps up to `lookahead` documents pending and puts each,
oldest first, into the first row of the batch with room; the batch is closed when no pending
document fits anywhere. Documents never straddle rows (long texts were chunked upstream), and
whatever does not fit waits for the next batch, first in line.

Legend: B rows, S seq_len, N patches, P patch dim, M media.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_PAD, TEXT, PackedBatch
from mmtrain.data_pipelines.documents import Document


class Packer:
    def __init__(self, seq_len: int, batch_size: int, lookahead: int):
        self.seq_len, self.batch_size, self.lookahead = seq_len, batch_size, max(1, lookahead)
        self.pending: list[Document] = []

    def next_rows(self, pull: Callable[[], Document | None]) -> list[list[Document]] | None:
        """Documents per row for the next batch; None when the stream is exhausted."""
        rows: list[list[Document]] = [[] for _ in range(self.batch_size)]
        free = [self.seq_len] * self.batch_size
        exhausted = False
        while True:
            while not exhausted and len(self.pending) < self.lookahead:
                doc = pull()
                if doc is None:
                    exhausted = True
                else:
                    if len(doc) > self.seq_len:
                        raise ValueError(f"document of {len(doc)} tokens > seq_len {self.seq_len}")
                    self.pending.append(doc)
            placed, waiting = False, []
            for doc in self.pending:
                r = next((i for i, f in enumerate(free) if f >= len(doc)), None)
                if r is None:
                    waiting.append(doc)
                    continue
                rows[r].append(doc)
                free[r] -= len(doc)
                placed = True
            self.pending = waiting
            if not placed:
                break
        return rows if any(rows) else None


def assemble(rows: list[list[Document]], seq_len: int, pad_id: int, patch_dim: int) -> PackedBatch:
    """Rows of documents -> PackedBatch; media numbered in row-major placeholder order.

    Built in NumPy and wrapped without copies (torch ops thrash on small CPU tensors here).
    """
    B, S = len(rows), seq_len
    tokens_BS = np.full((B, S), pad_id, np.int64)
    labels_BS = np.full((B, S), IGNORE_INDEX, np.int64)
    doc_ids_BS = np.zeros((B, S), np.int32)
    span_ids_BS = np.full((B, S), -1, np.int32)
    modality_BS = np.full((B, S), TEXT, np.int8)
    task_BS = np.full((B, S), TASK_PAD, np.int8)
    pos_3BS = np.zeros((3, B, S), np.int64)
    media_ids_BS = np.full((B, S), -1, np.int32)
    media = []
    for r, docs in enumerate(rows):
        off, spans = 0, 0
        for d_i, d in enumerate(docs):
            sl = slice(off, off + len(d))
            tokens_BS[r, sl], labels_BS[r, sl] = d.tokens_L, d.labels_L
            doc_ids_BS[r, sl], task_BS[r, sl], modality_BS[r, sl] = d_i, d.task, d.modality_L
            pos_3BS[:, r, sl] = d.pos_3L
            visual = d.span_L >= 0
            span_ids_BS[r, sl] = np.where(visual, d.span_L + spans, -1)
            spans += int(d.span_L.max()) + 1 if visual.any() else 0
            ids = np.repeat(np.arange(len(media), len(media) + len(d.media), dtype=np.int32), d.media_tokens)
            media_ids_BS[r, sl][visual] = ids
            media.extend(d.media)
            off += len(d)
        doc_ids_BS[r, off:] = -1  # padding: a document of its own, id -1 (not routed, not counted)
        pos_3BS[:, r, off:] = np.arange(S - off)
    return PackedBatch(
        tokens_BS=torch.from_numpy(tokens_BS),
        labels_BS=torch.from_numpy(labels_BS),
        doc_ids_BS=torch.from_numpy(doc_ids_BS),
        span_ids_BS=torch.from_numpy(span_ids_BS),
        modality_BS=torch.from_numpy(modality_BS),
        task_BS=torch.from_numpy(task_BS),
        pos_ids_3BS=torch.from_numpy(pos_3BS),
        media_ids_BS=torch.from_numpy(media_ids_BS),
        patches_NP=torch.from_numpy(np.concatenate([m.patches_NP for m in media]) if media
                                    else np.zeros((0, patch_dim), np.float32)),
        grid_thw_M3=torch.from_numpy(np.array([m.grid_thw for m in media], np.int64).reshape(-1, 3)),
        media_kind_M=torch.from_numpy(np.array([m.kind for m in media], np.int8)),
    )

