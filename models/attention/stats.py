"""Packed-batch attention statistics from recomputed rows (attention-map tool, collapse diagnostics).

One implementation for both users: pick the text query rows that can see pixels, recompute their
probabilities with `recompute_probs` (exactly the layer's mask) in chunks, and reduce each row at
once, so no S x S map is ever held. Per layer, per head, per query row:
  mass    = probability on visual tokens (all of them in the query's document);
  entropy = -sum p log p over all keys, in nats;
  sink    = probability on the first token of the query's document (its <|bos|>).
Reductions run on the device of the capture; callers move the small results where they need them.

Legend: B batch rows, S tokens, H heads, R query rows, r rows in a chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import AttentionConfig
from .meta import AttnMeta
from .recompute import recompute_probs

Tensor = torch.Tensor
TEXT = 0  # modality id of text tokens (data_pipelines.batch.TEXT; models never import data_pipelines)


@dataclass
class RowStats:
    mass_HR: Tensor  # float32, probability on visual tokens
    entropy_HR: Tensor  # float32, nats
    sink_HR: Tensor  # float32, probability on the document's first token


def doc_first_BS(doc_ids_BS: Tensor) -> Tensor:
    """Per token: the position of its document's first token (documents are contiguous runs)."""
    B, S = doc_ids_BS.shape
    start_BS = torch.ones(B, S, dtype=torch.bool, device=doc_ids_BS.device)
    start_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    pos_BS = torch.arange(S, device=doc_ids_BS.device).expand(B, S)
    return torch.where(start_BS, pos_BS, 0).cummax(dim=1).values


def text_rows(modality_BS: Tensor, doc_ids_BS: Tensor, text_BS: Tensor) -> Tensor:
    """(R, 2) (batch, position) of text tokens (text_BS) after a visual token of their document."""
    vis_BS = (modality_BS != TEXT).int()
    first_BS = doc_first_BS(doc_ids_BS)
    seen_BS = vis_BS.cumsum(1)  # visual tokens up to here in the row
    before_doc_BS = torch.where(first_BS > 0, seen_BS.gather(1, (first_BS - 1).clamp(min=0)), 0)
    return ((seen_BS - before_doc_BS > 0) & text_BS).nonzero()


def even_subset(n: int, k: int, device: torch.device | str | None = None) -> Tensor:
    """min(n, k) distinct indices spread evenly over range(n): a deterministic, bounded row sample."""
    if n <= k:
        return torch.arange(n, device=device)
    return torch.div(torch.arange(k, device=device) * n, k, rounding_mode="floor")


def reduce_rows(p_HrS: Tensor, rows_r2: Tensor, vis_BS: Tensor, first_BS: Tensor) -> RowStats:
    """Mass on visual tokens, entropy and sink of recomputed rows p (H, r, S) at (batch, position)."""
    b_r, i_r = rows_r2[:, 0], rows_r2[:, 1]
    mass_Hr = (p_HrS * vis_BS[b_r][None].to(p_HrS.dtype)).sum(-1)
    ent_Hr = torch.special.entr(p_HrS).sum(-1)
    first_Hr1 = first_BS[b_r, i_r][None, :, None].expand(p_HrS.shape[0], -1, 1)
    return RowStats(mass_Hr, ent_Hr, p_HrS.gather(-1, first_Hr1)[..., 0])


@torch.no_grad()
def row_stats(capture: dict, meta: AttnMeta, cfg: AttentionConfig, sparse: bool, rows_R2: Tensor,
              modality_BS: Tensor, doc_ids_BS: Tensor, chunk: int = 32,
              on_chunk: Callable[[int, Tensor], None] | None = None) -> RowStats:
    """Recompute the rows (R, 2) of one captured layer in chunks of `chunk` and reduce them.

    on_chunk(r0, p_HrS) sees each chunk's probabilities (rows r0 .. r0 + r) before they are
    dropped, e.g. to keep the maps of some rows."""
    dev = capture["q"].device
    rows_R2 = rows_R2.to(dev)
    vis_BS, first_BS = (modality_BS != TEXT).to(dev), doc_first_BS(doc_ids_BS).to(dev)
    H, R = capture["q"].shape[1], rows_R2.shape[0]
    out = RowStats(*(torch.zeros(H, R, device=dev) for _ in range(3)))
    for r0 in range(0, R, chunk):
        rows_r2 = rows_R2[r0:r0 + chunk]
        p_HrS = recompute_probs(capture, meta, cfg, sparse, rows_r2, chunk=chunk)
        part = reduce_rows(p_HrS, rows_r2, vis_BS, first_BS)
        out.mass_HR[:, r0:r0 + chunk] = part.mass_HR
        out.entropy_HR[:, r0:r0 + chunk] = part.entropy_HR
        out.sink_HR[:, r0:r0 + chunk] = part.sink_HR
        if on_chunk is not None:
            on_chunk(r0, p_HrS)
    return out
