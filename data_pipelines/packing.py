"""Pack documents into fixed-length rows and assemble the PackedBatch.

First fit with lookahead: the packer keeps up to `lookahead` documents pending and puts each,
oldest first, into the first row of the batch with room; the batch is closed when no pending
document fits anywhere. Documents never straddle rows (long texts were chunked upstream), and
whatever does not fit waits for the next batch, first in line.

Visual budgets (`max_media`, `max_visual` per row; 0 = none): a document goes only where it keeps
its row within both, else it waits like one without room (held back, never dropped: it stays
pending, so the loader's state still resumes exactly). `held_back` counts, per closed batch, the
waiting documents that had the tokens' room somewhere but not the budgets'. The vision encoder's
cost is a sum over media of n^2 + n terms, so a row's tokens alone do not bound it.

Legend: B rows, S seq_len, N patches, P patch dim, M media.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_PAD, TEXT, PackedBatch
from mmtrain.data_pipelines.documents import Document


class Packer:
    def __init__(self, seq_len: int, batch_size: int, lookahead: int, max_media: int = 0,
                 max_visual: int = 0):
        self.seq_len, self.batch_size, self.lookahead = seq_len, batch_size, max(1, lookahead)
        self.max_media, self.max_visual = max_media or float("inf"), max_visual or float("inf")
        self.pending: list[Document] = []
        self.held_back = 0  # documents that waited for a visual budget only (see the module docstring)

    def next_rows(self, pull: Callable[[], Document | None]) -> list[list[Document]] | None:
        """Documents per row for the next batch; None when the stream is exhausted."""
        rows: list[list[Document]] = [[] for _ in range(self.batch_size)]
        free = [self.seq_len] * self.batch_size
        media, visual = [0] * self.batch_size, [0] * self.batch_size
        exhausted = False
        while True:
            while not exhausted and len(self.pending) < self.lookahead:
                doc = pull()
                if doc is None:
                    exhausted = True
                else:
                    self._check(doc)
                    self.pending.append(doc)
            placed, waiting = False, []
            for doc in self.pending:
                r = next((i for i, f in enumerate(free) if f >= len(doc) and
                          media[i] + len(doc.media) <= self.max_media and
                          visual[i] + sum(doc.media_tokens) <= self.max_visual), None)
                if r is None:
                    waiting.append(doc)
                    continue
                rows[r].append(doc)
                free[r] -= len(doc)
                media[r] += len(doc.media)
                visual[r] += sum(doc.media_tokens)
                placed = True
            self.pending = waiting
            if not placed:
                break
        self.held_back += sum(any(f >= len(d) for f in free) for d in self.pending)
        return rows if any(rows) else None

    def _check(self, doc: Document) -> None:
        """A document that no empty row can take would wait forever: an error, like one too long."""
        if len(doc) > self.seq_len:
            raise ValueError(f"document of {len(doc)} tokens > seq_len {self.seq_len}")
        if len(doc.media) > self.max_media:
            raise ValueError(f"document with {len(doc.media)} media > max_media_per_row {self.max_media}")
        if sum(doc.media_tokens) > self.max_visual:
            raise ValueError(f"document with {sum(doc.media_tokens)} visual tokens > "
                             f"max_visual_tokens_per_row {self.max_visual}")


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

